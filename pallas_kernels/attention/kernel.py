"""Mosaic GPU (Hopper) kernel for ``sparse_sink_attention``: one CTA per (query token, head group, split).

Layout of the work (D = head_dim, 64 heads = the wgmma M dimension):

* the producer warpgroup(s) (2, or 2 and 3) copy the query [64, D] and the split's indices into shared
  memory, then gather the selected kv rows with one TMA per row into two 32-row landing slots (one per
  consumer); an index of -1 fetches row 0, whose scores are masked later.
* warpgroups 0 and 1 (consumers) each own 32 of the 64 rows of a block and D/2 output columns.
  Per block: copy its landing slot into the wgmma (tiled, swizzled) layout; s = q . kv for its 32 rows;
  exchange the per-head row maxima; p = exp(s - m); write p (bf16) to shared memory; p . kv over all
  64 rows for its D/2 columns. K and V are the same shared-memory tile, so each row is read from HBM once.
* The running state (m, l, o) starts from the sink when there is one split (m = sink, l = 1 in
  warpgroup 0), so the sink enters the denominator exactly once and a query with no valid entry gives 0.
  With several splits each CTA writes a normalised partial output and its log-sum-exp, merged in a fixed
  order by ``merge_splits`` together with the sink.

Every CTA's arithmetic depends only on its own query row, its index row and the config, so the result
is batch-invariant by construction. Every wgmma reads its A operand from shared memory and accumulates
into a fresh accumulator (the running output is rescaled in registers), which also lets the Mosaic GPU
interpreter run this kernel on a CPU (tests/test_attention_kernel.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.attention.config import BLOCK_ROWS, HEAD_GROUP, SparseAttentionConfig, kernel_unsupported_reason

_LOG2E = math.log2(math.e)
_NEG_BIG = -1e30  # finite "minus infinity" for a running max that may never see a valid score
_SWIZZLE = 64     # bytes; 32 bf16 columns per tile, so each consumer's 32 probability columns are whole tiles
_HALF_ROWS = BLOCK_ROWS // 2


def _build(n_queries: int, queries_per_batch: int, head_dim: int, n_splits: int, split_rows: int,
           scale: float, n_producers: int):
    """The pallas kernel for q [n, 64, D], kv [B, S, D], idx [n, splits, blocks, 64], sink [groups, 64]."""
    h, d = HEAD_GROUP, head_dim
    dh = d // 2                      # output columns per consumer warpgroup
    cw = 128 if dh % 128 == 0 else 64  # output columns per p.kv wgmma (keeps the fresh accumulator small)
    n_chunks = dh // cw
    n_blocks = split_rows // BLOCK_ROWS
    row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per head
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per kv row
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((_HALF_ROWS, d), jnp.bfloat16, _SWIZZLE)
    score_scale = scale * _LOG2E     # exponentials are base 2; m and the log-sum-exp are in log2 units

    def body(q_ref, kv_ref, idx_ref, sink_ref, out_refs, scratch):
        (q_smem, idx_smem, stage, tiled, probs, xmax), (q_bar, idx_bar, ready, free, xbar) = scratch
        n = lax.axis_index("query")
        split = lax.axis_index("split")
        batch = lax.div(n, jnp.int32(queries_per_batch))
        group = lax.rem(n, jnp.int32(sink_ref.shape[0]))
        wg = lax.axis_index("wg")

        def rendezvous():  # both consumer warpgroups
            plgpu.barrier_arrive(xbar)
            plgpu.barrier_wait(xbar)

        def consumer(half: int):
            plgpu.set_max_registers(232, action="increase")
            rows = pl.ds(half * _HALF_ROWS, _HALF_ROWS)
            plgpu.barrier_wait(q_bar)
            plgpu.barrier_wait(idx_bar)
            if n_splits == 1:
                m0 = plgpu.load(sink_ref.at[group], layout=row_layout, optimized=False) * _LOG2E
            else:
                m0 = plgpu.layout_cast(jnp.full((h,), _NEG_BIG, jnp.float32), row_layout)
            # e^(sink - m) rides in warpgroup 0's share of the denominator and is rescaled with it.
            l0 = plgpu.layout_cast(jnp.full((h,), 1.0 if (n_splits == 1 and half == 0) else 0.0, jnp.float32),
                                   row_layout)
            o0 = tuple(plgpu.layout_cast(jnp.zeros((h, cw), jnp.float32), plgpu.Layout.WGMMA)
                       for _ in range(n_chunks))

            def block(i, carry):
                o, m, l = carry
                plgpu.barrier_wait(ready.at[half])
                tiled.at[rows][...] = plgpu.load(stage.at[half], layout=copy_layout)
                plgpu.commit_smem()
                plgpu.barrier_arrive(free.at[half])

                def qk(acc_ref):
                    for c in range(2):
                        plgpu.wgmma(acc_ref, q_smem.at[c], tiled.at[rows, pl.ds(c * dh, dh)].T)
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((h, _HALF_ROWS), jnp.float32))
                ids = plgpu.load(idx_smem.at[i, rows], layout=col_layout, optimized=False)
                valid = lax.broadcast_in_dim(ids >= 0, (h, _HALF_ROWS), [1])
                s = jnp.where(valid, s * score_scale, -jnp.inf)
                xmax.at[half][...] = s.max(axis=1)
                rendezvous()  # both halves' maxima are visible
                m_new = jnp.maximum(m, jnp.maximum(xmax.at[0][...], xmax.at[1][...]))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (h, _HALF_ROWS), [0]))
                l = l * alpha + p.sum(axis=1)
                probs.at[:, rows][...] = p.astype(jnp.bfloat16)
                plgpu.commit_smem()
                rendezvous()  # both halves of p and of the tiled block are visible to wgmma

                o_new = []
                for c in range(n_chunks):
                    cols = pl.ds(half * dh + c * cw, cw)

                    def pv(acc_ref, cols=cols):
                        plgpu.wgmma(acc_ref, probs, tiled.at[:, cols])
                        return acc_ref[...]
                    pv_c = pl.run_scoped(pv, plgpu.ACC((h, cw), jnp.float32))
                    o_new.append(o[c] * lax.broadcast_in_dim(alpha, (h, cw), [0]) + pv_c)
                rendezvous()  # both p.kv products are done before tiled/probs/xmax are rewritten
                return tuple(o_new), m_new, l

            o, m, l = lax.fori_loop(0, n_blocks, block, (o0, m0, l0))
            xmax.at[half][...] = l
            rendezvous()
            l = xmax.at[0][...] + xmax.at[1][...]
            inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
            o = [oc * lax.broadcast_in_dim(inv_l, (h, cw), [0]) for oc in o]
            if n_splits == 1:
                (o_ref,) = out_refs
                for c in range(n_chunks):  # the query tile is no longer read by anyone: reuse it
                    q_smem.at[half, :, pl.ds(c * cw, cw)][...] = o[c].astype(jnp.bfloat16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem.at[half], o_ref.at[n, :, pl.ds(half * dh, dh)])
                plgpu.wait_smem_to_gmem(0)
            else:
                o_ref, lse_ref = out_refs
                for c in range(n_chunks):
                    o_ref.at[n, split, :, pl.ds(half * dh + c * cw, cw)][...] = o[c]
                if half == 0:
                    lse_ref.at[n, split][...] = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)

        @pl.when(wg == 0)
        def _():
            consumer(0)

        @pl.when(wg == 1)
        def _():
            consumer(1)

        def producer(halves: tuple[int, ...]):
            # Mosaic's copy_gmem_to_smem makes all 128 threads of the issuing warpgroup arrive on the
            # barrier for every row, which makes the row-issue loop the kernel's bottleneck; with two
            # producer warpgroups each issues one landing slot's rows.
            plgpu.set_max_registers(24 if n_producers == 2 else 40, action="decrease")
            if 0 in halves:
                for c in range(2):
                    plgpu.copy_gmem_to_smem(q_ref.at[n, :, pl.ds(c * dh, dh)], q_smem.at[c], q_bar)
                plgpu.copy_gmem_to_smem(idx_ref.at[n, split], idx_smem, idx_bar)
            plgpu.barrier_wait(idx_bar)

            @pl.loop(0, n_blocks)
            def _(i):
                for half in halves:
                    @pl.when(i > 0)
                    def _():
                        plgpu.barrier_wait(free.at[half])
                    for j in range(_HALF_ROWS):
                        row = jnp.maximum(idx_smem[i, half * _HALF_ROWS + j], 0)
                        plgpu.copy_gmem_to_smem(kv_ref.at[batch, pl.ds(row, 1)], stage.at[half, pl.ds(j, 1)],
                                                ready.at[half])
            # Observe the last phases so every barrier is quiescent when the kernel ends.
            if 0 in halves:
                plgpu.barrier_wait(q_bar)
            for half in halves:
                plgpu.barrier_wait(free.at[half])

        if n_producers == 1:
            @pl.when(wg == 2)
            def _():
                producer((0, 1))
        else:
            @pl.when(wg == 2)
            def _():
                producer((0,))

            @pl.when(wg == 3)
            def _():
                producer((1,))

    tiles = (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))
    scratch = (
        (plgpu.SMEM((2, h, dh), jnp.bfloat16, transforms=tiles),          # q, by column half
         plgpu.SMEM((n_blocks, BLOCK_ROWS), jnp.int32),                   # this split's indices
         plgpu.SMEM((2, _HALF_ROWS, d), jnp.bfloat16),                    # TMA landing slots
         plgpu.SMEM((BLOCK_ROWS, d), jnp.bfloat16, transforms=tiles),     # the block, wgmma layout
         plgpu.SMEM((h, BLOCK_ROWS), jnp.bfloat16, transforms=tiles),     # p
         plgpu.SMEM((2, h), jnp.float32)),                                # per-half maxima / sums
        (plgpu.Barrier(num_arrivals=2),
         plgpu.Barrier(),
         plgpu.Barrier(num_arrivals=_HALF_ROWS, num_barriers=2),
         plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_arrivals=2)),
    )
    if n_splits == 1:
        out_type = (jax.ShapeDtypeStruct((n_queries, h, d), jnp.bfloat16),)
    else:
        out_type = (jax.ShapeDtypeStruct((n_queries, n_splits, h, d), jnp.float32),
                    jax.ShapeDtypeStruct((n_queries, n_splits, h), jnp.float32))

    def entry(q_ref, kv_ref, idx_ref, sink_ref, *out_refs):
        pl.run_scoped(lambda *s: body(q_ref, kv_ref, idx_ref, sink_ref, out_refs, s), *scratch,
                      collective_axes="wg")

    return plgpu.kernel(entry, out_type=out_type, grid=(n_queries, n_splits), grid_names=("query", "split"),
                        num_threads=2 + n_producers, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True))


def merge_splits(o_nshd: jax.Array, lse_nsh: jax.Array, sink_nh: jax.Array) -> jax.Array:
    """Combine per-split (normalised output, log2-sum-exp) with the sink, splits in index order.

    Written as an unrolled chain of elementwise ops (no reduction), so XLA cannot reorder the sums."""
    sink2 = sink_nh.astype(jnp.float32) * _LOG2E
    n_splits = o_nshd.shape[1]
    top = sink2
    for s in range(n_splits):
        top = jnp.maximum(top, lse_nsh[:, s])
    denom = jnp.exp2(sink2 - top)
    acc = None
    for s in range(n_splits):
        w = jnp.exp2(lse_nsh[:, s] - top)
        denom = denom + w
        term = o_nshd[:, s] * w[..., None]
        acc = term if acc is None else acc + term
    return acc / denom[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def sparse_sink_attention_pallas(q_bthd: jax.Array, kv_bsd: jax.Array, idx_btk: jax.Array, sink_h: jax.Array,
                                 scale: float, config: SparseAttentionConfig = SparseAttentionConfig()) -> jax.Array:
    """-> o_bthd bf16. Same contract as ``pallas_kernels.attention.sparse_sink_attention``; bf16 q and kv."""
    b, t, h, d = q_bthd.shape
    if kv_bsd.ndim != 3 or kv_bsd.shape[0] != b or kv_bsd.shape[2] != d:
        raise ValueError(f"kv_bsd {kv_bsd.shape} does not match q_bthd {q_bthd.shape} (want [{b}, S, {d}])")
    if idx_btk.shape[:2] != (b, t):
        raise ValueError(f"idx_btk {idx_btk.shape} does not match q_bthd {q_bthd.shape} (want [{b}, {t}, K])")
    if sink_h.shape != (h,):
        raise ValueError(f"sink_h {sink_h.shape} must be [{h}]")
    if q_bthd.dtype != jnp.bfloat16 or kv_bsd.dtype != jnp.bfloat16:
        raise ValueError(f"the kernel takes bf16 q and kv, got {q_bthd.dtype} and {kv_bsd.dtype}")
    if (why := kernel_unsupported_reason(h, d, config)) is not None:
        raise ValueError(f"sparse_sink_attention_pallas cannot run this shape: {why}")

    groups = -(-h // HEAD_GROUP)
    hp = groups * HEAD_GROUP
    k = idx_btk.shape[2]
    n_splits = config.num_splits(k)
    kp = n_splits * config.split_rows
    q = jnp.pad(q_bthd, ((0, 0), (0, 0), (0, hp - h), (0, 0))).reshape(b * t * groups, HEAD_GROUP, d)
    sink = jnp.pad(sink_h.astype(jnp.float32), (0, hp - h)).reshape(groups, HEAD_GROUP)
    idx = jnp.pad(idx_btk.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - k)), constant_values=-1)
    idx = jnp.repeat(idx.reshape(b * t, kp), groups, axis=0)
    idx = idx.reshape(b * t * groups, n_splits, config.split_rows // BLOCK_ROWS, BLOCK_ROWS)

    call = _build(b * t * groups, t * groups, d, n_splits, config.split_rows, float(scale),
                  config.producer_warpgroups)
    outs = call(q, kv_bsd, idx, sink)
    if n_splits == 1:
        o = outs[0]
    else:
        sink_nh = jnp.tile(sink, (b * t, 1))
        o = merge_splits(outs[0], outs[1], sink_nh).astype(jnp.bfloat16)
    return o.reshape(b, t, hp, d)[:, :, :h]
