"""A dense FP8 linear (or a few of them side by side) through the grouped GEMM kernel, K split statically.

Why: at decode a dense linear's GEMM is bound by reading its weights. XLA reads them as bf16 (the engine
holds them dequantized), two bytes a weight where the checkpoint stores one. The kernel reads the stored
E4M3 bytes and their 32 x 32 E8M0 block scales (``WeightFormat.FP8``).

How: linear g's K columns are cut into S pieces, and piece s of linear g is kernel group g*S + s, so the
kernel runs G*S groups of the same padded M rows ([G*S*Mp, K/S] rows, ``static_plan``). The S float32
partials are summed in split order. S is fixed per (N, K) by ``split_for`` (enough CTAs for a short K at
64 rows), never by M, so a row's bits depend on its own values only: batch-invariant.

Weights are split once, at load (``split_weights``): [G, N, K] E4M3 + [G, N/32, K/32] scales ->
``DenseFp8Weights`` (weights [G*S, N, K/S], kernel-layout scales [G*S, K/(32S), N]). ``dequantized``
gives back the exact bf16 weight [G, N, K] for the XLA path, which then computes bit for bit what it
computed from the checkpoint's tensors.

Measured (H100, 64 rows, ``benchmarks/dense_fp8_gpu.py``; benchmarks/NOTES.md item -25): the kernel
reads FP8 at 0.85-2.0 TB/s here, 1.05-1.35x XLA's bf16 dots on V4.1's large linears and slower on the
small ones, and the 4-layer decode step gained nothing, so the model keeps it off by default
(``Numerics.dense_kernel``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_gemm.config import (GroupedMatmulConfig, WeightFormat, fit_stages,
                                                kernel_unsupported_reason, uses_e4m3_rows)
from pallas_kernels.grouped_gemm.fp8_operands import E4m3Rows, e4m3_rows
from pallas_kernels.grouped_gemm.plan import TilePlan
from pallas_kernels.grouped_gemm.scales import SCALE_BLOCK, checkpoint_scales, kernel_scales

# Weight-tile rows and K steps of the dense form (the kernel's 64 x 128 x 128 decode tile).
DENSE_BLOCK_N = 128
DENSE_BLOCK_K = 128
# Split K until there are at least this many (N tile, piece) work items. On an H100 (132 SMs; session 25,
# results/dense_fp8_gpu_h100_sweep_2026-12-06_s25.json, 64 rows, 64 x 128 tiles, bf16 form) 72-80 items
# beat 144-160: wo_b 0.0308 ms at 2 pieces (80 items) against 0.0355 at 4, the shared w13 0.0209 at 2
# (72) against 0.0240 at 4; session 20's run had wo_a best at 2 (128 items; 64 at 1 was slower).
MIN_ITEMS = 72


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseFp8Weights:
    """G dense FP8 linears [N, K] held split along K for the kernel: ``weight`` float8_e4m3fn
    [G*S, N, K/S] (group g*S + s is linear g's K columns s*K/S .. (s+1)*K/S) and ``scale_kn`` uint8
    [G*S, K/(32S), N] (the kernel's layout, each 32 x 32 block's byte repeated over its 32 rows).
    ``groups`` and ``splits`` are static."""

    weight: jax.Array
    scale_kn: jax.Array
    groups: int = dataclasses.field(metadata=dict(static=True))
    splits: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(G, N, K) of the linears."""
        gs, n, ks = self.weight.shape
        return self.groups, n, ks * self.splits


def split_for(n: int, k: int, *, block_n: int = DENSE_BLOCK_N, block_k: int = DENSE_BLOCK_K,
              groups: int = 1) -> int:
    """The static K split of a [N, K] linear: the smallest power of two S that gives G * N/block_n * S
    >= MIN_ITEMS work items, as long as each piece keeps whole block_k steps (and a 32-column scale
    grid). A function of the shape alone, so a row's bits never depend on the batch."""
    s = 1
    while groups * (n // block_n) * s < MIN_ITEMS and k % (2 * s * block_k) == 0:
        s *= 2
    return s


def split_weights(w_gnk: jax.Array, s_gnk: jax.Array, splits: int) -> DenseFp8Weights:
    """[G, N, K] E4M3 + [G, N/32, K/32] E8M0 scales -> ``DenseFp8Weights`` with K split ``splits``-fold
    (a load-time copy). A 2-D [N, K] weight is one group."""
    if w_gnk.ndim == 2:
        w_gnk, s_gnk = w_gnk[None], s_gnk[None]
    g, n, k = w_gnk.shape
    if k % (splits * SCALE_BLOCK):
        raise ValueError(f"K={k} does not split into {splits} pieces of whole {SCALE_BLOCK}-column scale blocks")
    w = w_gnk.reshape(g, n, splits, k // splits).transpose(0, 2, 1, 3).reshape(g * splits, n, k // splits)
    kb = k // SCALE_BLOCK // splits
    s = s_gnk.reshape(g, s_gnk.shape[1], splits, kb).transpose(0, 2, 1, 3).reshape(g * splits, -1, kb)
    return DenseFp8Weights(w, kernel_scales(s, WeightFormat.FP8, n), g, splits)


def dequantized(p: DenseFp8Weights, dtype=jnp.bfloat16) -> jax.Array:
    """The linears' exact dequantized weights [G, N, K] (E4M3 x 2^e is exact in bf16)."""
    from pallas_kernels.grouped_gemm.reference import dequant_fp8

    g, n, k = p.shape
    w = dequant_fp8(p.weight, checkpoint_scales(p.scale_kn, WeightFormat.FP8)).astype(dtype)   # [G*S, N, K/S]
    return w.reshape(g, p.splits, n, k // p.splits).transpose(0, 2, 1, 3).reshape(g, n, k)


def static_plan(groups: int, rows_per_group: int, block_m: int) -> TilePlan:
    """The tile plan of ``groups`` groups of rows_per_group rows each, laid out group after group (all
    constants: no routing), and one tile of group -1 after them, which the kernel skips: without it the
    tile -> group list of a one-tile-a-group plan is an iota, which XLA:GPU rebuilt with a kernel of its
    own before every call (3 launches a layer of the decode step, deviceless H200 compile, session 28);
    with it the list stays a constant buffer. Callers give the kernel one more tile of rows."""
    t = groups * rows_per_group // block_m
    z = np.zeros((0,), np.int32)
    tile_group = np.repeat(np.arange(groups, dtype=np.int32), rows_per_group // block_m)
    return TilePlan(row_src=jnp.asarray(np.arange((t + 1) * block_m, dtype=np.int32)),
                    tile_group=jnp.asarray(np.append(tile_group, np.int32(-1))),
                    dest_m=jnp.asarray(z), valid_m=jnp.asarray(z.astype(bool)), sorted_pos=jnp.asarray(z),
                    sorted_m=jnp.asarray(z))


def dense_config(m: int, fp8_operands: str, *, block_n: int = DENSE_BLOCK_N, block_k: int = DENSE_BLOCK_K,
                 a_from_registers: bool = True, pdl: bool = False) -> GroupedMatmulConfig:
    """The kernel config of the dense form at M rows: 64-row tiles above 32 rows, else the next
    multiple of 8 from 16 (fewer padded rows at small decode batches); float32 outputs. pdl:
    ``GroupedMatmulConfig.pdl``."""
    block_m = 64 if m > 32 else max(16, -(-m // 8) * 8)
    cfg = GroupedMatmulConfig(block_m=block_m, block_n=block_n, block_k=block_k, stages=4, persistent=False,
                              a_from_registers=a_from_registers, fp8_operands=fp8_operands, pdl=pdl)
    return fit_stages(cfg, WeightFormat.FP8, jnp.float32)


def unsupported_reason_for(n: int, k: int, splits: int, *, block_n: int = DENSE_BLOCK_N,
                           block_k: int = DENSE_BLOCK_K) -> str | None:
    """Why a [N, K] linear split ``splits``-fold cannot take the dense form's tiles (None: it can)."""
    if n % block_n:
        return f"N={n} is not a multiple of {block_n}"
    if k % (splits * block_k):
        return f"K={k} does not split into {splits} pieces of whole {block_k}-column steps"
    return None


def unsupported_reason(p: DenseFp8Weights, cfg: GroupedMatmulConfig) -> str | None:
    """Why the kernel cannot run these weights with this config, or None."""
    _, n, k = p.shape
    return kernel_unsupported_reason(n, k // p.splits, WeightFormat.FP8, cfg, jnp.float32)


def _split_rows(a_mgk: jax.Array, splits: int, mp: int, extra_rows: int) -> jax.Array:
    """[M, G, C] -> [G*S*Mp + extra_rows, C/S]: piece s of group g's columns for every row, rows padded
    to Mp, then ``extra_rows`` zero rows (``static_plan``'s skipped tile)."""
    m, g, c = a_mgk.shape
    a = a_mgk.reshape(m, g, splits, c // splits).transpose(1, 2, 0, 3)
    a = jnp.pad(a, ((0, 0), (0, 0), (0, mp - m), (0, 0))).reshape(g * splits * mp, c // splits)
    return jnp.pad(a, ((0, extra_rows), (0, 0)))


@functools.partial(jax.jit, static_argnames=("config",))
def dense_fp8_matmul(x_mgk: jax.Array | E4m3Rows, p: DenseFp8Weights, *, config: GroupedMatmulConfig) -> jax.Array:
    """x [M, G, K] -> float32 [M, G, N]: row m of group g times linear g's weights, float32 sums.

    With ``config.fp8_operands == "e4m3"`` x enters the FP8 wgmmas as E4M3 values with power-of-two
    scales per 32 columns: pass ``E4m3Rows`` (values [M, G, K], scale [M, G, K/32]; the model's
    ``linear.act_quant_rows``), or bf16 rows that are FP8-representable per 32 columns (the activation
    quantizer's output), re-expressed exactly by ``e4m3_rows``. Otherwise the kernel dequantizes the
    weights to bf16 and x is bf16."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_tiles

    e4m3 = uses_e4m3_rows(config, WeightFormat.FP8)
    m, g, k = x_mgk.shape
    if (g, k) != (p.groups, p.shape[2]):
        raise ValueError(f"x [M, G, K] = {tuple(x_mgk.shape)} does not match the weights' (G, K) = "
                         f"{(p.groups, p.shape[2])}")
    if isinstance(x_mgk, E4m3Rows) and not e4m3:
        raise ValueError("E4m3Rows x needs a config with fp8_operands='e4m3'")
    s, bm = p.splits, config.block_m
    mp = -(-m // bm) * bm
    if isinstance(x_mgk, E4m3Rows):
        x = E4m3Rows(_split_rows(x_mgk.values, s, mp, bm), _split_rows(x_mgk.scale, s, mp, bm))
    else:
        x = _split_rows(x_mgk.astype(jnp.bfloat16), s, mp, bm)
        x = e4m3_rows(x) if e4m3 else x
    y = grouped_matmul_tiles(static_plan(g * s, mp, bm), x, p.weight, p.scale_kn, out_dtype=jnp.float32,
                             config=config, scales_prepared=True)[:g * s * mp].reshape(g, s, mp, -1)
    acc = y[:, 0]
    for i in range(1, s):          # a fixed order, so fixed bits
        acc = acc + y[:, i]
    return acc[:, :m].transpose(1, 0, 2)
