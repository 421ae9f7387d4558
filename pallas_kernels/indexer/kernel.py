"""Mosaic GPU (Hopper) kernel for ``index_scores``: one CTA per (batch row, 128 queries, block_s keys).

* warpgroup 2 (producer) copies the CTA's key tile [block_s, 128] and head weights [H, 128] once, then
  streams the queries head by head, q[b, h, t0:t0+128, :] (bf16, 128-byte swizzled), through a
  ``stages``-deep ring.
* warpgroups 0 and 1 (consumers) own 64 queries each (the wgmma M side; the keys are the N side). Per
  head: s = q_h . k^T on wgmma into a fresh fp32 accumulator, then ``out += relu(s) * w_h`` in registers
  (w_h one value per query row). The [T, H, S] dots never leave the SM; ``out`` goes to HBM once.
* Scores of keys at or past a query's own ``n_visible`` count are written as -inf (the op's contract),
  so the caller needs no masking pass over the [T, S] scores. A tile whose first key lies at or past
  the most keys any of its queries may see is not computed at all, only written as -inf: in a causal
  prefill that is half the tiles.

Invariance: a score is the fp32 sum over heads 0, 1, ..., H-1 (in that order) of relu(dot) * w, each
dot one wgmma chain over the fixed 128-dim K. Nothing depends on the batch, the other queries, the tile
sizes or which tiles are skipped, so a query's scores are bitwise the same in any batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.indexer.config import QUERY_ROWS, IndexScoresConfig, kernel_unsupported_reason
from pallas_kernels.mosaic import consumer_registers, run_warpgroups, tiled


def _build(b: int, h: int, t_tiles: int, s_pad: int, d: int, cfg: IndexScoresConfig):
    bs, bt, stages = cfg.block_s, cfg.block_t, cfg.stages
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    out_swizzle = plgpu.find_swizzle(bs * 4 * 8, "out")

    def body(q_ref, k_ref, w_ref, nvis_ref, nq_ref, o_ref, scratch):
        (q_smem, k_smem, w_smem, nq_smem, o_smem), (full, empty, kw) = scratch
        bi, ti, si = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("s")
        t0, s0 = ti * bt, si * bs
        active = s0 < nvis_ref[bi, ti]

        def producer():
            plgpu.set_max_registers(40, action="decrease")

            @pl.when(active)
            def _():
                plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(s0, bs)], k_smem, kw.at[0])
                plgpu.copy_gmem_to_smem(w_ref.at[bi, :, pl.ds(t0, bt)], w_smem, kw.at[0])
                plgpu.copy_gmem_to_smem(nq_ref.at[bi, pl.ds(t0, bt)], nq_smem, kw.at[0])

                @pl.loop(0, h)
                def _(hh):
                    slot = lax.rem(hh, stages)

                    @pl.when(hh >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])
                    plgpu.copy_gmem_to_smem(q_ref.at[bi, hh, pl.ds(t0, bt)], q_smem.at[slot], full.at[slot])

                # Observe each used slot's last release, so no barrier is mid-phase when the CTA exits.
                for s in range(min(stages, h)):
                    plgpu.barrier_wait(empty.at[s])

        def store(half: int, out):
            o_smem.at[half][...] = out
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[half], o_ref.at[bi, pl.ds(t0 + half * QUERY_ROWS, QUERY_ROWS),
                                                             pl.ds(s0, bs)])
            plgpu.wait_smem_to_gmem(0)

        def consumer(half: int):
            plgpu.set_max_registers(consumer_registers(2, 1, 40), action="increase")
            rows = pl.ds(half * QUERY_ROWS, QUERY_ROWS)
            zeros = plgpu.layout_cast(jnp.zeros((QUERY_ROWS, bs), jnp.float32), plgpu.Layout.WGMMA)
            unseen = plgpu.layout_cast(jnp.full((QUERY_ROWS, bs), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(active)
            def _():
                plgpu.barrier_wait(kw.at[0])

                def head(hh, out):
                    slot = lax.rem(hh, stages)
                    plgpu.barrier_wait(full.at[slot])

                    def dot(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem.at[slot, rows], k_smem.T)
                        plgpu.wgmma_wait(0)
                        return acc_ref[...]

                    s = pl.run_scoped(dot, plgpu.ACC((QUERY_ROWS, bs), jnp.float32))
                    plgpu.barrier_arrive(empty.at[slot])
                    w_h = plgpu.load(w_smem.at[hh, rows], layout=row_layout, optimized=False)
                    return out + jnp.maximum(s, 0.0) * lax.broadcast_in_dim(w_h, (QUERY_ROWS, bs), [0])

                out = lax.fori_loop(0, h, head, zeros)
                n_q = plgpu.load(nq_smem.at[rows], layout=row_layout, optimized=False)   # each query's count
                keys = s0 + plgpu.broadcasted_iota(jnp.int32, (QUERY_ROWS, bs), 1, layout=plgpu.Layout.WGMMA)
                store(half, jnp.where(keys < lax.broadcast_in_dim(n_q, (QUERY_ROWS, bs), [0]), out, unseen))

            @pl.when(jnp.logical_not(active))
            def _():
                store(half, unseen)

        run_warpgroups(consumer, [producer])

    scratch = (
        (plgpu.SMEM((stages, bt, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((bs, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((h, bt), jnp.float32),
         plgpu.SMEM((bt,), jnp.int32),
         plgpu.SMEM((2, QUERY_ROWS, bs), jnp.float32, transforms=tiled(out_swizzle, 4))),
        (plgpu.Barrier(num_arrivals=1, num_barriers=stages),
         plgpu.Barrier(num_arrivals=2, num_barriers=stages),
         plgpu.Barrier(num_arrivals=3, num_barriers=1)),
    )

    def entry(q_ref, k_ref, w_ref, nvis_ref, nq_ref, o_ref):
        pl.run_scoped(lambda *s: body(q_ref, k_ref, w_ref, nvis_ref, nq_ref, o_ref, s), *scratch,
                      collective_axes="wg")

    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((b, t_tiles * bt, s_pad), jnp.float32),
                        grid=(b, t_tiles, s_pad // bs), grid_names=("b", "t", "s"), num_threads=3,
                        thread_name="wg")


@functools.partial(jax.jit, static_argnames=("config",))
def index_scores_pallas(q_bthd: jax.Array, k_bsd: jax.Array, w_bth: jax.Array, n_visible_bt: jax.Array | None = None,
                        *, config: IndexScoresConfig = IndexScoresConfig()) -> jax.Array:
    """-> scores_bts f32. Same contract as ``pallas_kernels.indexer.index_scores``.

    n_visible_bt: int [B, T], the number of leading keys query (b, t) may see (None: all): scores of
    keys past it are -inf, and tiles past every query's count of a query tile are not computed.
    No copy of the scores is made when T is a multiple of 128 and S of ``config.block_s`` (the output
    is the kernel's buffer as it is); otherwise the padded buffer is sliced."""
    b, t, h, d = q_bthd.shape
    s = k_bsd.shape[1]
    if (why := kernel_unsupported_reason(h, d, config)) is not None:
        raise ValueError(f"index_scores_pallas cannot run this problem: {why}")
    bt, bs = config.block_t, config.block_s
    tp, sp = -(-t // bt) * bt, -(-s // bs) * bs
    q = jnp.pad(q_bthd.astype(jnp.bfloat16).transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
    k = jnp.pad(k_bsd.astype(jnp.bfloat16), ((0, 0), (0, sp - s), (0, 0)))
    w = jnp.pad(w_bth.astype(jnp.float32).transpose(0, 2, 1), ((0, 0), (0, 0), (0, tp - t)))
    n_vis = jnp.full((b, t), s, jnp.int32) if n_visible_bt is None else jnp.minimum(n_visible_bt.astype(jnp.int32), s)
    per_query = jnp.pad(n_vis, ((0, 0), (0, tp - t)))
    per_tile = per_query.reshape(b, tp // bt, bt).max(axis=-1)
    out = _build(b, h, tp // bt, sp, d, config)(q, k, w, per_tile, per_query)
    return out if (tp, sp) == (t, s) else out[:, :t, :s]
