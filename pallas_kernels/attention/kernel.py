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

FP4 compressed rows (``sparse_sink_attention_fp4_pallas``). The index list is then two lists: window
rows (bf16, as above) and rows of the compressed cache as stored at deployment precision (packed E2M1
values, 256 B per 512-dim row, with an E4M3 scale per 16 values). The window part is padded to whole
64-row blocks, so a block is either all window or all compressed, which the producer and the consumers
tell from the block's position. For a compressed block the producer copies each selected row's 256 value
bytes into an FP4 landing block, and the block's 64 x 32 scale bytes (gathered per query by the wrapper:
Mosaic's warpgroup copies move multiples of 128 bytes, and a row's scales are 32) into a scale slot;
both consumers then dequantize all 64 rows, each its D/2 columns, into the wgmma tile. A packed byte
holds elements 2j and 2j+1, so the kernel's columns are each 16-value scale group's even elements then its
odd ones; the wrapper permutes q and the window rows the same way (the dot products are unchanged) and
un-permutes the output.

Every CTA's arithmetic depends only on its own query row, its index row and the config, so the result
is batch-invariant by construction. Every wgmma reads its A operand from shared memory and accumulates
into a fresh accumulator (the running output is rescaled in registers), which also lets the Mosaic GPU
interpreter run this kernel on a CPU (tests/test_attention_kernel.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.attention.config import BLOCK_ROWS, HEAD_GROUP, SparseAttentionConfig, kernel_unsupported_reason
# the grouped GEMM's E2M1 decoders: "arith" (float polynomial) and "bits" (float16 bit placement)
from pallas_kernels.grouped_gemm.kernel import _f16_bits_to_f32, _fp4_bytes_to_f16_bits, _fp4_nibble_to_f32
from pallas_kernels.grouped_gemm import fp4_packed
from pallas_kernels.grouped_gemm.kernel import fp4_k_permutation, from_fp4_k_order, to_fp4_k_order
from pallas_kernels.attention import consumer_state, cp_async
from pallas_kernels import mosaic   # (module-qualified: the kernel body names its block buffer "tiled")

_LOG2E = consumer_state.LOG2E
_SWIZZLE = 64     # bytes; 32 bf16 columns per tile, so each consumer's 32 probability columns are whole tiles
_HALF_ROWS = BLOCK_ROWS // 2
_FP4_GROUP = 16   # values per E4M3 scale in the compressed cache (kv_codec.COMPRESSED)
_WARPS = 4        # per warpgroup



def _build(n_queries: int, queries_per_batch: int, head_dim: int, n_splits: int, split_rows: int,
           scale: float, n_producers: int, win_blocks: int | None = None, groups: int = 1,
           no_auto_barriers: bool = False, row_issue: str = "warpgroup", pv_cols: int = 128,
           pv_in_place: bool = False, fp4_dequant: str = "bits", profile_dir: str = "", profile_ranges: int = 0,
           pdl: bool = False):
    """The pallas kernel for q [n, 64, D], kv [B, S, D], idx [n, splits, blocks, 64], sink [groups, 64];
    with ``win_blocks`` (FP4 mode) also values [B, N, D/2] uint8 and the per-query gathered scales
    [n / groups, blocks, D/16, 64] E4M3 (zeros for the window blocks), the first ``win_blocks`` blocks being
    window rows. profile_dir / profile_ranges: Mosaic GPU's profiler records the named phases of every
    warpgroup into a trace in that directory (SparseAttentionConfig.profile_dir)."""
    fp4 = win_blocks is not None
    producer_regs = 24 if n_producers == 2 else 40    # two producers: 232 a consumer still fits the pool
    if fp4 and n_producers != 1:
        raise ValueError("the FP4 kernel has one producer warpgroup")
    h, d = HEAD_GROUP, head_dim
    dh = d // 2                      # output columns per consumer warpgroup
    # Output columns per p.kv wgmma. A fresh accumulator of 64 x cw floats lives beside the 64 x D/2
    # output in registers (the consumer's spills on the H200 came from this pair); pv_in_place makes
    # the output itself the accumulator (rescaled, then accumulated into by the tensor core).
    cw = min(pv_cols, dh)
    if dh % cw:
        raise ValueError(f"pv_cols={pv_cols} must divide head_dim/2={dh}")
    n_chunks = dh // cw
    n_blocks = split_rows // BLOCK_ROWS
    row_layout = plgpu.Layout.WGMMA.reduce(1)   # one value per head
    col_layout = plgpu.Layout.WGMMA.reduce(0)   # one value per kv row
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((_HALF_ROWS, d), jnp.bfloat16, _SWIZZLE)
    score_scale = scale * _LOG2E     # exponentials are base 2; m and the log-sum-exp are in log2 units

    # (the Mosaic GPU interpreter runs no inline PTX: there "packed" decodes with "bits", the same values)
    dequant_mode = "bits" if fp4_dequant == "packed" and mosaic.interpreting() else fp4_dequant
    n_groups = d // _FP4_GROUP           # scale groups per row
    group_bytes = _FP4_GROUP // 2

    def dequant_chunk(fstage, fscale, cc):
        """[64, 32] bf16 of kernel columns [32cc, 32cc + 32): two scale groups, evens then odds each."""
        pieces = []
        for grp in (2 * cc, 2 * cc + 1):
            sc = plgpu.load(fscale.at[grp], layout=row_layout, optimized=False).astype(jnp.float16).astype(jnp.float32)
            q8 = plgpu.load(fstage.at[:, pl.ds(grp * group_bytes, group_bytes)], layout=plgpu.Layout.WGMMA,
                            optimized=False)
            if dequant_mode == "packed":
                # two values per 32-bit op (inline PTX); the E4M3 scale is exact in bf16
                s16 = lax.broadcast_in_dim(sc.astype(jnp.bfloat16), (BLOCK_ROWS, group_bytes), [0])
                pieces.append(fp4_packed.dequant_scaled(q8, s16))
                continue
            q8 = q8.astype(jnp.int32)   # Mosaic does no arithmetic on 8-bit lanes
            if dequant_mode == "bits":
                # value * 2^-14 from the bits, times scale * 2^14: both products exact (an E2M1 value has
                # 2 significant bits, an E4M3 scale 4, far from float32's range ends), so the same values
                vals = _f16_bits_to_f32(jnp.concatenate(_fp4_bytes_to_f16_bits(q8), axis=1))
                sc = sc * 16384.0
            else:
                vals = jnp.concatenate([_fp4_nibble_to_f32(q8 & 15), _fp4_nibble_to_f32(q8 >> 4)], axis=1)
            pieces.append(vals * lax.broadcast_in_dim(sc, (BLOCK_ROWS, _FP4_GROUP), [0]))
        return jnp.concatenate([p.astype(jnp.bfloat16) for p in pieces], axis=1)

    def body(q_ref, kv_ref, idx_ref, sink_ref, *rest):
        mosaic.wait_for_prior_grids(pdl)    # before the first read of any input
        if fp4:
            cv_ref, cs_ref, *rest = rest
        out_refs, scratch = rest[:-1], rest[-1]
        (q_smem, idx_smem, stage, tiled, probs, xmax, *fp4_smem), (q_bar, idx_bar, ready, free, xbar, *fp4_bar) = scratch
        n = lax.axis_index("query")
        split = lax.axis_index("split")
        batch = lax.div(n, jnp.int32(queries_per_batch))
        group = lax.rem(n, jnp.int32(sink_ref.shape[0]))

        def rendezvous():  # both consumer warpgroups
            plgpu.barrier_arrive(xbar)
            plgpu.barrier_wait(xbar)

        def consumer(half: int):
            plgpu.set_max_registers(mosaic.consumer_registers(2, n_producers, producer_regs), action="increase")
            rows = pl.ds(half * _HALF_ROWS, _HALF_ROWS)
            # Phases are named scopes: begin/end events of Mosaic GPU's profiler when it is on
            # (SparseAttentionConfig.profile_dir; config.PROFILE_SCOPES_PER_BLOCK counts them), nothing
            # otherwise. They follow one another, so they cover nearly all of a warpgroup's time.
            with jax.named_scope("c_init"):
                plgpu.barrier_wait(q_bar)
                plgpu.barrier_wait(idx_bar)
                o0, m0, l0 = consumer_state.initial_state(sink_ref, group, n_splits=n_splits, consumer=half, cols=cw,
                                                          n_chunks=n_chunks)

            def block(i, carry):
                o, m, l = carry
                if not fp4:
                    with jax.named_scope("c_wait"):
                        plgpu.barrier_wait(ready.at[half])
                    with jax.named_scope("c_tile"):
                        tiled.at[rows][...] = plgpu.load(stage.at[half], layout=copy_layout)
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(free.at[half])
                else:
                    # Both consumers wait on both slots every block: barrier phases are counted per waiter.
                    fstage, fscale = fp4_smem
                    with jax.named_scope("c_wait"):
                        plgpu.barrier_wait(ready.at[0])
                        plgpu.barrier_wait(ready.at[1])
                        plgpu.barrier_wait(fp4_bar[0])
                    with jax.named_scope("c_tile"):
                        is_win = split * n_blocks + i < win_blocks

                        @pl.when(is_win)
                        def _():
                            tiled.at[rows][...] = plgpu.load(stage.at[half], layout=copy_layout)

                        @pl.when(jnp.logical_not(is_win))
                        def _():
                            for c in range(dh // 32):
                                cc = half * (dh // 32) + c
                                tiled.at[:, pl.ds(cc * 32, 32)][...] = dequant_chunk(fstage, fscale, cc)
                        plgpu.commit_smem()
                    with jax.named_scope("c_tile_sync"):
                        rendezvous()  # every row of the tile is written; the landing block and scales are read
                        plgpu.barrier_arrive(free.at[half])

                def qk(acc_ref):
                    for c in range(2):
                        plgpu.wgmma(acc_ref, q_smem.at[c], tiled.at[rows, pl.ds(c * dh, dh)].T)
                    return acc_ref[...]
                with jax.named_scope("c_qk"):
                    s = pl.run_scoped(qk, plgpu.ACC((h, _HALF_ROWS), jnp.float32))
                    ids = plgpu.load(idx_smem.at[i, rows], layout=col_layout, optimized=False)
                    valid = lax.broadcast_in_dim(ids >= 0, (h, _HALF_ROWS), [1])
                    s = jnp.where(valid, s * score_scale, -jnp.inf)
                with jax.named_scope("c_max"):
                    xmax.at[half][...] = s.max(axis=1)
                    rendezvous()  # both halves' maxima are visible
                    m_new = jnp.maximum(m, jnp.maximum(xmax.at[0][...], xmax.at[1][...]))
                with jax.named_scope("c_exp"):
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (h, _HALF_ROWS), [0]))
                    l = l * alpha + p.sum(axis=1)
                    probs.at[:, rows][...] = p.astype(jnp.bfloat16)
                    plgpu.commit_smem()
                with jax.named_scope("c_psync"):
                    rendezvous()  # both halves of p and of the tiled block are visible to wgmma

                o_new = []
                with jax.named_scope("c_pv"):
                    for c in range(n_chunks):
                        cols = pl.ds(half * dh + c * cw, cw)

                        def pv(acc_ref, cols=cols):
                            plgpu.wgmma(acc_ref, probs, tiled.at[:, cols])
                            return acc_ref[...]
                        scaled = o[c] * lax.broadcast_in_dim(alpha, (h, cw), [0])
                        if pv_in_place:
                            o_new.append(pl.run_state(lambda acc_ref, cols=cols: plgpu.wgmma(acc_ref, probs,
                                                                                             tiled.at[:, cols]))(
                                plgpu.ACC.init(scaled)))
                        else:
                            o_new.append(scaled + pl.run_scoped(pv, plgpu.ACC((h, cw), jnp.float32)))
                with jax.named_scope("c_sync"):
                    rendezvous()  # both p.kv products are done before tiled/probs/xmax are rewritten
                return tuple(o_new), m_new, l

            o, m, l = lax.fori_loop(0, n_blocks, block, (o0, m0, l0))
            with jax.named_scope("c_out"):
                consumer_out(half, o, m, l)

        def consumer_out(half: int, o, m, l):
            consumer_state.write_output(half, o, m, l, l_exchange=xmax, sync=rendezvous, q_smem=q_smem,
                                        out_refs=out_refs, n=n, split=split, n_splits=n_splits, cols=cw, half_dim=dh)

        def copy_rows(i, half, src_ref, dst_half):
            """Start copying the selected rows of block i's half: src_ref[batch, row] -> dst_half[j], j < 32.
            TMA modes: one TMA per row, each one of ``ready[half]``'s 32 arrivals. "cp_async": the
            producer's threads copy 16-byte pieces and arrive in ``publish``."""
            if row_issue == "cp_async":
                cp_async.gather_rows(idx_smem.at[i], src_ref.at[batch], dst_half, first=half * _HALF_ROWS,
                                     rows=_HALF_ROWS, row_bytes=src_ref.shape[-1] * src_ref.dtype.itemsize)
                return

            def one(j):
                row = jnp.maximum(idx_smem[i, half * _HALF_ROWS + j], 0)
                plgpu.copy_gmem_to_smem(src_ref.at[batch, pl.ds(row, 1)], dst_half.at[pl.ds(j, 1)], ready.at[half])

            if row_issue == "warpgroup":
                for j in range(_HALF_ROWS):
                    one(j)
                return

            # Each warp issues a quarter of the rows from one lane; a warp-level copy arrives 4 x 32
            # times, i.e. once in the warpgroup units the barrier counts, so ``ready`` is unchanged.
            # The row numbers are read before the fork (Mosaic lowers no shared-memory load inside a
            # warp context) and picked per warp by selects.
            per_warp = _HALF_ROWS // _WARPS
            rows = [jnp.maximum(idx_smem[i, half * _HALF_ROWS + j], 0) for j in range(_HALF_ROWS)]

            @plgpu.warp_map
            def _(warp):
                for jj in range(per_warp):
                    row = rows[jj]
                    for w in range(1, _WARPS):
                        row = jnp.where(warp == w, rows[w * per_warp + jj], row)
                    plgpu.copy_gmem_to_smem(src_ref.at[batch, pl.ds(row, 1)],
                                            dst_half.at[pl.ds(warp * per_warp + jj, 1)], ready.at[half])

        def publish(halves):
            """cp_async: once this thread's pieces of each half (one group per half, in order) have
            landed, arrive on that half's ``ready`` (128 thread arrivals complete it)."""
            if row_issue != "cp_async":
                return
            for k, half in enumerate(halves):
                cp_async.wait_groups(len(halves) - 1 - k)
                plgpu.barrier_arrive(ready.at[half])

        def producer(halves: tuple[int, ...]):
            # With two producer warpgroups each issues one landing slot's rows. (How the rows are issued
            # does not set the kernel's speed: on the H200 every ``row_issue`` timed alike, README.md.)
            plgpu.set_max_registers(producer_regs, action="decrease")
            with jax.named_scope("p_init"):
                if 0 in halves:
                    for c in range(2):
                        plgpu.copy_gmem_to_smem(q_ref.at[n, :, pl.ds(c * dh, dh)], q_smem.at[c], q_bar)
                    plgpu.copy_gmem_to_smem(idx_ref.at[n, split], idx_smem, idx_bar)
                plgpu.barrier_wait(idx_bar)

            if fp4:
                fstage, fscale = fp4_smem
                bt = lax.div(n, jnp.int32(groups))

                @pl.loop(0, n_blocks)
                def _(i):
                    g = split * n_blocks + i

                    with jax.named_scope("p_wait_free"):
                        @pl.when(i > 0)
                        def _():  # the landing block and the scale slot are shared by both halves
                            plgpu.barrier_wait(free.at[0])
                            plgpu.barrier_wait(free.at[1])

                    with jax.named_scope("p_issue"):
                        @pl.when(g < win_blocks)
                        def _():
                            for half in (0, 1):
                                copy_rows(i, half, kv_ref, stage.at[half])

                        # Every block brings a scale slot (zeros for window blocks): the consumers then
                        # wait on it unconditionally, which keeps barrier waits out of branches.
                        plgpu.copy_gmem_to_smem(cs_ref.at[bt, g], fscale, fp4_bar[0])

                        @pl.when(g >= win_blocks)
                        def _():
                            for half in (0, 1):
                                copy_rows(i, half, cv_ref, fstage.at[pl.ds(half * _HALF_ROWS, _HALF_ROWS)])
                        publish((0, 1))   # either branch committed one cp.async group per half
                with jax.named_scope("p_drain"):
                    plgpu.barrier_wait(q_bar)
                    plgpu.barrier_wait(free.at[0])
                    plgpu.barrier_wait(free.at[1])
                return

            @pl.loop(0, n_blocks)
            def _(i):
                for half in halves:
                    with jax.named_scope("p_wait_free"):
                        @pl.when(i > 0)
                        def _():
                            plgpu.barrier_wait(free.at[half])
                    with jax.named_scope("p_issue"):
                        copy_rows(i, half, kv_ref, stage.at[half])
                with jax.named_scope("p_issue"):
                    publish(halves)
            # Observe the last phases so every barrier is quiescent when the kernel ends.
            with jax.named_scope("p_drain"):
                if 0 in halves:
                    plgpu.barrier_wait(q_bar)
                for half in halves:
                    plgpu.barrier_wait(free.at[half])

        halves_per_producer = [(0, 1)] if n_producers == 1 else [(0,), (1,)]
        mosaic.run_warpgroups(consumer, [lambda halves=halves: producer(halves) for halves in halves_per_producer])

    tiles = mosaic.tiled(_SWIZZLE, 2)
    scratch = (
        (plgpu.SMEM((2, h, dh), jnp.bfloat16, transforms=tiles),          # q, by column half
         plgpu.SMEM((n_blocks, BLOCK_ROWS), jnp.int32),                   # this split's indices
         plgpu.SMEM((2, _HALF_ROWS, d), jnp.bfloat16),                    # TMA landing slots
         plgpu.SMEM((BLOCK_ROWS, d), jnp.bfloat16, transforms=tiles),     # the block, wgmma layout
         plgpu.SMEM((h, BLOCK_ROWS), jnp.bfloat16, transforms=tiles),     # p
         plgpu.SMEM((2, h), jnp.float32)),                                # per-half maxima / sums
        (plgpu.Barrier(num_arrivals=2),
         plgpu.Barrier(),
         plgpu.Barrier(num_arrivals=1 if row_issue == "cp_async" else _HALF_ROWS, num_barriers=2),
         plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_arrivals=2)),
    )
    if fp4:
        scratch = ((*scratch[0],
                    plgpu.SMEM((BLOCK_ROWS, d // 2), jnp.uint8),                      # FP4 landing block
                    plgpu.SMEM((n_groups, BLOCK_ROWS), jnp.float8_e4m3fn)),           # its scales
                   (*scratch[1], plgpu.Barrier()))
    out_type = consumer_state.output_types(n_queries, n_splits, d)

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    params = dict(approx_math=True)
    if no_auto_barriers:
        # Pallas otherwise syncs the issuing warpgroup before every copy (one row each here); the
        # producer only writes landing slots that the consumers release through barriers.
        params["unsafe_no_auto_barriers"] = True
    if profile_ranges:
        # (a range is a begin and an end event; the buffer is profile_ranges ranges a warpgroup)
        params.update(profile_space=profile_ranges, profile_dir=profile_dir)
    return plgpu.kernel(entry, out_type=out_type, grid=(n_queries, n_splits), grid_names=("query", "split"),
                        num_threads=2 + n_producers, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(**params))


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


def _head_groups(q_bthd: jax.Array, sink_h: jax.Array) -> tuple[jax.Array, jax.Array, int]:
    """q [B, T, H, D] -> [B*T*groups, 64, D] and sink -> [groups, 64] (heads zero-padded to 64-head groups)."""
    b, t, h, d = q_bthd.shape
    groups = -(-h // HEAD_GROUP)
    hp = groups * HEAD_GROUP
    q = jnp.pad(q_bthd, ((0, 0), (0, 0), (0, hp - h), (0, 0))).reshape(b * t * groups, HEAD_GROUP, d)
    sink = jnp.pad(sink_h.astype(jnp.float32), (0, hp - h)).reshape(groups, HEAD_GROUP)
    return q, sink, groups


def _trimmed(config: SparseAttentionConfig, k: int) -> SparseAttentionConfig:
    """config with a split no longer than k rows (rounded up to whole blocks) when one split holds them:
    the blocks past the last index would be all -1, whose rows add exactly nothing (p = 0, alpha = 1),
    so the same bits in fewer blocks (a window-only layer's 128 rows: 2 blocks, not 5 or 10)."""
    unit = BLOCK_ROWS if config.schedule == "halves" else 2 * BLOCK_ROWS   # (seesaw: whole pairs)
    fit = -(-k // unit) * unit
    return dataclasses.replace(config, split_rows=fit) if 0 < fit < config.split_rows else config


def _split_blocks(idx_bk: jax.Array, groups: int, config: SparseAttentionConfig) -> jax.Array:
    """Index rows [B*T, splits*split_rows] -> [B*T*groups, splits, blocks, 64], one copy per head group."""
    n_splits = idx_bk.shape[1] // config.split_rows
    return jnp.repeat(idx_bk, groups, axis=0).reshape(idx_bk.shape[0] * groups, n_splits,
                                                      config.split_rows // BLOCK_ROWS, BLOCK_ROWS)


def _outputs(outs, sink: jax.Array, shape_bthd: tuple[int, ...]) -> jax.Array:
    """The kernel's outputs (one split: o; several: per-split o and lse, merged here) -> o_bthd bf16."""
    b, t, h, d = shape_bthd
    if len(outs) == 1:
        o = outs[0]
    else:
        o = merge_splits(outs[0], outs[1], jnp.tile(sink, (b * t, 1))).astype(jnp.bfloat16)
    return o.reshape(b, t, -1, d)[:, :, :h]


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

    q, sink, groups = _head_groups(q_bthd, sink_h)
    k = idx_btk.shape[2]
    config = _trimmed(config, k)
    n_splits = config.num_splits(k)
    kp = n_splits * config.split_rows
    padded_btk = jnp.pad(idx_btk.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - k)), constant_values=-1)
    idx = _split_blocks(padded_btk.reshape(b * t, kp), groups, config)

    if config.schedule != "halves":
        from pallas_kernels.attention import seesaw

        gathered = config.schedule == "seesaw_gathered"
        if gathered:   # each query's selected rows, in index order: [B*T, splits * split_rows, D]
            sel = jnp.maximum(padded_btk.reshape(b, t * kp), 0)
            kv_bsd = jnp.take_along_axis(kv_bsd, sel[..., None], axis=1).reshape(b * t, kp, d)
        call = seesaw.build(b * t * groups, t * groups, d, n_splits, config.split_rows, float(scale),
                            gathered=gathered, groups=groups, pv_in_place=config.pv_in_place, pv_cols=config.pv_cols,
                            pdl=config.pdl)
        return _outputs(call(q, kv_bsd, idx, sink), sink, q_bthd.shape)
    call = _build(b * t * groups, t * groups, d, n_splits, config.split_rows, float(scale),
                  config.producer_warpgroups, no_auto_barriers=config.no_auto_barriers, row_issue=config.row_issue,
                  pv_cols=config.pv_cols, pv_in_place=config.pv_in_place, profile_dir=config.profile_dir,
                  profile_ranges=config.profile_ranges, pdl=config.pdl)
    return _outputs(call(q, kv_bsd, idx, sink), sink, q_bthd.shape)


def fp4_column_order(d: int) -> jax.Array:
    """Kernel column j holds element ``order[j]``: each 16-value scale group's even elements, then its odd."""
    return fp4_k_permutation(d, _FP4_GROUP)


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def sparse_sink_attention_fp4_pallas(q_bthd: jax.Array, win_kv_bsd: jax.Array, win_idx_btk: jax.Array,
                                     comp_values_bnc: jax.Array, comp_scale_bng: jax.Array,
                                     comp_idx_btk: jax.Array, sink_h: jax.Array, scale: float,
                                     config: SparseAttentionConfig = SparseAttentionConfig()) -> jax.Array:
    """-> o_bthd bf16. ``pallas_kernels.attention.sparse_sink_attention_fp4``'s contract: attention over
    the listed window rows (bf16) and the listed compressed rows, read as stored (packed E2M1 values
    [B, N, D/2] uint8 with an E4M3 scale per 16 values [B, N, D/16]) and dequantized in the kernel."""
    b, t, h, d = q_bthd.shape
    if win_kv_bsd.ndim != 3 or win_kv_bsd.shape[0] != b or win_kv_bsd.shape[2] != d:
        raise ValueError(f"win_kv_bsd {win_kv_bsd.shape} does not match q_bthd {q_bthd.shape} (want [{b}, S, {d}])")
    n_c = comp_values_bnc.shape[1]
    if comp_values_bnc.shape != (b, n_c, d // 2) or comp_values_bnc.dtype != jnp.uint8:
        raise ValueError(f"comp_values_bnc {comp_values_bnc.shape} {comp_values_bnc.dtype}: want uint8 "
                         f"[{b}, N, {d // 2}] (two E2M1 values per byte)")
    if comp_scale_bng.shape != (b, n_c, d // _FP4_GROUP) or comp_scale_bng.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"comp_scale_bng {comp_scale_bng.shape} {comp_scale_bng.dtype}: want float8_e4m3fn "
                         f"[{b}, {n_c}, {d // _FP4_GROUP}] (one scale per {_FP4_GROUP} values)")
    for name, ix in (("win_idx_btk", win_idx_btk), ("comp_idx_btk", comp_idx_btk)):
        if ix.ndim != 3 or ix.shape[:2] != (b, t):
            raise ValueError(f"{name} {ix.shape} does not match q_bthd {q_bthd.shape} (want [{b}, {t}, K])")
    if sink_h.shape != (h,):
        raise ValueError(f"sink_h {sink_h.shape} must be [{h}]")
    if q_bthd.dtype != jnp.bfloat16 or win_kv_bsd.dtype != jnp.bfloat16:
        raise ValueError(f"the kernel takes bf16 q and window rows, got {q_bthd.dtype} and {win_kv_bsd.dtype}")
    if (why := kernel_unsupported_reason(h, d, config, fp4=True)) is not None:
        raise ValueError(f"sparse_sink_attention_fp4_pallas cannot run this shape: {why}")

    kw = -(-win_idx_btk.shape[2] // BLOCK_ROWS) * BLOCK_ROWS
    kc = -(-comp_idx_btk.shape[2] // BLOCK_ROWS) * BLOCK_ROWS
    config = _trimmed(config, kw + kc)
    n_splits = config.num_splits(kw + kc)
    kp = n_splits * config.split_rows
    pad = lambda ix, k: jnp.pad(ix.astype(jnp.int32), ((0, 0), (0, 0), (0, k - ix.shape[2])),  # noqa: E731
                                constant_values=-1)
    win_idx, comp_idx = pad(win_idx_btk, kw), pad(comp_idx_btk, kp - kw)
    q, sink, groups = _head_groups(to_fp4_k_order(q_bthd, _FP4_GROUP), sink_h)   # (kernel column order)
    idx = _split_blocks(jnp.concatenate([win_idx, comp_idx], axis=-1).reshape(b * t, kp), groups, config)
    # Each query's selected scale rows, block by block, scale-group major (what the kernel's slot holds).
    comp_idx = jnp.concatenate([jnp.full((b, t, kw), -1, jnp.int32), comp_idx], axis=-1)
    rows = jnp.take_along_axis(comp_scale_bng[:, None], jnp.maximum(comp_idx, 0)[..., None], axis=2)
    rows = jnp.where((comp_idx >= 0)[..., None], rows, jnp.zeros((), rows.dtype))
    cs = rows.reshape(b * t, kp // BLOCK_ROWS, BLOCK_ROWS, d // _FP4_GROUP).transpose(0, 1, 3, 2)

    call = _build(b * t * groups, t * groups, d, n_splits, config.split_rows, float(scale), 1,
                  win_blocks=kw // BLOCK_ROWS, groups=groups, no_auto_barriers=config.no_auto_barriers,
                  row_issue=config.row_issue, pv_cols=config.pv_cols, pv_in_place=config.pv_in_place,
                  fp4_dequant=config.fp4_dequant, profile_dir=config.profile_dir,
                  profile_ranges=config.profile_ranges, pdl=config.pdl)
    outs = call(q, to_fp4_k_order(win_kv_bsd, _FP4_GROUP), idx, sink, comp_values_bnc, cs)
    return from_fp4_k_order(_outputs(outs, sink, q_bthd.shape), _FP4_GROUP)
