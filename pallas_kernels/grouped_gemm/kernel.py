"""Mosaic GPU (Hopper) grouped GEMM for MoE experts: y^T tile = W[g] tile . x tile^T, one group per tile.

Work layout. The tile plan (``plan.py``) sorts token rows by expert and pads each expert to a multiple
of ``block_m`` rows, so tile t belongs to one expert ``tile_group[t]`` (-1 = unused tile, skipped).
The item (n, t) is output columns [n*block_n, (n+1)*block_n) of tile t's rows. The grid launch gives
each item its own CTA; the persistent launch (``cfg.persistent``) starts one CTA per SM, and CTA c
takes items c, c + #CTAs, ... (tile-major), its TMA ring running on across them. Per item:

* the last warpgroup (producer) streams, per K step, the token tile x[block_m, block_k] (bf16), the
  weight tile W[g][block_n, block_k] as stored (bf16, e4m3 bytes or packed FP4 bytes; the quantized ones
  TMA-swizzled when ``cfg.swizzle_weights``, so the consumers' row reads do not share banks) and, for
  the quantized formats, the step's E8M0 scale bytes [block_k/32, block_n], with TMA into a
  ``stages``-deep ring.
* warpgroups 0 .. consumers-1 (``cfg.consumers``, 2 or 4) each own block_n/consumers weight rows.
  The weights are the wgmma A operand (the M side: 64-row granules) and the tokens the B operand (N
  side: any multiple of 8), so a decode tile of a few tokens wastes little tensor-core work. bf16
  weights feed wgmma from shared memory; FP8/FP4 are dequantized per 32-column scale block into
  registers (value x 2^(b-127), exact in bf16) and fed to wgmma as a register A operand. How FP4 is
  decoded (``cfg.fp4_dequant``) and whether block c+1's dequantization overlaps block c's wgmma
  (``cfg.overlap_wgmma``) change the speed, never the bf16 values.
* FP4 with ``cfg.fp4_operands="e4m3"`` instead: the nibbles become E4M3 bytes by bit moves (the value
  x 2^-6) and x arrives as E4M3 values with float32 power-of-two scales per 32 columns (a fourth TMA
  copy per step); each 32-column block is one FP8 wgmma into a zeroed accumulator, added to a float32
  sum in registers times weight scale x 2^6 x x scale (``fp8_operands.py``). Other bits than the bf16
  form, fewer instructions per weight. FP8 with ``cfg.fp8_operands="e4m3"``: the same, the stored
  E4M3 bytes being the A operand as they are (weight scale x x scale).
* the f32 accumulator [block_n/consumers, block_m] is the transposed output tile. By default
  (``cfg.out_rows``) each consumer stores it from registers straight into y [T*block_m, N], converted to
  the transposed WGMMA layout so that every store writes whole 32-byte runs of a y row, and the wrapper
  gathers the token rows back. The earlier form stores it to y^T [N, T*block_m] through shared memory
  with TMA (in the persistent launch, while the next item runs), and the wrapper transposes.

* ``swiglu_tiles``: w1 and w3 of an expert FFN in one launch with the SwiGLU and routing weight in the
  epilogue; each consumer keeps an accumulator for its share of w1's rows and one for w3's same rows,
  and writes only h (``_build``'s ``swiglu``).

Invariance: the K loop runs in a fixed order of 16-wide wgmma steps into one f32 accumulator; there is
no split-K and nothing depends on M, on the group sizes, or on where a row sits in its tile.

FP4 columns: byte j of a row holds elements 2j (low nibble) and 2j+1 (high nibble). The kernel decodes
a 32-element scale block as [16 low nibbles, 16 high nibbles], i.e. in the K order
(0, 2, ..., 30, 1, 3, ..., 31); the wrapper permutes x's columns the same way, which leaves the dot
product unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.grouped_gemm import act_quant, fp4_packed, fp8_operands
from pallas_kernels.grouped_gemm.config import (SMEM_LIMIT_BYTES, GroupedMatmulConfig, WeightFormat, check_inputs,
                                                fit_stages, kernel_unsupported_reason, row_major_shape, smem_bytes,
                                                uses_e4m3_rows, writes_rows)
from pallas_kernels.grouped_gemm.fp8_operands import E4m3Rows
from pallas_kernels.grouped_gemm.plan import (TilePlan, bucketed_tiles, make_tile_plan, materialized, max_tiles,
                                              scatter_back, take_rows)
from pallas_kernels.grouped_gemm.reference import SCALE_BLOCK
from pallas_kernels.grouped_gemm.scales import check_prepared, kernel_scales
from pallas_kernels.mosaic import consumer_registers, interpreting, run_warpgroups, tiled, wait_for_prior_grids

_HALF = SCALE_BLOCK // 2
_PTX_MODES = ("packed", "subnormal")     # FP4 decoders written in inline PTX (GPU only)
_PRODUCER_REGISTERS = 40     # the producer only issues TMA copies and waits


def _e8m0_row_to_f32(s_u8):
    """E8M0 bytes -> 2^(b-127) as float32 by placing b in the exponent field (b=0 gives 0, b=255 inf)."""
    return lax.bitcast_convert_type(s_u8.astype(jnp.int32) << 23, jnp.float32)


def _e8m0_row_to_f32_times_2_14(s_u8):
    """E8M0 bytes -> 2^(b-127) * 2^14 as float32 (b=0 gives 0 like ``_e8m0_row_to_f32``).

    The 2^14 undoes the float16 placement of ``_fp4_bytes_to_f16_bits``. Exact for b <= 240; b >= 241
    (scales >= 2^114) would need an exponent past float32's, and differs from the "arith" mode."""
    b = s_u8.astype(jnp.int32)
    return lax.bitcast_convert_type(jnp.where(b == 0, 0, (b + 14) << 23), jnp.float32)


def _fp4_bytes_to_f16_bits(q):
    """Packed FP4 bytes (int32 0..255) -> float16 bit patterns [low nibbles, high nibbles] as int32.

    An E2M1 nibble's 3 magnitude bits (2 exponent, 1 mantissa) go to float16 bits 9-11, straddling its
    exponent field, and the sign to bit 15. That float16 is exactly the E2M1 value * 2^-14: code 1 (0.5)
    becomes the float16 subnormal 2^-15, which the float16 -> float32 conversion widens exactly, and
    codes 2-7 become normal numbers with the same exponent steps as E2M1. Six integer ops per byte
    instead of a float polynomial per nibble, and no subnormal float32 or bfloat16 anywhere."""
    lo = ((q << 9) & 0x0E00) | ((q << 12) & 0x8000)
    hi = ((q << 5) & 0x0E00) | ((q << 8) & 0x8000)
    return lo, hi


def _e8m0_row_to_f32_times_2_6(s_u8):
    """E8M0 bytes -> 2^(b-127) * 2^6 as float32 (b=0 gives 0): the weight scale of the E4M3 operand form,
    whose bit move made each value 2^-6 times its E2M1 value. Exact for b <= 248."""
    b = s_u8.astype(jnp.int32)
    return lax.bitcast_convert_type(jnp.where(b == 0, 0, (b - fp8_operands.E2M1_TO_E4M3_LOG2) << 23), jnp.float32)


def _f16_bits_to_f32(h):
    return lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _fp4_nibble_to_f32(nib):
    """E2M1 code (int32 0..15, sign in bit 3) -> its value, with float arithmetic only (no table lookup).

    For the magnitude code c in 0..7: 0.5c + 0.5 max(c-4, 0) + max(c-6, 0) = 0,.5,1,1.5,2,3,4,6."""
    c = (nib & 7).astype(jnp.float32)
    mag = 0.5 * c + 0.5 * jnp.maximum(c - 4.0, 0.0) + jnp.maximum(c - 6.0, 0.0)
    sign = 1.0 - 2.0 * (nib >> 3).astype(jnp.float32)
    return mag * sign


def _build(fmt: WeightFormat, n: int, k: int, num_tiles: int, cfg: GroupedMatmulConfig, out_dtype,
           w_tile_bytes: int | None = None, n_weights: int = 1, swiglu: tuple | None = None):
    """w_tile_bytes: the K tile of tile-major weights (``cfg.weights_tile_major``), in bytes per row.
    n_weights: weight arrays of N rows each (same format and shape), run as one launch on the same x
    rows: y's columns are the first one's N, then the next one's. Column block nt reads weight
    nt // (N / block_n); the work of each block is what a launch on that weight alone does.
    swiglu: (limit, act_block, gu_dtype) for the gate/up epilogue (``swiglu_unsupported_reason`` says
    when it runs; gu_dtype as in ``swiglu_tiles``): the two weights are gate and up, column block nt
    covers output columns [nt*F, (nt+1)*F) with F = block_n / 2, its weight tile being gate's rows of
    those columns, then up's. Consumer c holds the accumulators of gate's and up's rows [c*R, (c+1)*R)
    of the block (R = block_n / consumers / 2), each fed the same wgmmas in the same order as a launch
    on that weight alone, and writes h = silu(min(gate, limit)) * clip(up, +-limit) * row_weight (limit
    None: no clamp) to y [T*block_m, N]: float32 from registers, or (out_dtype bf16) h rounded to bf16
    and, with act_block, put through the FP8 activation quantizer per act_block columns
    (``act_quant.py``), sent from shared memory by TMA."""
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    n_cons = cfg.consumers
    wg_rows = bn // n_cons
    n_pieces = 1 if swiglu is None else 2       # accumulators per consumer: its rows of each weight
    piece_rows = wg_rows // n_pieces
    feat = bn // n_pieces                       # rows of one weight per column block
    if swiglu is not None:
        why = swiglu_unsupported_reason(cfg, fmt, out_dtype, swiglu[1])
        if n_weights != 2 or why is not None:
            raise ValueError(f"the swiglu epilogue needs two weights and a config that passes "
                             f"swiglu_unsupported_reason; got {n_weights} weights: {why}")
    # the swiglu's bf16 rows go through shared memory: [block_m, R] of h^T a consumer, then TMA
    staged_rows = swiglu is not None and jnp.dtype(out_dtype) == jnp.bfloat16
    n_steps = k // bk
    quant = fmt is not WeightFormat.BF16
    bk_bytes = bk // 2 if fmt is WeightFormat.FP4 else bk       # weight bytes (elements for bf16) per row
    steps_per_tile = (w_tile_bytes or bk_bytes) // bk_bytes
    e4m3 = uses_e4m3_rows(cfg, fmt)     # FP8 wgmmas (fp8_operands.py)
    n_blocks_k = bk // SCALE_BLOCK      # scale blocks per K step
    x_swizzle = 64 if quant else 128      # quantized: B is sliced per 32-column scale block
    # (E4M3 x: 32-byte rows per scale block; an 8-bit register A must be [64, swizzle] bytes)
    x_dtype, x_transforms = (jnp.float8_e4m3fn, tiled(32, 1)) if e4m3 else (jnp.bfloat16, tiled(x_swizzle, 2))
    w_dtype = {WeightFormat.BF16: jnp.bfloat16, WeightFormat.FP8: jnp.float8_e4m3fn,
               WeightFormat.FP4: jnp.uint8}[fmt]
    # Quantized weight rows are bk_bytes long: unswizzled, the 8 rows a WGMMA-layout load reads at once
    # share banks (4-way conflicts for 64-byte FP4 rows, measured by ncu 2026-12-04); a bk_bytes swizzle
    # spreads them. TMA swizzles 32, 64 or 128-byte rows only.
    swizzle_w = quant and cfg.swizzle_weights and bk_bytes in (32, 64, 128)
    w_transforms = tiled(128, 2) if not quant else (tiled(bk_bytes, 1) if swizzle_w else ())
    out_itemsize = jnp.dtype(out_dtype).itemsize
    out_rows = writes_rows(cfg, out_dtype)
    copies_per_step = 4 if e4m3 else 3 if quant else 2
    if swiglu is not None:      # x, then each weight's piece and its scales
        copies_per_step = 1 + 2 * (2 if quant else 1)
    overlap = quant and cfg.overlap_wgmma
    a_bufs = 2 if overlap or (e4m3 and cfg.e4m3_overlap) else 1
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    fp4_mode = cfg.fp4_dequant if fmt is WeightFormat.FP4 else None
    if fp4_mode in _PTX_MODES and interpreting():
        fp4_mode = "bits"    # the interpreter cannot run inline PTX; "bits" gives the same values
    fp4_bits = fp4_mode == "bits"

    block_bytes = _HALF if fmt is WeightFormat.FP4 else SCALE_BLOCK    # weight bytes of one scale block
    # the E4M3 form reads 4 bytes of a row per register, the layout of its 8-bit wgmma A operand
    w_layout = plgpu.Layout.WGMMA_8BIT if e4m3 else plgpu.Layout.WGMMA

    def load_step_weights(w_smem, slot, rows):
        """The step's [wg_rows, bk_bytes] weight bytes in ``w_layout``, when the tile is swizzled (a
        swizzled tile is loaded whole; an unswizzled one per scale block, in ``block_weights``)."""
        if not swizzle_w:
            return None
        return plgpu.load(w_smem.at[slot, rows], layout=w_layout, optimized=False)

    def block_weights(w_smem, q_step, slot, rows, c):
        if q_step is not None:
            return q_step[:, c * block_bytes:(c + 1) * block_bytes]
        return plgpu.load(w_smem.at[slot, rows, pl.ds(c * block_bytes, block_bytes)], layout=w_layout,
                          optimized=False)

    def dequant_block(w_smem, q_step, s_step, s_rows, slot, rows, c):
        """[piece_rows, 32] bf16 A operand for scale block c of this step (in the kernel's K order);
        s_step: the step's scales [K step's blocks, ...], s_rows: this piece's rows in them."""
        s_u8 = plgpu.load(s_step.at[c, s_rows], layout=row_layout, optimized=False)
        q = block_weights(w_smem, q_step, slot, rows, c)
        if fp4_mode in _PTX_MODES:
            return fp4_packed.dequant(q, lax.broadcast_in_dim(s_u8.astype(jnp.int32), (piece_rows, _HALF), [0]),
                                      mode=fp4_mode)
        scale = _e8m0_row_to_f32_times_2_14(s_u8) if fp4_bits else _e8m0_row_to_f32(s_u8)
        scale = lax.broadcast_in_dim(scale, (piece_rows, SCALE_BLOCK), [0])
        if fmt is WeightFormat.FP8:
            vals = q.astype(jnp.float16).astype(jnp.float32)
        else:
            q = q.astype(jnp.int32)   # Mosaic does no arithmetic on 8-bit lanes
            if fp4_bits:
                vals = _f16_bits_to_f32(jnp.concatenate(_fp4_bytes_to_f16_bits(q), axis=1))
            else:
                vals = jnp.concatenate([_fp4_nibble_to_f32(q & 15), _fp4_nibble_to_f32(q >> 4)], axis=1)
        return (vals * scale).astype(jnp.bfloat16)

    w_blocks = n // bn              # column blocks of one weight array
    n_blocks = n // feat if swiglu is not None else n_weights * w_blocks
    if cfg.persistent:
        n_items = n_blocks * num_tiles
        n_ctas = min(_num_ctas(), n_items)
        items_per_cta = -(-n_items // n_ctas)
    else:
        items_per_cta = 1

    def body(tile_group_ref, x_ref, *rest):
        wait_for_prior_grids(cfg.pdl)       # before the first read of any input (the tile plan included)
        w_refs, rest = rest[:n_weights], rest[n_weights:]
        s_refs, rest = (rest[:n_weights], rest[n_weights:]) if quant else ((None,) * n_weights, rest)
        wp_ref, rest = (rest[0], rest[1:]) if swiglu is not None else (None, rest)   # row weights [T*block_m]
        xs_ref, rest = (rest[0], rest[1:]) if e4m3 else (None, rest)    # x's scales [K/32, P] for E4M3 rows
        y_ref, scratch = rest[0], rest[1:]
        (x_smem, w_smem, s_smem, xs_smem, a_smem, o_smem), (full, empty) = scratch

        def item(k):
            """This CTA's k-th item -> (column block, tile, group, has work). Items without work (tiles of
            group -1, or past the last item) only ever come after every item with work, so the k of the
            items with work are 0, 1, ..., and step k * n_steps + i of the ring is item k's K step i."""
            if not cfg.persistent:
                t = lax.axis_index("t")
                grp = tile_group_ref[t]
                return lax.axis_index("n"), t, grp, grp >= 0
            j = lax.axis_index("c") + k * n_ctas
            t = jnp.minimum(lax.div(j, n_blocks), num_tiles - 1)
            grp = tile_group_ref[t]
            return lax.rem(j, n_blocks), t, grp, (j < n_items) & (grp >= 0)

        def for_each_item(fn):
            @pl.loop(0, items_per_cta)
            def _(k):
                nt, t, grp, has_work = item(k)

                @pl.when(has_work)
                def _():
                    fn(k, nt, t, grp)

        def producer():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

            def load_rows(w_ref, s_ref, grp, i, slot, tile, off, count, w_dst, s_dst):
                """Step i's weight rows [off, off + count) of column tile ``tile`` (rows tile*block_n + off
                on of one weight array) into w_dst, and their scales into s_dst."""
                rows = pl.ds(tile * bn + off, count)
                if not cfg.weights_tile_major:
                    w_src = w_ref.at[grp, rows, pl.ds(i * bk_bytes, bk_bytes)]
                elif steps_per_tile == 1:
                    w_src = w_ref.at[grp, tile, i, pl.ds(off, count)]
                else:      # this step's columns of the layout's wider tile
                    w_src = w_ref.at[grp, tile, lax.div(i, steps_per_tile), pl.ds(off, count),
                                     pl.ds(lax.rem(i, steps_per_tile) * bk_bytes, bk_bytes)]
                plgpu.copy_gmem_to_smem(w_src, w_dst, full.at[slot])
                if quant:
                    plgpu.copy_gmem_to_smem(s_ref.at[grp, pl.ds(i * n_blocks_k, n_blocks_k), rows], s_dst,
                                            full.at[slot])

            def load_weights(w_ref, s_ref, nt, grp, i, slot):
                """Step i's weight tile (and scales) of column block nt of one weight array."""
                load_rows(w_ref, s_ref, grp, i, slot, nt, 0, bn, w_smem.at[slot], s_smem.at[slot])

            def load_gate_up(nt, grp, i, slot):
                """Step i's rows [nt*F, (nt+1)*F) of each weight (the swiglu epilogue's tile): gate's
                into the slot's first F rows, up's into the next F; their scales [2, K step's blocks, F]."""
                tile, off = lax.div(nt * feat, bn), lax.rem(nt * feat, bn)   # (F divides block_n)
                for wi in range(2):
                    load_rows(w_refs[wi], s_refs[wi], grp, i, slot, tile, off, feat,
                              w_smem.at[slot, pl.ds(wi * feat, feat)], s_smem.at[slot, wi])

            def load(k, nt, t, grp):
                m_rows = pl.ds(t * bm, bm)

                @pl.loop(0, n_steps)
                def _(i):
                    step = k * n_steps + i
                    slot = lax.rem(step, stages)

                    @pl.when(step >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])
                    plgpu.copy_gmem_to_smem(x_ref.at[m_rows, pl.ds(i * bk, bk)], x_smem.at[slot], full.at[slot])
                    if swiglu is not None:
                        load_gate_up(nt, grp, i, slot)
                    elif n_weights == 1:
                        load_weights(w_refs[0], s_refs[0], nt, grp, i, slot)
                    for wi in range(n_weights if n_weights > 1 and swiglu is None else 0):
                        # (each branch issues the same copies, so the slot's barrier counts the same bytes)
                        @pl.when(lax.div(nt, w_blocks) == wi)
                        def _(wi=wi):
                            load_weights(w_refs[wi], s_refs[wi], nt - wi * w_blocks, grp, i, slot)
                    if e4m3:
                        plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(i * n_blocks_k, n_blocks_k), m_rows],
                                                xs_smem.at[slot], full.at[slot])

            for_each_item(load)
            # Observe each used slot's last release so no barrier is mid-phase when the CTA exits. Ring step
            # s < stages was used iff its item (s // n_steps) had work.
            for s in range(min(stages, items_per_cta * n_steps)):
                @pl.when(item(s // n_steps)[3])
                def _():
                    plgpu.barrier_wait(empty.at[s])

        def consumer(half: int):   # half: this consumer's index (of cfg.consumers)
            # the launch's registers shared out: the producer keeps 40 a thread, the consumers the rest
            plgpu.set_max_registers(consumer_registers(n_cons, 1, _PRODUCER_REGISTERS), action="increase")
            rows = pl.ds(half * wg_rows, wg_rows)

            def compute_e4m3(k):
                """Item k's accumulator [wg_rows, block_m] from FP8 wgmmas, one per scale block, each
                scaled into a float32 sum (fp8_operands.py). With ``cfg.e4m3_overlap`` block c's bit moves
                run while block c-1's wgmma is in flight (a zeroed accumulator per block of the step);
                without, each block waits for its own wgmma and the other consumer warpgroups fill the
                wait. Same arithmetic in the same order either way."""
                def block_operands(slot, q_step, c):
                    """(A [wg_rows, 32] E4M3, (weight scales [wg_rows], x scales [block_m])) of block c; for
                    FP4 the bit-moved nibbles, whose 2^-6 the weight scales undo; for FP8 the stored bytes."""
                    # (the scales are read before A is staged: in the interpreter's race model only the
                    # staging's commit_smem orders earlier shared-memory reads before the producer's next
                    # TMA write; on the GPU the empty barrier's arrive does)
                    s_u8 = plgpu.load(s_smem.at[slot, c, rows], layout=row_layout, optimized=False)
                    x_s = plgpu.load(xs_smem.at[slot, c], layout=col_layout, optimized=False)
                    q = block_weights(w_smem, q_step, slot, rows, c)
                    if fmt is WeightFormat.FP8:
                        a, w_s = q, _e8m0_row_to_f32(s_u8)
                    else:
                        a = (fp8_operands.fp4_bytes_to_e4m3_jnp(q) if interpreting() else
                             fp8_operands.fp4_bytes_to_e4m3(q))
                        w_s = _e8m0_row_to_f32_times_2_6(s_u8)
                    if not cfg.a_from_registers:
                        buf = a_smem.at[half, c % a_bufs]
                        buf[...] = a
                        plgpu.commit_smem()
                        a = buf
                    return a, (w_s, x_s)

                def promote(acc, blk, scales):
                    w_s, x_s = scales      # powers of two: their product, and blk times it, are exact
                    return acc + blk * (lax.broadcast_in_dim(w_s, (wg_rows, bm), [0])
                                        * lax.broadcast_in_dim(x_s, (wg_rows, bm), [1]))

                def x_block(slot, c):
                    return x_smem.at[slot, :, pl.ds(c * SCALE_BLOCK, SCALE_BLOCK)].T

                def step_start(i):
                    slot = lax.rem(k * n_steps + i, stages)
                    plgpu.barrier_wait(full.at[slot])
                    return slot, load_step_weights(w_smem, slot, rows)

                def k_step(i, acc):
                    slot, q_step = step_start(i)
                    for c in range(n_blocks_k):
                        a, scales = block_operands(slot, q_step, c)

                        def block_scope(blk_ref):
                            plgpu.wgmma(blk_ref, a, x_block(slot, c))
                            plgpu.wgmma_wait(0)
                            return blk_ref[...]

                        acc = promote(acc, pl.run_scoped(block_scope, plgpu.ACC((wg_rows, bm), jnp.float32)), scales)
                    plgpu.barrier_arrive(empty.at[slot])
                    return acc

                def k_step_overlapped(i, acc):
                    slot, q_step = step_start(i)

                    def blocks(*blk_refs):     # one zeroed accumulator per scale block of the step
                        total, pending = acc, None
                        for c in range(n_blocks_k):
                            a, scales = block_operands(slot, q_step, c)
                            plgpu.wgmma(blk_refs[c], a, x_block(slot, c))
                            if pending is not None:   # block c-1 is done once at most one wgmma is in flight
                                total = promote(total, plgpu.wgmma_accumulator_load(pending[0], wait_n=1),
                                                pending[1])
                            pending = (blk_refs[c], scales)
                        return promote(total, plgpu.wgmma_accumulator_load(pending[0], wait_n=0), pending[1])

                    acc = pl.run_scoped(blocks, *[plgpu.ACC((wg_rows, bm), jnp.float32)] * n_blocks_k)
                    plgpu.barrier_arrive(empty.at[slot])
                    return acc

                acc0 = plgpu.layout_cast(jnp.zeros((wg_rows, bm), jnp.float32), plgpu.Layout.WGMMA)
                return lax.fori_loop(0, n_steps, k_step_overlapped if cfg.e4m3_overlap else k_step, acc0)

            # (weight rows in the slot's tile, the step's scales -> [K step's blocks, R], rows in them)
            # per accumulator: the consumer's rows, or with the swiglu epilogue its gate and up rows
            if swiglu is None:
                pieces = ((rows, lambda slot: s_smem.at[slot], rows),)
            else:
                own = pl.ds(half * piece_rows, piece_rows)
                pieces = tuple((pl.ds(p * feat + half * piece_rows, piece_rows),
                                lambda slot, p=p: s_smem.at[slot, p], own) for p in range(n_pieces))

            def compute(k, nt, t, grp):
                def acc_scope(*acc_refs):
                    @pl.loop(0, n_steps)
                    def _(i):
                        step = k * n_steps + i
                        slot = lax.rem(step, stages)
                        plgpu.barrier_wait(full.at[slot])
                        if quant:
                            q_steps = [load_step_weights(w_smem, slot, w_rows) for w_rows, _, _ in pieces]
                            for c in range(n_blocks_k):
                                # Block c of every piece is dequantized (while block c-1's wgmmas run), then
                                # its wgmmas issue back to back, as the one-piece kernel's 128-row wgmma does;
                                # each accumulator still gets its blocks in K order.
                                a_pieces = []
                                for p, (w_rows, s_step, s_rows) in enumerate(pieces):
                                    a = dequant_block(w_smem, q_steps[p], s_step(slot), s_rows, slot, w_rows, c)
                                    if not cfg.a_from_registers:
                                        buf = a_smem.at[half, (c % a_bufs) * n_pieces + p]
                                        buf[...] = a
                                        plgpu.commit_smem()
                                        a = buf
                                    a_pieces.append(a)
                                for p, a in enumerate(a_pieces):
                                    plgpu.wgmma(acc_refs[p], a,
                                                x_smem.at[slot, :, pl.ds(c * SCALE_BLOCK, SCALE_BLOCK)].T)
                                if not overlap:
                                    plgpu.wgmma_wait(0)   # the next block overwrites a
                                    continue
                                # Block c-1's wgmmas (and their A) are done; block c's run while c+1 is dequantized.
                                plgpu.wgmma_wait(n_pieces)
                                if c == 0:
                                    # ... and with them the previous step's last ones: release that step's slot.
                                    @pl.when(i > 0)
                                    def _():
                                        plgpu.barrier_arrive(empty.at[lax.rem(step + stages - 1, stages)])
                        else:
                            for p, (w_rows, _, _) in enumerate(pieces):
                                plgpu.wgmma(acc_refs[p], w_smem.at[slot, w_rows], x_smem.at[slot].T)
                            plgpu.wgmma_wait(0)
                        if not overlap:
                            plgpu.barrier_arrive(empty.at[slot])

                    if overlap:
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(empty.at[lax.rem(k * n_steps + n_steps - 1, stages)])
                    return tuple(acc_ref[...] for acc_ref in acc_refs)

                if e4m3:
                    acc = compute_e4m3(k)
                else:
                    accs = pl.run_scoped(acc_scope, *[plgpu.ACC((piece_rows, bm), jnp.float32)] * n_pieces)
                    acc = accs[0]
                if swiglu is not None:
                    # silu(min(g, limit)) * clip(u, +-limit) * row weight, in moe.swiglu's order
                    (limit, act_block, gu_dtype), (g, up) = swiglu, accs
                    if gu_dtype != jnp.float32:     # the products as the reference's GEMMs write them
                        g, up = (a.astype(gu_dtype).astype(jnp.float32) for a in (g, up))
                    if limit is not None:
                        up = jnp.clip(up, -limit, limit)
                        g = jnp.minimum(g, limit)
                    row_w = plgpu.load(wp_ref.at[pl.ds(t * bm, bm)], layout=col_layout, optimized=False)
                    h = jax.nn.silu(g) * up * lax.broadcast_in_dim(row_w, (piece_rows, bm), [1])
                    y_blk = y_ref.at[pl.ds(t * bm, bm), pl.ds(nt * feat + half * piece_rows, piece_rows)]
                    h_t = plgpu.layout_cast(h.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
                    if not staged_rows:
                        y_blk.T[...] = h_t
                        return
                    # h^T into shared memory (a thread writes two adjacent columns of a token row), read
                    # back token-major: in the WGMMA layout a row's act_block columns are 4 lanes', so the
                    # quantizer's block maxima need no exchange between warps
                    buf = o_smem.at[half]
                    if cfg.persistent:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last item's store has read buf
                    buf.T[...] = h_t
                    plgpu.commit_smem()
                    if act_block is not None:
                        rows_bf16 = plgpu.load(buf, layout=plgpu.Layout.WGMMA, optimized=False)
                        buf[...] = act_quant.fake_quant_blocks(rows_bf16.astype(jnp.float32), act_block)
                        plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, y_blk)
                    return
                if out_rows:
                    # Straight from registers into y [P, N]: in the transposed WGMMA layout each thread
                    # holds two adjacent weight rows (output columns) of one token row, so 8 lanes write
                    # 32 contiguous bytes of a y row (one 8-byte store each; PTX checked deviceless).
                    y_blk = y_ref.at[pl.ds(t * bm, bm), pl.ds(nt * bn + half * wg_rows, wg_rows)]
                    y_blk.T[...] = plgpu.layout_cast(acc.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
                    return
                if cfg.persistent:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last item's store has read o_smem
                o_smem.at[half][...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[half], y_ref.at[pl.ds(nt * bn + half * wg_rows, wg_rows),
                                                                   pl.ds(t * bm, bm)])

            for_each_item(compute)
            if staged_rows or not out_rows:
                plgpu.wait_smem_to_gmem(0)

        run_warpgroups(consumer, [producer], consumers=n_cons)

    s_shape = ((stages, n_blocks_k, bn) if swiglu is None else (stages, n_pieces, n_blocks_k, feat)) if quant \
        else (1, 8, 128)   # unused placeholder for bf16
    xs_shape = (stages, n_blocks_k, bm) if e4m3 else (1, 1, 8)      # x's scales (E4M3 rows only)
    a_staged = quant and not cfg.a_from_registers
    # dequantized A, staged in SMEM: a_bufs blocks of each piece
    a_shape = (n_cons, a_bufs * n_pieces, piece_rows, SCALE_BLOCK) if a_staged else (1, 1, 8, 32)
    a_dtype, a_transforms = (jnp.float8_e4m3fn, tiled(32, 1)) if e4m3 else (jnp.bfloat16, tiled(64, 2))
    # the TMA-stored y^T tiles, or the swiglu's bf16 rows; out_rows stores from registers (unused placeholder)
    if staged_rows:
        # swizzled rows of R bf16 values: the token-major load and the store back become ldmatrix /
        # stmatrix (unswizzled, each was an 8-way bank conflict: 128-byte rows, 8 tokens a warp access)
        o_shape, out_transforms = (n_cons, bm, piece_rows), tiled(piece_rows * 2, 2)
    else:
        o_shape = (1, 8, 32) if out_rows else (n_cons, wg_rows, bm)
        out_transforms = () if out_rows else tiled(plgpu.find_swizzle(bm * out_itemsize * 8, "out"), out_itemsize)
    scratch = (
        (plgpu.SMEM((stages, bm, bk), x_dtype, transforms=x_transforms),
         plgpu.SMEM((stages, bn, bk_bytes), w_dtype, transforms=w_transforms),
         plgpu.SMEM(s_shape, jnp.uint8),
         plgpu.SMEM(xs_shape, jnp.float32),
         plgpu.SMEM(a_shape, a_dtype, transforms=a_transforms),
         plgpu.SMEM(o_shape, out_dtype, transforms=out_transforms)),
        (plgpu.Barrier(num_arrivals=copies_per_step, num_barriers=stages),
         plgpu.Barrier(num_arrivals=n_cons, num_barriers=stages)),
    )

    def entry(*refs):
        n_in = 2 + n_weights * (2 if quant else 1) + (swiglu is not None) + (1 if e4m3 else 0)
        ins, outs = refs[:n_in], refs[n_in:]
        pl.run_scoped(lambda *s: body(*ins, *outs, *s), *scratch, collective_axes="wg")

    grid, grid_names = ((n_ctas,), ("c",)) if cfg.persistent else ((n_blocks, num_tiles), ("n", "t"))
    n_out = n if swiglu is not None else n_weights * n
    out_shape = (num_tiles * bm, n_out) if out_rows or staged_rows else (n_out, num_tiles * bm)
    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                        grid=grid, grid_names=grid_names, num_threads=n_cons + 1, thread_name="wg")


def _num_ctas() -> int:
    """CTAs of a persistent launch: one per SM of the GPU; 2 in the interpreter, so each CTA walks
    several items there too."""
    if interpreting():
        return 2
    try:
        return int(jax.local_devices(backend="gpu")[0].core_count)
    except RuntimeError:     # lowering for CUDA on a machine without a GPU (tests): an H100/H200's count
        return 132


def fp4_k_permutation(k: int, block: int = SCALE_BLOCK) -> jax.Array:
    """Column order the kernel uses for FP4: per ``block`` elements (one scale's), the even elements then
    the odd ones, the order packed nibbles unpack in.

    Kernel column blk*block + p*block/2 + i holds element blk*block + 2i + p."""
    blk = jnp.arange(k // block, dtype=jnp.int32)[:, None, None] * block
    par = jnp.arange(2, dtype=jnp.int32)[None, :, None]
    i = jnp.arange(block // 2, dtype=jnp.int32)[None, None, :]
    return (blk + 2 * i + par).reshape(k)


def to_fp4_k_order(a: jax.Array, block: int = SCALE_BLOCK) -> jax.Array:
    """a[..., fp4_k_permutation(K, block)] as a transpose inside each block of the last axis (elements
    [block/2, 2] -> [2, block/2]), not a gather: XLA gave the gather form of x's permutation a
    column-major result, which the following row gather then read across, and ran the attention's
    column gathers one element a thread (the H200 prefill trace, session 24)."""
    *lead, k = a.shape
    return a.reshape(*lead, k // block, block // 2, 2).swapaxes(-1, -2).reshape(*lead, k)


def from_fp4_k_order(a: jax.Array, block: int = SCALE_BLOCK) -> jax.Array:
    """The inverse of ``to_fp4_k_order``: a[..., argsort(fp4_k_permutation(K, block))]."""
    *lead, k = a.shape
    return a.reshape(*lead, k // block, 2, block // 2).swapaxes(-1, -2).reshape(*lead, k)


def grouped_matmul_pallas(x_mk: jax.Array, w: jax.Array, group_ids_m: jax.Array, w_scale: jax.Array | None = None,
                          *, out_dtype=jnp.bfloat16, config: GroupedMatmulConfig = GroupedMatmulConfig(),
                          scales_prepared: bool = False) -> jax.Array:
    """-> y_mn [M, N]. Same contract as ``pallas_kernels.grouped_gemm.grouped_matmul``.

    scales_prepared: w_scale is already in the kernel layout uint8 [G, K/32, N] (``scales.kernel_scales``).

    Not jitted as a whole on purpose: the plan, the kernel and the un-permute are three jitted
    functions, so eager callers (tests, benchmarks) reuse one compiled kernel for every M whose tile
    count falls in the same power-of-two bucket. Inside a caller's jit it all inlines as usual."""
    fmt, g, n, s_kernel = _kernel_operands(x_mk, w, group_ids_m, w_scale, scales_prepared, config, out_dtype,
                                           "grouped_matmul_pallas")
    m = x_mk.shape[0]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    # Eager calls share one compiled kernel per power-of-two bucket of tiles; inside a caller's jit (the
    # model) the program is compiled for this M anyway, so the grid is the exact bound: up to 2x fewer
    # padded rows to gather, run and scatter (512 -> 384 tiles at decode 64 x 6). Same row results.
    traced = isinstance(x_mk, jax.core.Tracer)
    num_tiles = max_tiles(m, g, config.block_m) if traced else bucketed_tiles(m, g, config.block_m)
    plan, x_pk = _plan_and_gather(x_mk, group_ids_m, num_groups=g, block_m=config.block_m, num_tiles=num_tiles,
                                  fp4=fmt is WeightFormat.FP4, e4m3=uses_e4m3_rows(config, fmt))
    y = _run_kernel(plan.tile_group, x_pk, (w,), None if s_kernel is None else (s_kernel,), fmt=fmt,
                    config=config, out_dtype=out_dtype)
    if writes_rows(config, out_dtype):
        return _scatter_back(y, plan, out_dtype=out_dtype)
    return _unpermute(y, plan, out_dtype=out_dtype)


_kernel_scales_jit = jax.jit(kernel_scales, static_argnames=("fmt", "n"))


def _kernel_operands(x_mk, w, group_ids_m, w_scale, scales_prepared: bool, config: GroupedMatmulConfig, out_dtype,
                     caller: str) -> tuple[WeightFormat, int, int, jax.Array | None]:
    """Checks the inputs and the config against the kernel -> (format, G, N, scales in the kernel layout)."""
    w = jax.ShapeDtypeStruct(row_major_shape(w, config), w.dtype)   # (checked as the stored layout)
    if scales_prepared:
        if w_scale is None:
            raise ValueError("scales_prepared=True needs a w_scale in the kernel layout [G, K/32, N]")
        fmt = check_prepared(w, w_scale)
        g, n, kw = w.shape
        k = kw * 2 if fmt is WeightFormat.FP4 else kw
        if x_mk.shape[1] != k:    # (check_inputs does this for the checkpoint layout)
            raise ValueError(f"x_mk has K={x_mk.shape[1]} but w {w.shape} ({fmt.value}) has K={k}")
        s_kernel = w_scale
    else:
        fmt, g, n, k = check_inputs(x_mk, w, group_ids_m, w_scale)
        s_kernel = None if fmt is WeightFormat.BF16 else _kernel_scales_jit(w_scale, fmt=fmt, n=n)
    if (why := kernel_unsupported_reason(n, k, fmt, config, out_dtype)) is not None:
        raise ValueError(f"{caller} cannot run this problem: {why}")
    return fmt, g, n, s_kernel


# ---- the op in three parts, for callers that chain GEMMs on the same rows (an expert FFN) -------------
# One plan and one gather serve w1 and w3; their results [T*block_m, N] stay in tile order for the
# elementwise work between the GEMMs, w2 reads them as its rows (``retile``: bf16, FP4 K order), and
# only w2's result goes back to the caller's row order. Each row still meets the same kernel and tiles.

def tile_rows(x_mk: jax.Array | E4m3Rows, group_ids_m: jax.Array, *, num_groups: int, block_m: int,
              fp4: bool, e4m3: bool = False, rows_per_source: int = 1) -> tuple[TilePlan, jax.Array | E4m3Rows]:
    """-> (plan, x_pk [T*block_m, K]): rows sorted by group, padded to whole tiles (zeros), and for FP4
    weights in the kernel's K order; as ``E4m3Rows`` when ``e4m3`` (a config with ``uses_e4m3_rows``).
    T is the exact bound ``max_tiles`` (these calls run inside a jit).

    rows_per_source: routed row i reads x row i // rows_per_source, so an MoE passes its token rows
    [M, K] with group_ids_m [M * top_k] (a token's ranks are consecutive) and the K permutation and
    quantizer run once a token instead of once a rank. Same rows, same bits."""
    if group_ids_m.shape[0] != x_mk.shape[0] * rows_per_source:
        raise ValueError(f"group_ids_m has {group_ids_m.shape[0]} rows, not x_mk's {x_mk.shape[0]} x "
                         f"rows_per_source={rows_per_source}")
    t = max_tiles(group_ids_m.shape[0], num_groups, block_m)
    return _plan_and_gather(x_mk, group_ids_m, num_groups=num_groups, block_m=block_m, num_tiles=t, fp4=fp4,
                            e4m3=e4m3, rows_per_source=rows_per_source)


def retile(h_pk: jax.Array | E4m3Rows, *, fp4: bool, e4m3: bool = False) -> jax.Array | E4m3Rows:
    """Tile-order activations [T*block_m, K] (a previous ``grouped_matmul_tiles``' y, after elementwise
    work) -> the next GEMM's x_pk [T*block_m, K], bf16, in the kernel's K order for FP4 (a permutation
    inside each row's 32-column blocks); as ``E4m3Rows`` when ``e4m3``. Rows already made ``E4m3Rows``
    (``e4m3`` then required) are only permuted: the permutation stays inside each scale block."""
    if isinstance(h_pk, E4m3Rows):
        if not e4m3:
            raise ValueError("E4m3Rows activations need the E4M3 form (e4m3=True)")
        return E4m3Rows(to_fp4_k_order(h_pk.values) if fp4 else h_pk.values, h_pk.scale)
    x_pk = h_pk.astype(jnp.bfloat16)
    x_pk = to_fp4_k_order(x_pk) if fp4 else x_pk        # the order the kernel decodes FP4 weights in
    return fp8_operands.e4m3_rows(x_pk) if e4m3 else x_pk


def gather_kernel_rows(x_mk: jax.Array | E4m3Rows, plan: TilePlan, src: jax.Array | None = None
                       ) -> jax.Array | E4m3Rows:
    """The padded tile rows [T*block_m, K] of either form of kernel rows (``retile``'s): padded row p is
    x row ``src[p]`` (default ``plan.row_src``), zeros where that is out of range."""
    src = plan.row_src if src is None else src
    if isinstance(x_mk, E4m3Rows):
        return fp8_operands.gather(x_mk, src)
    return take_rows(x_mk, src)


def grouped_matmul_tiles(plan: TilePlan, x_pk: jax.Array | E4m3Rows, w: jax.Array, w_scale: jax.Array | None = None,
                         *, out_dtype=jnp.float32, config: GroupedMatmulConfig = GroupedMatmulConfig(),
                         scales_prepared: bool = False,
                         more: tuple[tuple[jax.Array, jax.Array | None], ...] = ()) -> jax.Array:
    """The kernel on ``tile_rows`` / ``retile`` rows -> y [T*block_m, N] in tile order (padding rows
    hold zeros' results, unused tiles are not written); ``untile_rows`` brings it back to row order.
    config.block_m must be the plan's; x_pk is ``E4m3Rows`` exactly when the config ``uses_e4m3_rows``.
    With ``config.out_rows=False`` the kernel's y^T is transposed here (for timing that kernel form
    only: the model runs the default), as for bf16 outputs.

    more: further (w, w_scale) pairs of w's format, shape and scale layout, run in the same launch on
    the same rows -> y [T*block_m, N * (1 + len(more))], w's columns first. Each column's result is
    the one a launch on its own weight gives, bit for bit (the same tiles and K order); an expert
    FFN's w1 and w3 take one launch instead of two."""
    fmt, ws, ss = _tiles_operands(plan, x_pk, w, w_scale, more, config, scales_prepared, out_dtype,
                                  "grouped_matmul_tiles")
    y = _run_kernel(plan.tile_group, x_pk, ws, ss, fmt=fmt, config=config, out_dtype=out_dtype)
    return y if writes_rows(config, out_dtype) else y.T


def swiglu_unsupported_reason(config: GroupedMatmulConfig, fmt: WeightFormat, out_dtype=jnp.float32,
                              act_block: int | None = None) -> str | None:
    """Why ``swiglu_tiles`` cannot run with this config, weight format, output dtype and quantizer block,
    or None if it can. Each consumer holds two [block_n / consumers / 2, block_m] accumulators (gate's
    rows and up's), each a whole number of 64-row wgmma granules; the E4M3 operand form's per-block
    float32 sums are not built for two accumulators. float32 h is written from registers (``out_rows``);
    bf16 h is read back from shared memory token-major in the WGMMA layout (64-row granules of
    block_m), its quantizer blocks whole column granules of a consumer's columns."""
    dtype = jnp.dtype(out_dtype)
    piece_rows = config.block_n // config.consumers // 2
    if (config.block_n // config.consumers) % 128:
        return f"block_n / consumers = {config.block_n // config.consumers} is not a multiple of 128"
    if uses_e4m3_rows(config, fmt):
        return "the E4M3 operand form (fp4_operands / fp8_operands 'e4m3') has no swiglu epilogue"
    if dtype == jnp.float32:
        if act_block is not None:
            return "the quantizer (act_block) needs bf16 out"
        if not config.out_rows:
            return "out_rows=False (the y^T form) has no swiglu epilogue"
        return None
    if dtype != jnp.bfloat16:
        return f"out_dtype {dtype} is not float32 or bfloat16"
    if config.block_m % 64:
        return f"bf16 out reads h back in 64-row granules; block_m={config.block_m} is not a multiple of 64"
    if act_block is not None and (act_block % 8 or piece_rows % act_block):
        return (f"act_block={act_block} does not split a consumer's {piece_rows} columns into whole "
                "8-column granules")
    if (used := smem_bytes(config, fmt, dtype, swiglu=True)) > SMEM_LIMIT_BYTES:
        return f"bf16 out needs {used} B of shared memory, more than the {SMEM_LIMIT_BYTES} B a CTA may use"
    return None


def swiglu_config(config: GroupedMatmulConfig, fmt: WeightFormat, out_dtype=jnp.float32,
                  act_block: int | None = None) -> GroupedMatmulConfig | None:
    """``config`` with as many pipeline stages (<= its own, >= 2) as leave room for the swiglu epilogue's
    output form (``fit_stages``), or None where ``swiglu_unsupported_reason`` still refuses it. Stages
    change the speed, never the bits. (The engine's 128 x 256 x 64 prefill tile has 8 stages; its bf16
    rows need 32 KB beside them, which 7 leave.)"""
    config = fit_stages(config, fmt, out_dtype, swiglu=True)
    return None if swiglu_unsupported_reason(config, fmt, out_dtype, act_block) is not None else config


def swiglu_tiles(plan: TilePlan, x_pk: jax.Array, w1: jax.Array, w1_scale: jax.Array | None, w3: jax.Array,
                 w3_scale: jax.Array | None, row_weight_p: jax.Array, *, limit: float | None,
                 config: GroupedMatmulConfig = GroupedMatmulConfig(), scales_prepared: bool = False,
                 out_dtype=jnp.float32, act_block: int | None = None, gu_dtype=jnp.float32) -> jax.Array:
    """An expert FFN's gate/up GEMMs and its SwiGLU in one launch on ``tile_rows`` / ``retile`` rows
    -> h [T*block_m, N] in tile order:

        h = silu(min(g, limit)) * clip(u, -limit, limit) * row_weight_p[:, None],
        g = x . w1^T and u = x . w3^T rounded to gu_dtype (float32: as accumulated)

    (``deepinfer_jax.model.moe.swiglu`` times the row's routing weight; limit None: no clamp). The
    two products are the ones ``grouped_matmul_tiles`` gives for each weight, bit for bit (the same
    wgmmas in the same K order); gu_dtype bf16 rounds them as a bf16-output GEMM would (the model's
    ``Numerics.expert_out_dtype``) before the SwiGLU reads them in float32; the elementwise tail runs
    in the kernel's registers, so g and u are never written (2 x 4 bytes a row and column, read back
    once). Its bits may differ from XLA's
    elementwise ops on a GPU (exp's rounding); they are still a function of the row alone.
    row_weight_p: float32 [T*block_m], 0 on padding rows (their h is then 0). Unused tiles are not
    written. The config must pass ``swiglu_unsupported_reason``.

    out_dtype float32: h as computed. bfloat16: h rounded to bf16 and, with act_block, quantized as
    the model's ``act_quant`` does (FP8 E4M3, a power-of-two scale per act_block columns; ``act_quant.py``).
    These are the bf16 values the next GEMM reads: 2 bytes a value written, where float32 h took 4 and
    XLA's quantizer pass read them back. (A bf16 row store straight from the accumulator layout would write
    16-byte runs, half a sector, which Mosaic GPU after jax 0.11 refuses: these rows go through
    shared memory.)"""
    if act_block is not None and jnp.dtype(out_dtype) != jnp.bfloat16:
        raise ValueError("swiglu_tiles: act_block (the quantizer) needs out_dtype=bfloat16")
    fmt, ws, ss = _tiles_operands(plan, x_pk, w1, w1_scale, ((w3, w3_scale),), config, scales_prepared,
                                  jnp.float32, "swiglu_tiles")
    if (why := swiglu_unsupported_reason(config, fmt, out_dtype, act_block)) is not None:
        raise ValueError(f"swiglu_tiles cannot run this config: {why}")
    if row_weight_p.shape != (x_pk.shape[0],):
        raise ValueError(f"row_weight_p must be [{x_pk.shape[0]}] (one weight a padded row), got "
                         f"{row_weight_p.shape}")
    return _run_kernel(plan.tile_group, x_pk, ws, ss, row_weight_p.astype(jnp.float32), fmt=fmt, config=config,
                       out_dtype=jnp.dtype(out_dtype),
                       swiglu=(None if limit is None else float(limit), act_block, jnp.dtype(gu_dtype)))


def _tiles_operands(plan: TilePlan, x_pk, w, w_scale, more, config: GroupedMatmulConfig, scales_prepared: bool,
                    out_dtype, caller: str) -> tuple[WeightFormat, tuple, tuple | None]:
    """Checks a tile-order call's rows, plan and weights -> (format, weights, kernel-layout scales or
    None for bf16)."""
    # (E4m3Rows have the shape of their values)
    if x_pk.shape[0] != plan.row_src.shape[0] or plan.row_src.shape[0] != plan.tile_group.shape[0] * config.block_m:
        raise ValueError(f"x_pk has {x_pk.shape[0]} rows and the plan {plan.row_src.shape[0]} padded rows in "
                         f"{plan.tile_group.shape[0]} tiles; config.block_m={config.block_m} does not match")
    # (the group ids are the plan's: only their shape and dtype are checked)
    x_struct = jax.ShapeDtypeStruct(x_pk.shape, jnp.bfloat16)
    gid_struct = jax.ShapeDtypeStruct((x_pk.shape[0],), jnp.int32)
    fmt, _, _, s_kernel = _kernel_operands(x_struct, w, gid_struct, w_scale, scales_prepared, config, out_dtype,
                                           caller)
    if isinstance(x_pk, E4m3Rows) != uses_e4m3_rows(config, fmt):
        raise ValueError(f"x_pk is {'E4m3Rows' if isinstance(x_pk, E4m3Rows) else 'bf16 rows'} but the config "
                         f"(fp4_operands={config.fp4_operands!r}, {fmt.value} weights) takes the other form: "
                         "build the rows with tile_rows / retile(..., e4m3=uses_e4m3_rows(config, fmt))")
    ws, ss = [w], [s_kernel]
    for w_more, s_more in more:
        if w_more.shape != w.shape or w_more.dtype != w.dtype:
            raise ValueError(f"{caller}: every weight of one launch needs w's shape and dtype "
                             f"{w.shape} {w.dtype}, got {w_more.shape} {w_more.dtype}")
        ws.append(w_more)
        ss.append(_kernel_operands(x_struct, w_more, gid_struct, s_more, scales_prepared, config, out_dtype,
                                   caller)[3])
    return fmt, tuple(ws), None if s_kernel is None else tuple(ss)


def untile_rows(y_pn: jax.Array, plan: TilePlan, out_dtype=jnp.float32) -> jax.Array:
    """y [T*block_m, N] in tile order -> [M, N] in the caller's row order (0 for dropped rows)."""
    return _scatter_back(y_pn, plan, out_dtype=out_dtype)


_scatter_back = jax.jit(scatter_back, static_argnames=("out_dtype",))


@functools.partial(jax.jit, static_argnames=("num_groups", "block_m", "num_tiles", "fp4", "e4m3",
                                             "rows_per_source"))
def _plan_and_gather(x_mk, group_ids_m, *, num_groups, block_m, num_tiles, fp4, e4m3=False, rows_per_source=1):
    plan = make_tile_plan(group_ids_m, num_groups, block_m, num_tiles)
    # (permuted and quantized on the source rows, not the T*block_m padded ones: up to ~50x more at
    # decode; the padding rows' index M*rows_per_source maps to M, out of range, so they stay zeros)
    src = plan.row_src if rows_per_source == 1 else plan.row_src // rows_per_source
    return plan, gather_kernel_rows(retile(x_mk, fp4=fp4, e4m3=e4m3), plan, src)


# The y^T form (``out_rows=False``): un-permute through materialized copies when the routed rows are at
# least 1/4 of the padded ones.
# Fused into the gather, the transpose reads each output value from its own 32-byte sector (~8 bytes
# moved per byte used). Instead: the routed columns of y^T are compacted in group order first (a
# tile's rows are contiguous columns, so the reads are runs of ~block_m values), that [N, M] array is
# transposed, and the gather then reads whole rows. At a 2048-token prefill chunk (12,288 rows, 64-row
# tiles, P = 36,480) the transpose moves 1/3 of what transposing all of y^T did: the H200 trace of
# 2026-12-04 (session 12) timed that whole transpose at 0.40 ms a layer-chunk (1.5 GB at copy speed).
# At decode (384 rows, P = 6,144) the fused gather stays: the column runs are ~1-2 values long there.
_TRANSPOSE_FIRST_PADDING = 4


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _unpermute(y_np, plan, *, out_dtype):
    m = plan.dest_m.shape[0]
    if y_np.shape[1] > _TRANSPOSE_FIRST_PADDING * m:
        return scatter_back(y_np.T, plan, out_dtype)
    y_nm = materialized(jnp.take(y_np, plan.sorted_pos, axis=1, mode="clip"))  # group order
    y_mn = materialized(y_nm.T)
    y = jnp.take(y_mn, plan.sorted_m, axis=0, mode="clip")
    return jnp.where(plan.valid_m[:, None], y, jnp.zeros((), y.dtype)).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "config", "out_dtype", "swiglu"))
def _run_kernel(tile_group, x_pk, ws, s_kernels, row_weight=None, *, fmt, config, out_dtype, swiglu=None):
    """The kernel alone: tile_group [T], x_pk [T*block_m, K] (or ``E4m3Rows``), ws a tuple of weight
    arrays of one shape (s_kernels their kernel-layout scales, or None for bf16) -> y [T*block_m,
    len(ws) * N] (y^T unless ``writes_rows(config, out_dtype)``); with ``swiglu`` (``_build``'s) and
    row_weight [T*block_m] float32, the gate/up epilogue's y [T*block_m, N]."""
    n = row_major_shape(ws[0], config)[1]
    x_scale = ()
    if isinstance(x_pk, E4m3Rows):
        x_pk, x_scale = x_pk.values, (x_pk.scale.T,)      # scales [K/32, P]: a K step's are one TMA box
    call = _build(fmt, n, x_pk.shape[1], tile_group.shape[0], config, out_dtype,
                  ws[0].shape[4] if config.weights_tile_major else None, n_weights=len(ws), swiglu=swiglu)
    args = ((tile_group, x_pk, *ws) + (() if s_kernels is None else tuple(s_kernels))
            + (() if swiglu is None else (row_weight,)) + x_scale)
    return call(*args)
