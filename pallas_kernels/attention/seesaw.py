"""The attention kernel's "seesaw" schedule (``SparseAttentionConfig.schedule``): blocks in pairs, one
consumer warpgroup a block for q.k, both for p.kv. Mosaic GPU (Hopper), bf16 rows; kernel.py's wrapper
calls ``build``.

Why (benchmarks/NOTES.md item -32(f)): in the "halves" schedule each consumer computes q.k for 32 rows
of every block, 32 wgmmas of N = 32 that each re-read q's 2 KB slice, and the two meet three times a
block. Here, for blocks 2i and 2i + 1 of a split (after FlashMLA's sparse kernels):

* consumer 0 computes s0 = q . k0 over all 64 rows of block 2i (N = 64), consumer 1 s1 for block 2i + 1;
* consumer 0 takes m0 = max(m, rowmax s0) and p0 = exp(s0 - m0), publishes m0, and applies p0 (from
  registers) to its output half (columns [0, D/2)) of block 2i;
* consumer 1 takes m1 = max(m0, rowmax s1) (the pair's running max), p1 = exp(s1 - m1), publishes m1
  and p1, and applies p1 to its half (columns [D/2, D)) of block 2i + 1;
* consumer 0 rescales p0 to m1 and publishes it; each then applies the other's p to its half of the
  other block, consumer 0 after rescaling its output and denominator to m1.

So four one-way hand-offs a pair, where the halves schedule had six rendezvous. Each consumer keeps
its own partial denominator; the epilogue adds the two.

Shared memory (D = 512): q 64 KB, two blocks 128 KB, two p tiles 16 KB. No landing slots: every
buffer is in wgmma layout with a 128-byte swizzle (64 columns a tile, so one block's p is one tile
wide). The two blocks are four column-half slots (tile t, half h), each with its own ready and free barrier:
slot (0, 0) is last read by consumer 0's own p.kv, (1, 1) by consumer 1's own, (0, 1) and (1, 0) by
the other consumer's, so the first two are refilled while the pair's second p.kv runs.

Rows come in two ways:

* "seesaw": the selected rows land straight in the swizzled slots by per-thread cp.async
  (``cp_async.gather_rows(..., swizzle=128)``) from one producer warpgroup, slot by slot in the order
  they are released, up to two slots in flight: a slot is published (fenced for the tensor core's
  proxy, since cp.async writes through the generic one, then arrived on) once the next is issued, and
  the pair's last slot at once. Publishing later could deadlock: a slot's release can depend on the
  rows of the slot issued two before it. GPU only: the Mosaic GPU interpreter runs no inline code.
* "seesaw_gathered": the wrapper gathers each query's rows with XLA first ([queries, K, D]), and one
  producer copies 64-row column halves by TMA. An extra HBM round trip, so a check and the CPU form.

Every CTA's arithmetic depends only on its own query row, its index row and the config, so the
result is batch-invariant, as in kernel.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mosaic
from pallas_kernels.attention import consumer_state, cp_async
from pallas_kernels.attention.config import BLOCK_ROWS, HEAD_GROUP

_SWIZZLE = 128      # bytes: 64 bf16 columns a tile


def _rows(k: int, n: int = BLOCK_ROWS) -> pl.Slice:
    """Rows of slot k (or of p tile k, n = 64 heads) in its stacked buffer. (A stacked 2-D buffer, not a
    leading slot axis: an integer index into a ref fails to lower inside ``run_state``, the in-place
    p.kv's form.)"""
    return pl.ds(k * n, n)


def _slot(tile: int, half: int) -> int:
    """The kv slot holding column half ``half`` of tile ``tile`` (block 2i + tile of pair i)."""
    return 2 * tile + half


# The order a pair's slots are released (so refilled): each consumer's own p.kv half, then the other's.
_RELEASE_ORDER = ((0, 0), (1, 1), (0, 1), (1, 0))
# The order a consumer's q.k reads its tile's halves: the one the producer fills first, first.
_QK_ORDER = {0: (0, 1), 1: (1, 0)}


def build(n_queries: int, queries_per_batch: int, head_dim: int, n_splits: int, split_rows: int, scale: float,
          *, gathered: bool, groups: int = 1, pv_in_place: bool = False, pv_cols: int = 128, pdl: bool = False):
    """The pallas kernel for q [n, 64, D], kv [B, S, D] (``gathered``: rows [n / groups, splits * split_rows,
    D], each query's selected rows in index order), idx [n, splits, blocks, 64], sink [groups, 64] ->
    o [n, 64, D] bf16 (one split) or (o [n, splits, 64, D] f32 normalised, lse [n, splits, 64] log2)."""
    h, d = HEAD_GROUP, head_dim
    dh = d // 2
    n_blocks = split_rows // BLOCK_ROWS
    if n_blocks % 2:
        raise ValueError(f"split_rows={split_rows}: the seesaw schedule takes blocks in pairs")
    n_pairs = n_blocks // 2
    cw = min(pv_cols, dh)
    if dh % cw:
        raise ValueError(f"pv_cols={pv_cols} must divide head_dim/2={dh}")
    n_chunks = dh // cw
    # One producer warpgroup: with a second (four warpgroups), ptxas compiles every thread for 128
    # registers, the launch's share, too few for a 64 x 256 float32 accumulator (the in-place p.kv
    # asked for 158).
    n_producers = 1
    producer_regs = 40
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per kv row
    score_scale = scale * consumer_state.LOG2E
    row_bytes = dh * 2                          # a slot's row: half a kv row

    def body(q_ref, kv_ref, idx_ref, sink_ref, *rest):
        mosaic.wait_for_prior_grids(pdl)
        out_refs, scratch = rest[:-1], rest[-1]
        (q_smem, idx_smem, kv_smem, p_smem, m_smem, l_smem), (q_bar, idx_bar, ready, free, m_ready, p_ready,
                                                              l_bar) = scratch
        n = lax.axis_index("query")
        split = lax.axis_index("split")
        batch = lax.div(n, jnp.int32(queries_per_batch))
        group = lax.rem(n, jnp.int32(sink_ref.shape[0]))

        def bcast_rows(v, cols):
            return lax.broadcast_in_dim(v, (h, cols), [0])

        def scores(c: int, blk):
            """s = q . k for block ``blk`` in tile c, masked and scaled to log2 units: [64 heads, 64 rows]."""
            def qk(acc_ref):
                for half in _QK_ORDER[c]:
                    plgpu.barrier_wait(ready.at[_slot(c, half)])
                    plgpu.wgmma(acc_ref, q_smem.at[half], kv_smem.at[_rows(_slot(c, half))].T)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((h, BLOCK_ROWS), jnp.float32))
            ids = plgpu.load(idx_smem.at[blk], layout=col_layout, optimized=False)
            valid = lax.broadcast_in_dim(ids >= 0, (h, BLOCK_ROWS), [1])
            return jnp.where(valid, s * score_scale, -jnp.inf)

        def apply_p(o, alpha, p, slot: int):
            """o * alpha + p . kv[slot] over this consumer's output columns (o: n_chunks [64, cw] arrays;
            p: [64, 64] bf16 in registers or a p tile in shared memory)."""
            out = []
            for ch in range(n_chunks):
                cols = pl.ds(ch * cw, cw)
                scaled = o[ch] if alpha is None else o[ch] * bcast_rows(alpha, cw)
                rhs = kv_smem.at[_rows(slot), cols]
                if pv_in_place:
                    out.append(pl.run_state(lambda acc_ref, rhs=rhs: plgpu.wgmma(acc_ref, p, rhs))(
                        plgpu.ACC.init(scaled)))
                else:
                    def pv(acc_ref, rhs=rhs):
                        plgpu.wgmma(acc_ref, p, rhs)
                        return acc_ref[...]
                    out.append(scaled + pl.run_scoped(pv, plgpu.ACC((h, cw), jnp.float32)))
            return tuple(out)

        def consumer(c: int):
            plgpu.set_max_registers(mosaic.consumer_registers(2, n_producers, producer_regs), action="increase")
            plgpu.barrier_wait(q_bar)
            plgpu.barrier_wait(idx_bar)
            o_init, m_init, l_init = consumer_state.initial_state(sink_ref, group, n_splits=n_splits, consumer=c,
                                                                  cols=cw, n_chunks=n_chunks)

            def pair0(i, carry):
                o, m, l = carry
                with jax.named_scope("c0_qk"):
                    s = scores(0, 2 * i)
                with jax.named_scope("c0_softmax"):
                    m0 = jnp.maximum(m, s.max(axis=1))
                    alpha = jnp.exp2(m - m0)
                    p = jnp.exp2(s - bcast_rows(m0, BLOCK_ROWS))
                    l = l * alpha + p.sum(axis=1)
                    m_smem.at[0][...] = m0
                    plgpu.barrier_arrive(m_ready.at[0])
                with jax.named_scope("c0_pv_own"):
                    o = apply_p(o, alpha, p.astype(jnp.bfloat16), _slot(0, 0))
                    plgpu.barrier_arrive(free.at[_slot(0, 0)])
                with jax.named_scope("c0_wait_m1"):
                    plgpu.barrier_wait(m_ready.at[1])
                    m1 = m_smem.at[1][...]
                with jax.named_scope("c0_send_p"):
                    rescale = jnp.exp2(m0 - m1)
                    p_smem.at[_rows(0, h)][...] = (p * bcast_rows(rescale, BLOCK_ROWS)).astype(jnp.bfloat16)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready.at[0])
                with jax.named_scope("c0_wait_p1"):
                    plgpu.barrier_wait(p_ready.at[1])
                with jax.named_scope("c0_pv_other"):
                    o = apply_p(o, rescale, p_smem.at[_rows(1, h)], _slot(1, 0))
                    plgpu.barrier_arrive(free.at[_slot(1, 0)])
                return o, m1, l * rescale

            def pair1(i, carry):
                o, m, l = carry
                with jax.named_scope("c1_qk"):
                    s = scores(1, 2 * i + 1)
                with jax.named_scope("c1_wait_m0"):
                    plgpu.barrier_wait(m_ready.at[0])
                    m0 = m_smem.at[0][...]
                with jax.named_scope("c1_softmax"):
                    m1 = jnp.maximum(m0, s.max(axis=1))
                    alpha = jnp.exp2(m - m1)
                    p_f32 = jnp.exp2(s - bcast_rows(m1, BLOCK_ROWS))
                    l = l * alpha + p_f32.sum(axis=1)
                    p = p_f32.astype(jnp.bfloat16)
                    m_smem.at[1][...] = m1
                    plgpu.barrier_arrive(m_ready.at[1])
                    p_smem.at[_rows(1, h)][...] = p
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready.at[1])
                with jax.named_scope("c1_pv_own"):
                    o = apply_p(o, alpha, p, _slot(1, 1))
                    plgpu.barrier_arrive(free.at[_slot(1, 1)])
                with jax.named_scope("c1_wait_p0"):
                    plgpu.barrier_wait(p_ready.at[0])
                with jax.named_scope("c1_pv_other"):
                    o = apply_p(o, None, p_smem.at[_rows(0, h)], _slot(0, 1))
                    plgpu.barrier_arrive(free.at[_slot(0, 1)])
                return o, m1, l

            o, m, l = lax.fori_loop(0, n_pairs, pair0 if c == 0 else pair1, (o_init, m_init, l_init))
            with jax.named_scope("c_out"):
                epilogue(c, o, m, l)

        def epilogue(c: int, o, m, l):
            def sync():
                plgpu.barrier_arrive(l_bar)
                plgpu.barrier_wait(l_bar)
            consumer_state.write_output(c, o, m, l, l_exchange=l_smem, sync=sync, q_smem=q_smem, out_refs=out_refs,
                                        n=n, split=split, n_splits=n_splits, cols=cw, half_dim=dh)

        def load_inputs():
            for half in range(2):
                plgpu.copy_gmem_to_smem(q_ref.at[n, :, pl.ds(half * dh, dh)], q_smem.at[half], q_bar)
            plgpu.copy_gmem_to_smem(idx_ref.at[n, split], idx_smem, idx_bar)

        def producer_tma():
            plgpu.set_max_registers(producer_regs, action="decrease")
            load_inputs()
            row0 = split * split_rows
            nq = lax.div(n, jnp.int32(groups))

            @pl.loop(0, n_pairs)
            def _(i):
                for tile, half in _RELEASE_ORDER:
                    slot = _slot(tile, half)

                    @pl.when(i > 0)
                    def _():
                        plgpu.barrier_wait(free.at[slot])
                    rows = pl.ds(row0 + (2 * i + tile) * BLOCK_ROWS, BLOCK_ROWS)
                    plgpu.copy_gmem_to_smem(kv_ref.at[nq, rows, pl.ds(half * dh, dh)], kv_smem.at[_rows(slot)],
                                            ready.at[slot])
            drain(range(4))

        def producer_cp_async():
            plgpu.set_max_registers(producer_regs, action="decrease")
            load_inputs()
            plgpu.barrier_wait(idx_bar)

            @pl.loop(0, n_pairs)
            def _(i):
                # Up to two slots in flight: a landed slot is published once the next one is issued.
                # Deeper would deadlock (slot (0, 1)'s rows gate slot (0, 0)'s next release), and so
                # would holding slot (1, 0) past the pair (the next (0, 0) release waits on it).
                pending = None
                for tile, half in _RELEASE_ORDER:
                    slot = _slot(tile, half)

                    @pl.when(i > 0)
                    def _():
                        plgpu.barrier_wait(free.at[slot])
                    cp_async.gather_rows(idx_smem.at[2 * i + tile], kv_ref.at[batch], kv_smem, first=0,
                                         rows=BLOCK_ROWS, row_bytes=row_bytes, swizzle=_SWIZZLE,
                                         dst_row=slot * BLOCK_ROWS, src_col_bytes=half * row_bytes)
                    if pending is not None:
                        publish(pending, in_flight=1)
                    pending = slot
                publish(pending, in_flight=0)
            drain(range(4))

        def publish(slot: int, in_flight: int):
            """Once this thread's rows of ``slot`` landed (``in_flight`` later groups may still be in
            flight), fence them for the tensor core's proxy (they are generic-proxy writes) and arrive."""
            cp_async.wait_groups(in_flight)
            plgpu.commit_smem()
            plgpu.barrier_arrive(ready.at[slot])

        def drain(slots):
            """Observe the last phases, so every barrier is quiescent when the kernel ends."""
            for slot in slots:
                plgpu.barrier_wait(free.at[slot])

        mosaic.run_warpgroups(consumer, [producer_tma if gathered else producer_cp_async])

    tiles = mosaic.tiled(_SWIZZLE, 2)
    scratch = (
        (plgpu.SMEM((2, h, dh), jnp.bfloat16, transforms=tiles),                  # q, by column half
         plgpu.SMEM((n_blocks, BLOCK_ROWS), jnp.int32),                           # this split's indices
         plgpu.SMEM((4 * BLOCK_ROWS, dh), jnp.bfloat16, transforms=tiles),        # kv slots (tile, half)
         plgpu.SMEM((2 * h, BLOCK_ROWS), jnp.bfloat16, transforms=tiles),         # p of each block
         plgpu.SMEM((2, h), jnp.float32),                                         # m0, m1
         plgpu.SMEM((2, h), jnp.float32)),                                        # the denominators
        (plgpu.Barrier(num_arrivals=2),
         plgpu.Barrier(),
         plgpu.Barrier(num_barriers=4),
         plgpu.Barrier(num_barriers=4),
         plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_arrivals=2)),
    )
    out_type = consumer_state.output_types(n_queries, n_splits, d)

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    return plgpu.kernel(entry, out_type=out_type, grid=(n_queries, n_splits), grid_names=("query", "split"),
                        num_threads=2 + n_producers, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True))
