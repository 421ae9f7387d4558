"""Tuning config for the grouped-GEMM kernel and the input checks shared by every implementation."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_gemm.reference import SCALE_BLOCK

SMEM_LIMIT_BYTES = 227 * 1024   # usable shared memory per CTA on Hopper (232,448 B less barriers/slack)
_BARRIER_SLACK = 2048   # barriers and allocation alignment (measured: 1,088 B over the tile sum)
FP4_DEQUANT_MODES = ("bits", "arith", "packed", "subnormal")
OPERAND_FORMS = ("bf16", "e4m3")     # fp4_operands / fp8_operands


class WeightFormat(enum.Enum):
    """How the per-expert weights are stored (told apart by dtype and scale shape)."""

    BF16 = "bf16"   # w bf16 [G, N, K]
    FP8 = "fp8"     # w float8_e4m3fn [G, N, K], E8M0 32x32 block scales [G, N/32, K/32]
    FP4 = "fp4"     # w uint8 [G, N, K/2] packed E2M1, E8M0 1x32 scales [G, N, K/32]

    @property
    def weight_bits(self) -> int:
        return {"bf16": 16, "fp8": 8, "fp4": 4}[self.value]


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Fixed tile shapes. A token row's result depends on its x row, its expert and this config only.

    block_m: token rows per tile (the wgmma N dimension, since the kernel computes y^T = W . x^T);
        each group is padded to a multiple of it. Multiple of 8, at most 256.
    block_n: weight rows (output columns) per CTA, split across the consumer warpgroups;
        multiple of 128.
    block_k: K elements per pipeline step; multiple of 64.
    stages: shared-memory pipeline depth (TMA copies in flight per CTA).
    a_from_registers: FP8/FP4 only: feed the dequantized weights to wgmma from registers (True) or
        stage each 32-column block through shared memory first (False; slower, but the form the
        Mosaic GPU interpreter can run, whose wgmma reads shared memory only).
    fp4_dequant: how the consumers decode FP4 nibbles (same bf16 values either way, so the same output
        bits): "bits" places each nibble's bits into a float16 (value * 2^-14; the 2^14 is folded into
        the scale) and converts to float32 in hardware, ~7 ALU ops per element; "arith" is the earlier
        float polynomial (~18 ops), kept so one GPU run can time both; "packed" decodes two nibbles
        per 32-bit op with inline PTX (``fp4_packed.py``, ~3.5 ops per element; GPU only: the interpreter
        runs "bits" in its place); "subnormal" builds E2M1 * 2^-126 as a bf16 (a subnormal for codes 0 and
        1) and multiplies by 2^(b-1), ~2.5 ops per element, exact only for E8M0 bytes <= 128
        (``fp4_packed.scales_fit_subnormal``; GPU only, like "packed").
    overlap_wgmma: let the dequantization of scale block c+1 run while block c's wgmma is in flight
        (wait for one group, not zero; the staged A tile gets two buffers per consumer). Same summation
        order as False, so the same bits.
    persistent: launch one CTA per SM (the interpreter: 2) instead of one per (column block, tile); each
        walks the (tile, column block) items i, i + #CTAs, ... with one TMA ring across its items, so the
        producer fills the next item's stages while the consumers finish the last one. Each item is
        computed exactly as in the one-per-tile grid, so the same bits.
    swizzle_weights: FP8/FP4: TMA-swizzle the weight tile's rows (when they are 32, 64 or 128 bytes long)
        and load each step's bytes whole, so the consumers' shared-memory reads do not conflict on banks
        (False: the earlier unswizzled tile, read per scale block). Same values, so the same bits.
    out_rows: write y [T*block_m, N] (a token row's outputs contiguous) from the accumulator registers
        instead of y^T [N, T*block_m] through a shared-memory tile and TMA. The wrapper's un-permute is
        then a plain row gather, and an expert FFN's w1/w3 results are already w2's row layout (False:
        the earlier y^T, whose un-permute and ``retile`` transpose). Same values, so the same bits.
        float32 outputs only (``writes_rows``): a bf16 store would write 16-byte runs, half a DRAM
        sector, which Mosaic GPU refuses; bf16 outputs keep y^T.
    consumers: consumer warpgroups per CTA (2 or 4), each owning block_n / consumers weight rows (a
        multiple of 64, the wgmma M granule). 4 gives each scheduler twice the consumer warps to hide
        the dequantization's latency with, at 104 registers a thread instead of 232 (what is left of
        the launch's 640 x 96 registers: ``mosaic.consumer_registers``). Each weight row is computed
        alike either way, so the same bits (on the H100 and the H200 too). Its first form asked for 112,
        more than the launch holds, and hung on the GPU. With tile-major weights 4 were 2-6 % faster at
        the FP4 decode and chunk tiles on both GPUs (sweep rounds 9-10), where the tuned table uses them.
    fp4_operands: FP4 weights only: "bf16" decodes them to bf16 for bf16 wgmmas with bf16 x (every
        other field keeps the bits); "e4m3" moves each nibble's bits into an E4M3 byte and runs FP8
        wgmmas on x as E4M3 values with per-32 power-of-two scales, one wgmma per scale block summed
        into float32 with both scales (``fp8_operands.py``): fewer instructions per weight, other
        bits than "bf16" (the partial sums round elsewhere), and x rounded to FP8 unless it already is
        such values (the model's activation quantizer makes them). fp4_dequant and overlap_wgmma do
        not apply to it.
    fp8_operands: FP8 weights only: "bf16" dequantizes them to bf16 in registers for bf16 wgmmas with
        bf16 x (the earlier form); "e4m3" gives the stored E4M3 weight bytes to FP8 wgmmas as they are,
        with x as E4M3 rows and both scales on the float32 sum per 32-column block, the E4M3 form of
        ``fp4_operands`` without its bit move (no per-weight ALU work at all). For the dense FP8
        linears, which the engine reads as bf16 copies (2.3 GB a 12-layer decode step more than the
        checkpoint's bytes; NOTES item -24(b)). Other bits than "bf16", as for FP4.
    e4m3_overlap: the E4M3 form with a zeroed accumulator per scale block of a K step, so block c's
        bit moves and scale loads run while block c-1's wgmma is in flight (else each block waits for
        its own wgmma). Same arithmetic in the same order, so the same bits.
    xla_block_m: token rows per tile in the XLA fallback's tile loop (any positive int).
    weights_tile_major: the kernel reads w as ``tile_major_weights(w, block_n, block_k)``: [G, N/block_n,
        K/block_k, block_n, block_k bytes] (a K step may read a part of a tile's rows: its block_k bytes must
        divide the layout's), so each K step's weight tile is one contiguous run (16 KB for
        FP4 256 x 128) instead of block_n row pieces of block_k bytes (64 B for FP4) a row apart. Why: ncu
        on the FP4 decode kernel (H100, 2026-12-05) had DRAM at 62 % of peak and L2 at 72 % with the
        issue slots half idle, 2 or 4 consumers alike; FP8 (128-byte row pieces) and bf16 (256) reached
        81-82 % of copy. Same values, so the same bits. The op's caller holds the re-laid weights.
    pdl: launch with programmatic dependent launch (Hopper): every thread first waits on
        ``griddepcontrol.wait`` (the grids this one depends on have finished and their writes are
        visible), so the driver may start the launch, its CTAs' scheduling and set-up, while the kernel
        before it drains, instead of after. Nothing is read or written before the wait, so the same bits;
        only the gap between kernels can change. Ignored in the interpreter.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    stages: int = 4
    a_from_registers: bool = True
    # "packed": measured fastest on the H200 (2026-12-03, `grouped_gemm_gpu.py --dequant-ab`): FP4 decode
    # 1.48 TB/s vs 1.08 ("bits") and 0.57 ("arith"), prefill 419 vs 381 and 226 TFLOP/s, all bitwise equal.
    # Exact for E8M0 scale bytes 0 and 3-251 (2^-124 .. 2^124), which real weight scales never leave.
    fp4_dequant: str = "packed"
    overlap_wgmma: bool = True
    persistent: bool = False
    swizzle_weights: bool = True
    out_rows: bool = True
    consumers: int = 2
    xla_block_m: int = 8
    weights_tile_major: bool = False
    fp4_operands: str = "bf16"
    fp8_operands: str = "bf16"
    e4m3_overlap: bool = False
    pdl: bool = False

    def __post_init__(self):
        if self.block_m % 8 or not 8 <= self.block_m <= 256:
            raise ValueError(f"block_m={self.block_m} must be a multiple of 8 in [8, 256] (wgmma N)")
        if self.block_n % 128 or self.block_n <= 0:
            raise ValueError(f"block_n={self.block_n} must be a positive multiple of 128 "
                             "(consumer warpgroups of 64-row wgmma tiles)")
        if self.consumers not in (2, 4) or self.block_n % (64 * self.consumers):
            raise ValueError(f"consumers={self.consumers} must be 2 or 4, with block_n={self.block_n} a multiple "
                             "of 64 rows per consumer")
        if self.block_k % 64 or self.block_k <= 0:
            raise ValueError(f"block_k={self.block_k} must be a positive multiple of 64")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be >= 2 to overlap copies with compute")
        if self.fp4_dequant not in FP4_DEQUANT_MODES:
            raise ValueError(f"fp4_dequant={self.fp4_dequant!r} must be one of {FP4_DEQUANT_MODES}")
        if self.fp4_operands not in OPERAND_FORMS:
            raise ValueError(f"fp4_operands={self.fp4_operands!r} must be one of {OPERAND_FORMS}")
        if self.fp8_operands not in OPERAND_FORMS:
            raise ValueError(f"fp8_operands={self.fp8_operands!r} must be one of {OPERAND_FORMS}")
        if self.xla_block_m < 1:
            raise ValueError(f"xla_block_m={self.xla_block_m} must be >= 1")


# The tile-major FP4 layout the model holds its experts in (``moe.prepare_experts_tile_major``): every
# FP4 decode and chunk tile reads a 256 x 128 tile whole, the prefill tiles (block_k 64) half of it.
TILE_MAJOR_TILE = (256, 128)


def tile_major_weights(w: jax.Array, block_n: int, block_k: int) -> jax.Array:
    """w [G, N, Kw] as stored (Kw = K/2 bytes for packed FP4) -> [G, N/block_n, K/block_k, block_n,
    block_k's bytes]: the layout ``weights_tile_major`` kernels read. A load-time copy."""
    g, n, kw = w.shape
    kb = block_k // 2 if w.dtype == jnp.uint8 else block_k
    if n % block_n or kw % kb:
        raise ValueError(f"w {tuple(w.shape)} does not split into {block_n} x {kb} tiles")
    return w.reshape(g, n // block_n, block_n, kw // kb, kb).transpose(0, 1, 3, 2, 4)


def tile_major_tile(w_tm) -> tuple[int, int]:
    """(block_n, block_k in elements) that tile-major weights [G, N/block_n, K/block_k, block_n, block_k's
    bytes] were laid out with (w_tm: an array or a ShapeDtypeStruct)."""
    bn, kbytes = w_tm.shape[3], w_tm.shape[4]
    return bn, kbytes * 2 if w_tm.dtype == jnp.uint8 else kbytes


def tile_major_stored_shape(w_tm) -> tuple[int, int, int]:
    """The [G, N, Kw] shape of the stored weights that tile-major ``w_tm`` holds."""
    g, nb, kb, bn, kbytes = w_tm.shape
    return g, nb * bn, kb * kbytes


def row_major_weights(w_tm: jax.Array) -> jax.Array:
    """``tile_major_weights`` undone: the stored [G, N, Kw] layout."""
    return w_tm.transpose(0, 1, 3, 2, 4).reshape(tile_major_stored_shape(w_tm))


def row_major_shape(w, cfg: GroupedMatmulConfig) -> tuple[int, int, int]:
    """The [G, N, Kw] shape of the stored weights w stands for (its own shape unless tile-major)."""
    if not cfg.weights_tile_major:
        return tuple(w.shape)
    if w.ndim != 5 or w.shape[3] != cfg.block_n:
        raise ValueError(f"weights_tile_major needs w as [G, N/block_n, K/block_k, block_n={cfg.block_n}, "
                         f"block_k bytes] (tile_major_weights), got shape {tuple(w.shape)}")
    kbytes = w.shape[4]
    step = cfg.block_k // 2 if w.dtype == jnp.uint8 else cfg.block_k
    if kbytes % step:
        raise ValueError(f"tile-major w has {kbytes}-wide K tiles; block_k={cfg.block_k} reads {step} at a "
                         "time, which must divide them")
    return tile_major_stored_shape(w)


def writes_rows(cfg: GroupedMatmulConfig, out_dtype) -> bool:
    """Whether the kernel writes y [T*block_m, N] (else y^T [N, T*block_m]): ``cfg.out_rows`` for float32."""
    return cfg.out_rows and jnp.dtype(out_dtype).itemsize == 4


def uses_e4m3_rows(cfg: GroupedMatmulConfig, fmt: WeightFormat) -> bool:
    """Whether the kernel takes x as ``fp8_operands.E4m3Rows``: FP4 weights with ``fp4_operands="e4m3"``
    or FP8 weights with ``fp8_operands="e4m3"``."""
    return ((fmt is WeightFormat.FP4 and cfg.fp4_operands == "e4m3")
            or (fmt is WeightFormat.FP8 and cfg.fp8_operands == "e4m3"))


def smem_bytes(cfg: GroupedMatmulConfig, fmt: WeightFormat, out_dtype, swiglu: bool = False) -> int:
    """Shared memory the kernel allocates for this config (pipeline slots + epilogue tiles). swiglu: the
    gate/up epilogue's launch (``kernel.swiglu_tiles``), whose bf16 h rows are staged as [block_m,
    block_n / 2] in all (float32 h is written from registers)."""
    e4m3 = uses_e4m3_rows(cfg, fmt)
    x_tile = cfg.block_m * cfg.block_k * (1 if e4m3 else 2)
    if e4m3:
        x_tile += cfg.block_m * (cfg.block_k // SCALE_BLOCK) * 4      # x's float32 scales
    w_tile = cfg.block_n * cfg.block_k * fmt.weight_bits // 8
    s_tile = 0 if fmt is WeightFormat.BF16 else (cfg.block_k // SCALE_BLOCK) * cfg.block_n
    if swiglu:
        out_tile = 0 if jnp.dtype(out_dtype) == jnp.float32 else cfg.block_m * cfg.block_n // 2 * 2
    else:
        out_tile = 0 if writes_rows(cfg, out_dtype) else cfg.block_n * cfg.block_m * jnp.dtype(out_dtype).itemsize
    a_stage = 0
    if fmt is not WeightFormat.BF16 and not cfg.a_from_registers:
        a_stage = cfg.block_n * SCALE_BLOCK * 2 * (2 if cfg.overlap_wgmma else 1)   # (>= the E4M3 form's)
    return cfg.stages * (x_tile + w_tile + s_tile) + out_tile + a_stage + _BARRIER_SLACK


def weight_format(w, w_scale) -> WeightFormat:
    """Which format (w, w_scale) is, or a ValueError that names the offending array."""
    if w.ndim != 3:
        raise ValueError(f"w must be [G, N, K] (or [G, N, K/2] packed FP4), got shape {w.shape}")
    if w_scale is None:
        if w.dtype != jnp.bfloat16:
            raise ValueError(f"w has dtype {w.dtype} but no w_scale: unscaled weights must be bfloat16")
        return WeightFormat.BF16
    if w.dtype == jnp.uint8:
        return WeightFormat.FP4
    if w.dtype == jnp.float8_e4m3fn:
        return WeightFormat.FP8
    raise ValueError(f"w with a w_scale must be uint8 (packed FP4) or float8_e4m3fn, got {w.dtype}")


def check_inputs(x_mk, w, group_ids_m, w_scale) -> tuple[WeightFormat, int, int, int]:
    """Shape/dtype checks for ``grouped_matmul`` -> (format, G, N, K) with K the logical (unpacked) K."""
    fmt = weight_format(w, w_scale)
    if x_mk.ndim != 2:
        raise ValueError(f"x_mk must be [M, K], got shape {x_mk.shape}")
    if x_mk.dtype != jnp.bfloat16:
        raise ValueError(f"x_mk must be bfloat16, got {x_mk.dtype}")
    if group_ids_m.shape != (x_mk.shape[0],):
        raise ValueError(f"group_ids_m must be [M] = [{x_mk.shape[0]}], got shape {group_ids_m.shape}")
    if not jnp.issubdtype(group_ids_m.dtype, jnp.integer):
        raise ValueError(f"group_ids_m must be an integer array, got {group_ids_m.dtype}")
    g, n, kw = w.shape
    k = kw * 2 if fmt is WeightFormat.FP4 else kw
    if x_mk.shape[1] != k:
        raise ValueError(f"x_mk has K={x_mk.shape[1]} but w {w.shape} ({fmt.value}) has K={k}")
    if fmt is not WeightFormat.BF16:
        if w_scale.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
            raise ValueError(f"w_scale must be E8M0 (uint8 or float8_e8m0fnu), got {w_scale.dtype}")
        if k % SCALE_BLOCK:
            raise ValueError(f"K={k} must be a multiple of {SCALE_BLOCK} for block-scaled weights")
        if fmt is WeightFormat.FP8:
            if n % SCALE_BLOCK:
                raise ValueError(f"N={n} must be a multiple of {SCALE_BLOCK} for FP8 32x32 block scales")
            want = (g, n // SCALE_BLOCK, k // SCALE_BLOCK)
        else:
            want = (g, n, k // SCALE_BLOCK)
        if tuple(w_scale.shape) != want:
            raise ValueError(f"w_scale for {fmt.value} weights {w.shape} must be {want}, got {w_scale.shape}")
    return fmt, g, n, k


def kernel_unsupported_reason(n: int, k: int, fmt: WeightFormat, cfg: GroupedMatmulConfig,
                              out_dtype=jnp.bfloat16) -> str | None:
    """Why the Mosaic GPU kernel cannot run this problem with this config, or None if it can."""
    if n % cfg.block_n:
        return f"N={n} is not a multiple of block_n={cfg.block_n}"
    if k % cfg.block_k:
        return f"K={k} is not a multiple of block_k={cfg.block_k}"
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return f"out_dtype {out_dtype} is not bfloat16 or float32"
    if not writes_rows(cfg, out_dtype) and cfg.block_m * jnp.dtype(out_dtype).itemsize < 32:
        return (f"block_m={cfg.block_m} gives {cfg.block_m * jnp.dtype(out_dtype).itemsize}-byte output rows; "
                "the TMA store needs >= 32 (a 32-byte swizzle)")
    used = smem_bytes(cfg, fmt, out_dtype)
    if used > SMEM_LIMIT_BYTES:
        return f"config needs {used} B of shared memory, more than the {SMEM_LIMIT_BYTES} B a CTA may use"
    return None


def fit_stages(cfg: GroupedMatmulConfig, fmt: WeightFormat, out_dtype, swiglu: bool = False) -> GroupedMatmulConfig:
    """The same tiles with as many pipeline stages (<= cfg.stages, >= 2) as fit in shared memory."""
    while smem_bytes(cfg, fmt, out_dtype, swiglu) > SMEM_LIMIT_BYTES and cfg.stages > 2:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


class _Tile(NamedTuple):
    """A tuned-table candidate: the tile shape, the ring depth and, where the sweep chose one, the
    consumer warpgroup count (None: the base config's)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    consumers: int | None = None


# Tile configs by phase, best first, from `benchmarks/grouped_gemm_gpu.py --sweep` on the H200
# (2026-12-03, float32 out, hidden 5120 x width 2304, 384 experts; rounds 1 and 2 in benchmarks/results/
# grouped_gemm_sweep*_2026-12-03.json). Every config gave bitwise the same rows, so this choice is
# speed only; it is still a static function of the step shape, never of the routing.
#   decode (~1-8 rows per expert): FP4 64x6 tokens 1.31 ms at the old 64x128x128x4 -> 0.83 ms at
#     16x256x128x8, 512x6 2.00 -> 1.30 ms; FP8 512x6 2.52 -> 1.55 ms at 16x256x128x5 (0.70 of copy
#     bandwidth). Small block_m wastes fewer padded rows per expert; a 256-row weight tile and 8 stages
#     keep more FP4 bytes in flight per CTA.
#   prefill: FP4 32k x 6 315 -> 474 TFLOP/s at 128x256x64x3; 8k x 6 (128 rows per expert) 312 at
#     64x256x128x4 -> 343 at 128x256x64x3.
#   persistent launch (2026-12-04, round 3, results/grouped_gemm_sweep3_2026-12-04.json): FP4 decode 64x6
#     0.825 -> 0.763 ms, 512x6 1.255 -> 1.205; FP4 prefill 32k x 6 494 -> 566 TFLOP/s (0.74 of the dense
#     rate); FP8 decode unchanged (1.507 vs 1.517 ms). Round 4 (swizzled weight tiles, the default
#     ``swizzle_weights``; results/grouped_gemm_sweep4_2026-12-04.json): FP8 decode 512x6 1.512 -> 1.370 ms,
#     1.333 persistent (0.82 of copy); FP4 decode 64x6 0.764 -> 0.752 ms, and 0.615 (0.59 of copy) with
#     the "subnormal" decoder, which the model picks when the scales allow it (moe._tile_config). Prefill
#     unchanged (558-566 TFLOP/s). Bitwise equal throughout.
#   prefill chunks (2026-12-04, round 5, results/grouped_gemm_sweep5_2026-12-04.json): at 1024-2048 tokens
#     (16-32 rows per expert) 64x256x128x4 persistent took 1.20 ms for either, against 1.35 ms for the
#     16-row tiles at 1024 (experts above 16 rows take two tiles and dequantize twice) and 1.90 ms for
#     the 128-row tiles at 2048. FP8 and bf16 keep the decode / prefill split at 32 rows (not swept).
_PERSISTENT = {(WeightFormat.FP4, "decode"), (WeightFormat.FP4, "chunk"), (WeightFormat.FP4, "prefill"),
               (WeightFormat.FP8, "decode")}
_DECODE_CANDIDATES = {
    WeightFormat.FP4: (_Tile(16, 256, 128, 8, 4), _Tile(16, 256, 128, 8), _Tile(16, 128, 128, 8)),
    WeightFormat.FP8: (_Tile(16, 256, 128, 5), _Tile(16, 128, 256, 5)),
    # bf16: not swept, the earlier 81 %-of-copy tiles
    WeightFormat.BF16: (_Tile(32, 128, 128, 4), _Tile(64, 128, 128, 4)),
}
# FP8 and bf16 prefill were not swept: their first candidates are the tiles of the earlier measured
# table (pallas_kernels/README.md: 369 / 368 TFLOP/s at 32k x 6).
# FP4 prefill at 8 stages since round 7 (2026-12-05, results/grouped_gemm_sweep7_2026-12-05.json): with
# the output stored from registers the y^T tile's 128 KB is free, and 32k x 6 took 7.66 ms against 8.10
# at 3 stages (606 TF/s). The chunk tiles lost with deeper rings there (6 stages: 1.56 vs 1.25 ms at 2048).
_PREFILL_CANDIDATES = {
    WeightFormat.FP4: (_Tile(128, 256, 64, 8), _Tile(128, 128, 64, 6), _Tile(64, 256, 128, 4),
                       _Tile(64, 128, 128, 4)),
    WeightFormat.FP8: (_Tile(128, 128, 128, 4), _Tile(64, 128, 128, 4)),
    WeightFormat.BF16: (_Tile(128, 128, 64, 4), _Tile(64, 128, 128, 4)),
}
# Four consumers in the first FP4 entries of _DECODE_CANDIDATES (16-row tiles, 512 x 6)
# and _CHUNK_CANDIDATES (2048 x 6) since sweep round 10 on the H200
# (2026-12-06, results/grouped_gemm_sweep10_h200_2026-12-06_s21.json, tile-major weights): 0.936 against
# 1.000 ms, and 1.204 against 1.228 ms; the same bits.
_CHUNK_CANDIDATES = {
    WeightFormat.FP4: (_Tile(64, 256, 128, 4, 4), _Tile(64, 256, 128, 4), _Tile(64, 128, 128, 6)),
}
# FP4 decode below this mean rows per expert (B <= ~100 tokens x 6 over 384 experts) takes 8-row tiles:
# in the slice's B=64 decode step (1 row per expert) 26.86 ms/step against 28.76 with 16-row tiles
# (2026-12-05, e2e_gpu.py --decode-block-m 8; op 0.733 vs 0.761 ms at 64 x 6 in sweep round 7). At 8
# rows per expert 16-row tiles were best (round 2): an 8-row tile per 8 rows re-reads the expert's
# weights for each tile, so the switch sits low. Same bits at any tile.
# Four consumer warpgroups there since 2026-12-06 (sweep round 9 on an H200, results/grouped_gemm_sweep9_
# h200_2026-12-06_s21.json): 64 x 6 kernel 0.560 ms against 0.594 with two (tile-major weights; 0.576
# vs 0.598 on an H100 in round 9), the same bits.
FEW_ROWS_PER_GROUP = 2
_FEW_ROWS_CANDIDATES = {WeightFormat.FP4: (_Tile(8, 256, 128, 8, 4),)}
# The E4M3 operand form (``fp4_operands="e4m3"``) keeps a float32 sum and a scaled wgmma block in registers
# beside each other: ptxas (deviceless, H200 target; benchmarks/grouped_gemm_compile.py) spills at 64-row
# tiles (660 B with 4 consumers, 296 with 2) and not at 8-32 rows (64-95 registers). On an H100 (sweep round 11, 2026-12-06, results/
# grouped_gemm_sweep11_h100_2026-12-06_s22.json) the spilling tiles lost: 2048 x 6 1.232 -> 1.513 ms at
# 64 rows, 32k x 6 7.8 -> 143 ms at 128 rows, while decode gained (64 x 6 0.573 -> 0.551, 512 x 6 0.956
# -> 0.897). So beyond the decode phase the form takes 32-row tiles (unmeasured; spill-free).
# On the H200 (sweep round 12, 2026-12-06, results/grouped_gemm_sweep12_h200_2026-12-06_s23.json) the
# 32-row chunk tile took 1.670 ms at 2048 x 6 against 1.212 for the bf16 form's 64-row tile: the form
# still loses beyond decode, but a program's form may not follow its batch size (the bits would), so it
# stays the tile a program with the form runs there.
_E4M3_WIDE_CANDIDATES = (_Tile(32, 256, 128, 6, 4),)
E4M3_MAX_BLOCK_M = 32
# ``e4m3_overlap`` in the decode phase: 64 x 6 0.405 -> 0.393 ms and 512 x 6 0.730 -> 0.707 on the H200
# (round 12), the same bits; ptxas keeps its 8- and 16-row tiles spill-free (68 / 91 registers) and
# spills 8 B at the 32-row chunk tile, where it is not measured, so it stays off there.
E4M3_OVERLAP_PHASES = ("decode",)
DECODE_ROWS_PER_GROUP = 32    # below this mean rows per expert, padding to block_m dominates
# FP4 (the formats with chunk candidates): decode tiles below 12 mean rows per expert (measured best at
# 1 and 8); 64-row tiles at 64 (4096 x 6: 1.707 ms against 1.893 for 128-row tiles, sweep round 6);
# 128-row tiles at 128 (results/grouped_gemm_sweep2_*). The switch between 64 and 128 is unmeasured and
# sits halfway.
CHUNK_ROWS_PER_GROUP = (12, 96)


def tile_phase(m_rows: int, num_groups: int, fmt: WeightFormat) -> str:
    """"decode", "chunk" or "prefill": which candidate list serves M rows over G groups (a static choice)."""
    per_group = m_rows / max(num_groups, 1)
    if fmt in _CHUNK_CANDIDATES:
        lo, hi = CHUNK_ROWS_PER_GROUP
        return "decode" if per_group < lo else "chunk" if per_group < hi else "prefill"
    return "decode" if per_group < DECODE_ROWS_PER_GROUP else "prefill"


def tuned_config(m_rows: int, num_groups: int, n: int, k: int, fmt: WeightFormat, out_dtype=jnp.float32,
                 base: GroupedMatmulConfig = GroupedMatmulConfig()) -> GroupedMatmulConfig:
    """The measured-fastest kernel config for M rows over G groups of [N, K] weights.

    A pure function of static shapes: a jitted step of fixed shape always runs one config. With
    ``base.weights_tile_major`` only the candidates that read base's weight layout (its block_n, a
    block_k dividing base's) count. Falls back to ``base`` when no candidate fits (N or K not a multiple
    of its tiles, e.g. tiny test models). Fields other than the tile shape, the launch and the consumer
    count where a candidate names one (dequant mode, operand form, XLA tile) are taken from ``base``; the
    E4M3 operand form keeps to tiles of at most ``E4M3_MAX_BLOCK_M`` rows beyond the decode phase and
    overlaps its blocks (``e4m3_overlap``, same bits) in the phases of ``E4M3_OVERLAP_PHASES``."""
    phase = tile_phase(m_rows, num_groups, fmt)
    cands = {"decode": _DECODE_CANDIDATES, "chunk": _CHUNK_CANDIDATES, "prefill": _PREFILL_CANDIDATES}[phase][fmt]
    if phase == "decode" and m_rows < FEW_ROWS_PER_GROUP * num_groups:
        cands = _FEW_ROWS_CANDIDATES.get(fmt, ()) + cands
    if uses_e4m3_rows(base, fmt) and phase != "decode":
        cands = tuple(c for c in _E4M3_WIDE_CANDIDATES + cands if c.block_m <= E4M3_MAX_BLOCK_M)
    if base.weights_tile_major:     # the weights' layout fixes block_n and the K tile a step can read
        cands = tuple(c for c in cands if c.block_n == base.block_n and base.block_k % c.block_k == 0)
    e4m3_overlap = base.e4m3_overlap or (uses_e4m3_rows(base, fmt) and phase in E4M3_OVERLAP_PHASES)
    for c in cands:
        cfg = fit_stages(dataclasses.replace(base, block_m=c.block_m, block_n=c.block_n, block_k=c.block_k,
                                             stages=c.stages, consumers=c.consumers or base.consumers,
                                             persistent=(fmt, phase) in _PERSISTENT, e4m3_overlap=e4m3_overlap),
                         fmt, out_dtype)
        if kernel_unsupported_reason(n, k, fmt, cfg, out_dtype) is None:
            return cfg
    return base
