"""Mosaic GPU (Hopper) kernels for a decode step's index scores (one query a batch row). The model runs
them through ``Numerics.decode_index_kernel`` (on since session 35: the 4-layer H100 B=64 step 8.77 ->
8.68 ms and 8.75 -> 8.70 in the two orders).

Why a second kernel: the prefill kernel (``kernel.py``) puts 128 queries of one sequence on the wgmma
M side, all padding at T = 1, so decode steps score in XLA: a dot into float32 [B, H, S] (33 MB at
B = 64, H = 32, S = 4096) and a fusion reading it back for relu x weight summed over heads.

Here the keys are the M side: each 64-key chunk of a key tile is a wgmma A operand [64, 128] from
shared memory, the query's heads the B operand [128, H] (N = H), so the accumulator is [64 keys, H].
Then relu, times the head weights (a column broadcast) and the sum over heads (a fixed order: each
thread's own columns, then two quad shuffles), and 64 scores go out. Each key is read once and only
the [B, S] scores are written.

Two forms (``DecodeIndexConfig``), the same scores bit for bit:

* ``tiles=1`` (``_build``, session 34; the default): one CTA per (batch row, 256 keys), one warpgroup
  that loads q, the head weights and the tile, then scores it. On an H100 at B = 64, 32 heads, 4,352
  keys: 28.6 us against XLA's 50.9 (keys read at 82 % of copy; session 36). Session 35's 83.9 us was at
  4,160 keys, which the wrapper pads to whole tiles (a copy of the keys inside the timed function).
* ``tiles=2..4`` (``_build_streamed``, session 35): one CTA per (batch row, ``tiles`` tiles): a producer
  warpgroup loads q once and streams the tiles through a ring while two consumer warpgroups score half
  of each tile, so a tile's copy overlaps the scoring of the one before. On the same H100: 28.6 / 29.1
  us (4x256x2 / 4x128x3), no faster (``benchmarks/indexer_gpu.py --decode`` times the forms).

Invariance: a score is a function of its query, its key and the head weights only (one wgmma chain
over the 128-dim dot per (key, head), a fixed reduction over heads). Keys at or past the row's visible
count score -inf (the op's contract); tiles wholly past it are not computed. Other rounding than XLA's
head sum (float32 sums in another order), still batch-invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.indexer.config import (SMEM_LIMIT_BYTES, DecodeIndexConfig, decode_smem_bytes,
                                           decode_unsupported_reason)
from pallas_kernels.mosaic import consumer_registers, run_warpgroups, tiled

KEY_ROWS = 64        # keys a wgmma (its M side)
BLOCK_KEYS = 256     # keys a CTA in the one-tile form


def _score_keys(keys_smem, q_smem, w, key0, n_vis, h: int):
    """Scores of the 64 keys in ``keys_smem`` ([64, D] in shared memory, the first key's index ``key0``)
    for one query: sum_h w[h] relu(q[h] . k), -inf at keys >= n_vis -> [64] float32 in the row layout
    of the wgmma accumulator. Every form of the kernel scores through here, so they agree bit for bit."""
    def dot(acc_ref):
        plgpu.wgmma(acc_ref, keys_smem, q_smem.T)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    s = pl.run_scoped(dot, plgpu.ACC((KEY_ROWS, h), jnp.float32))
    terms = jnp.maximum(s, 0.0) * lax.broadcast_in_dim(w, (KEY_ROWS, h), [1])
    # an unseen key's every head term is -inf, so its sum is -inf (no column reduce layout needed)
    keys = key0 + plgpu.broadcasted_iota(jnp.int32, (KEY_ROWS, h), 0, layout=plgpu.Layout.WGMMA)
    return jnp.sum(jnp.where(keys < n_vis, terms, -jnp.inf), axis=1)


def write_tile(active, o_smem, o_gmem) -> None:
    """The one-tile forms' end: a tile wholly past the row's visible keys scores -inf (it computed
    nothing); the tile's scores go out by TMA."""
    @pl.when(jnp.logical_not(active))
    def _():
        o_smem[...] = jnp.full(o_smem.shape, -jnp.inf, jnp.float32)

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)


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
                rows = pl.ds(c * KEY_ROWS, KEY_ROWS)
                o_smem.at[rows][...] = _score_keys(k_smem.at[rows], q_smem, w, s0 + c * KEY_ROWS, nvis_ref[bi], h)

        write_tile(active, o_smem, o_ref.at[bi, pl.ds(s0, BLOCK_KEYS)])

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


def _build_streamed(b: int, h: int, s_pad: int, d: int, tiles: int, stages: int, tile: int):
    """``DecodeIndexConfig(tiles > 1)``: one CTA per (batch row, ``tiles`` tiles of ``tile`` keys).
    Warpgroup 2 copies q once and streams the row's visible tiles through a ``stages``-deep ring;
    consumer c scores keys [c tile/2, (c + 1) tile/2) of every tile (wgmmas of 64 keys) and sends its
    scores by TMA."""
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    half = tile // 2

    def body(q_ref, k_ref, w_ref, nvis_ref, o_ref, scratch):
        (q_smem, k_smem, o_smem), (qbar, full, empty) = scratch
        bi, si = lax.axis_index("b"), lax.axis_index("s")
        base = si * (tiles * tile)
        n_vis = nvis_ref[bi]
        # the visible tiles are a prefix of the CTA's (keys < n_visible), so skipping the rest keeps
        # every slot's barrier phases in step between the producer and the consumers
        active = [base + t * tile < n_vis for t in range(tiles)]
        exists = [base + t * tile < s_pad for t in range(tiles)]

        def producer():
            plgpu.set_max_registers(40, action="decrease")

            @pl.when(active[0])
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[bi], q_smem, qbar.at[0])
            for t in range(tiles):
                slot = t % stages

                @pl.when(active[t])
                def _(t=t, slot=slot):
                    if t >= stages:
                        plgpu.barrier_wait(empty.at[slot])
                    plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(base + t * tile, tile)],
                                            k_smem.at[slot], full.at[slot])
            # Observe each used slot's last release, so no barrier is mid-phase when the CTA exits.
            for slot in range(min(stages, tiles)):
                pl.when(active[slot])(lambda slot=slot: plgpu.barrier_wait(empty.at[slot]))

        def consumer(c: int):
            plgpu.set_max_registers(consumer_registers(2, 1, 40), action="increase")

            @pl.when(active[0])
            def _():
                plgpu.barrier_wait(qbar.at[0])
            w = plgpu.load(w_ref.at[bi], layout=col_layout, optimized=False)       # [H] head weights
            unseen = plgpu.layout_cast(jnp.full((KEY_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            for t in range(tiles):
                slot, out = t % stages, pl.ds(t * tile + c * half, half)

                @pl.when(active[t])
                def _(t=t, slot=slot):
                    plgpu.barrier_wait(full.at[slot])
                    for j in range(half // KEY_ROWS):
                        row0 = c * half + j * KEY_ROWS
                        o_smem.at[pl.ds(t * tile + row0, KEY_ROWS)][...] = _score_keys(
                            k_smem.at[slot, pl.ds(row0, KEY_ROWS)], q_smem, w, base + t * tile + row0, n_vis, h)
                    plgpu.barrier_arrive(empty.at[slot])

                @pl.when(jnp.logical_and(exists[t], jnp.logical_not(active[t])))
                def _(t=t):
                    for j in range(half // KEY_ROWS):   # in the scores' own layout: Mosaic stores no
                        o_smem.at[pl.ds(t * tile + c * half + j * KEY_ROWS, KEY_ROWS)][...] = unseen  # 64-long splat

                @pl.when(exists[t])
                def _(t=t, out=out):
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[out], o_ref.at[bi, pl.ds(base + t * tile + c * half,
                                                                               half)])
            plgpu.wait_smem_to_gmem(0)

        run_warpgroups(consumer, [producer])

    scratch = (
        (plgpu.SMEM((h, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((stages, tile, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((tiles * tile,), jnp.float32)),
        (plgpu.Barrier(num_arrivals=1, num_barriers=1),
         plgpu.Barrier(num_arrivals=1, num_barriers=stages),
         plgpu.Barrier(num_arrivals=2, num_barriers=stages)),
    )

    def entry(q_ref, k_ref, w_ref, nvis_ref, o_ref):
        pl.run_scoped(lambda *s: body(q_ref, k_ref, w_ref, nvis_ref, o_ref, s), *scratch, collective_axes="wg")

    per_cta = tiles * tile
    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((b, s_pad), jnp.float32),
                        grid=(b, -(-s_pad // per_cta)), grid_names=("b", "s"), num_threads=3, thread_name="wg")


@functools.partial(jax.jit, static_argnames=("config",))
def index_scores_decode_pallas(q_bhd: jax.Array, k_bsd: jax.Array, w_bh: jax.Array,
                               n_visible_b: jax.Array | None = None, *,
                               config: DecodeIndexConfig = DecodeIndexConfig()) -> jax.Array:
    """q [B, H, D], keys [B, S, D], head weights [B, H] -> scores [B, S] float32:
    sum_h w[b, h] relu(q[b, h] . k[b, s]) (``index_scores_xla`` at T = 1), -inf for keys at or past a
    row's n_visible. No copy of the scores when S is a multiple of 256. config: the kernel's form
    (``DecodeIndexConfig``; the same scores, bit for bit, in every form)."""
    b, h, d = q_bhd.shape
    s = k_bsd.shape[1]
    if (why := decode_unsupported_reason(h, d)) is not None:
        raise ValueError(f"index_scores_decode_pallas cannot run this problem: {why}")
    sp = -(-s // BLOCK_KEYS) * BLOCK_KEYS
    k = jnp.pad(k_bsd.astype(jnp.bfloat16), ((0, 0), (0, sp - s), (0, 0)))
    nvis = jnp.full((b,), s, jnp.int32) if n_visible_b is None else jnp.minimum(n_visible_b.astype(jnp.int32), s)
    if (need := decode_smem_bytes(h, d, config)) > SMEM_LIMIT_BYTES:
        raise ValueError(f"index_scores_decode_pallas: {h} heads with {config} need {need} B of shared memory "
                         f"(limit {SMEM_LIMIT_BYTES})")
    build = (_build(b, h, sp, d) if config.tiles == 1
             else _build_streamed(b, h, sp, d, config.tiles, config.stages, config.tile_keys))
    out = build(q_bhd.astype(jnp.bfloat16), k, w_bh.astype(jnp.float32), nvis)
    return out if sp == s else out[:, :s]
