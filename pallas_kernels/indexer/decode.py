"""Mosaic GPU (Hopper) kernel for a decode step's index scores (one query a batch row): one CTA per
(batch row, block of 256 keys), one warpgroup. Checked in the interpreter and for CUDA lowering
(session 34); untimed, so the model takes it only with ``Numerics.decode_index_kernel``.

Why a second kernel: the prefill kernel (``kernel.py``) puts 128 queries of one sequence on the wgmma
M side, all padding at T = 1, so decode steps score in XLA: a dot into float32 [B, H, S] (33 MB at
B = 64, H = 32, S = 4096) and a fusion reading it back for relu x weight summed over heads.

Here the keys are the M side: each 64-key chunk of the CTA's tile is a wgmma A operand [64, 128] from
shared memory, the query's heads the B operand [128, H] (N = H), so the accumulator is [64 keys, H].
Then relu, times the head weights (a column broadcast) and the sum over heads (a fixed order: each
thread's own columns, then two quad shuffles), and 64 scores go out. Each key is read once and only
the [B, S] scores are written.

Invariance: a score is a function of its query, its key and the head weights only (one wgmma chain
over the 128-dim dot per (key, head), a fixed reduction over heads). Keys at or past the row's visible
count score -inf (the op's contract); tiles wholly past it are not computed. Other rounding than XLA's head sum (float32 sums in
another order), so a model that switches to it changes decode bits, still batch-invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.indexer.config import decode_unsupported_reason
from pallas_kernels.mosaic import tiled

KEY_ROWS = 64        # keys a wgmma (its M side)
BLOCK_KEYS = 256     # keys a CTA


def _build(b: int, h: int, s_pad: int, d: int):
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def body(q_ref, k_ref, w_ref, nvis_ref, o_ref, scratch):
        (q_smem, k_smem, o_smem), (bar,) = scratch
        bi, si = lax.axis_index("b"), lax.axis_index("s")
        s0 = si * BLOCK_KEYS
        active = s0 < nvis_ref[bi]

        @pl.when(active)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[bi], q_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(s0, BLOCK_KEYS)], k_smem, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            w = plgpu.load(w_ref.at[bi], layout=col_layout, optimized=False)       # [H] head weights
            for c in range(BLOCK_KEYS // KEY_ROWS):
                def dot(acc_ref, c=c):
                    plgpu.wgmma(acc_ref, k_smem.at[pl.ds(c * KEY_ROWS, KEY_ROWS)], q_smem.T)
                    plgpu.wgmma_wait(0)
                    return acc_ref[...]

                s = pl.run_scoped(dot, plgpu.ACC((KEY_ROWS, h), jnp.float32))
                terms = jnp.maximum(s, 0.0) * lax.broadcast_in_dim(w, (KEY_ROWS, h), [1])
                # an unseen key's every head term is -inf, so its sum is -inf (no column reduce layout needed)
                keys = s0 + c * KEY_ROWS + plgpu.broadcasted_iota(jnp.int32, (KEY_ROWS, h), 0,
                                                                  layout=plgpu.Layout.WGMMA)
                terms = jnp.where(keys < nvis_ref[bi], terms, -jnp.inf)
                o_smem.at[pl.ds(c * KEY_ROWS, KEY_ROWS)][...] = jnp.sum(terms, axis=1)

        @pl.when(jnp.logical_not(active))
        def _():
            o_smem[...] = jnp.full((BLOCK_KEYS,), -jnp.inf, jnp.float32)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bi, pl.ds(s0, BLOCK_KEYS)])
        plgpu.wait_smem_to_gmem(0)

    scratch = (
        (plgpu.SMEM((h, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((BLOCK_KEYS, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((BLOCK_KEYS,), jnp.float32)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=1),),
    )

    def entry(q_ref, k_ref, w_ref, nvis_ref, o_ref):
        pl.run_scoped(lambda *s: body(q_ref, k_ref, w_ref, nvis_ref, o_ref, s), *scratch)

    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((b, s_pad), jnp.float32),
                        grid=(b, s_pad // BLOCK_KEYS), grid_names=("b", "s"))


@jax.jit
def index_scores_decode_pallas(q_bhd: jax.Array, k_bsd: jax.Array, w_bh: jax.Array,
                               n_visible_b: jax.Array | None = None) -> jax.Array:
    """q [B, H, D], keys [B, S, D], head weights [B, H] -> scores [B, S] float32:
    sum_h w[b, h] relu(q[b, h] . k[b, s]) (``index_scores_xla`` at T = 1), -inf for keys at or past a
    row's n_visible. No copy of the scores when S is a multiple of 256."""
    b, h, d = q_bhd.shape
    s = k_bsd.shape[1]
    if (why := decode_unsupported_reason(h, d)) is not None:
        raise ValueError(f"index_scores_decode_pallas cannot run this problem: {why}")
    sp = -(-s // BLOCK_KEYS) * BLOCK_KEYS
    k = jnp.pad(k_bsd.astype(jnp.bfloat16), ((0, 0), (0, sp - s), (0, 0)))
    nvis = jnp.full((b,), s, jnp.int32) if n_visible_b is None else jnp.minimum(n_visible_b.astype(jnp.int32), s)
    out = _build(b, h, sp, d)(q_bhd.astype(jnp.bfloat16), k, w_bh.astype(jnp.float32), nvis)
    return out if sp == s else out[:, :s]
