"""Grouped (ragged) matmul for MoE experts.

The op::

    grouped_matmul(x_mk, w, group_ids_m, w_scale=None) -> y_mn

* ``x_mk`` bf16 [M, K]: one row per (token, expert) pair.
* ``group_ids_m`` int [M]: the expert of each row, **in any order** (the implementations sort
  internally with a stable sort). Ids outside [0, G) give a zero row, which is how an
  expert-parallel shard skips the pairs routed to other shards' experts.
* ``w`` per-expert weights, told apart by dtype:
  - bf16 [G, N, K] with ``w_scale=None``;
  - float8_e4m3fn [G, N, K] with E8M0 32x32 block scales ``w_scale`` [G, N/32, K/32];
  - packed FP4 uint8 [G, N, K/2] with E8M0 1x32 scales ``w_scale`` [G, N, K/32]: byte j of a row
    holds element 2j in the low nibble and 2j+1 in the high nibble, nibble codes
    [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6].
  E8M0 scales are uint8 or float8_e8m0fnu bytes b meaning 2^(b-127).
* ``y_mn`` [M, N] (bf16 by default, ``out_dtype=float32`` allowed) = x_mk[m] . dequant(w)[g_m]^T with
  the weights dequantized exactly to bf16 and float32 accumulation.

Batch invariance: every implementation computes a row from that row, its expert and the (fixed)
config only: fixed-size tiles holding one expert each, a fixed K order, no split-K. So a row's bits do
not depend on M, on the other rows or on the group sizes.

Implementations (same signature), chosen by ``pallas_kernels.registry``:

* ``kernel.grouped_matmul_pallas`` — Mosaic GPU kernel for Hopper (CUDA, compute capability 9.x).
* ``xla.grouped_matmul_xla`` — sort + fixed-size-tile loop; any platform (CPU, unknown plugins).
* ``reference.grouped_matmul_reference`` — float32 HIGHEST oracle; tests only (never auto-picked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.grouped_gemm.config import GroupedMatmulConfig, WeightFormat, check_inputs
from pallas_kernels.grouped_gemm.reference import grouped_matmul_reference
from pallas_kernels.grouped_gemm.scales import check_prepared, checkpoint_scales, kernel_scales
from pallas_kernels.grouped_gemm.xla import grouped_matmul_xla

__all__ = ["GroupedMatmulConfig", "WeightFormat", "check_inputs", "checkpoint_scales", "grouped_matmul",
           "grouped_matmul_pallas", "grouped_matmul_reference", "grouped_matmul_xla", "kernel_scales"]


def grouped_matmul_pallas(*args, **kwargs):
    """Lazy import: Mosaic GPU is only loaded when the kernel is asked for."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas as impl

    return impl(*args, **kwargs)


def grouped_matmul(x_mk: jax.Array, w: jax.Array, group_ids_m: jax.Array, w_scale: jax.Array | None = None, *,
                   out_dtype=jnp.bfloat16, impl: str | None = None,
                   selection: registry.KernelSelection | None = None,
                   config: GroupedMatmulConfig = GroupedMatmulConfig(), scales_prepared: bool = False) -> jax.Array:
    """The op (see module docstring), on the implementation the registry picks for x's platform.

    impl: force ``"pallas_mosaic_gpu"``, ``"xla"`` or ``"reference"`` (an error if it cannot run here).
    selection: a ``registry.KernelSelection``; None reads ``DEEPINFER_KERNELS`` (at trace time).
    config: the tile config. Every config gives the same row bits on the kernel (measured), so it is a
        speed choice (``config.tuned_config``); the XLA fallback's ``xla_block_m`` is fixed by default.
    scales_prepared: w_scale is in the kernel's layout uint8 [G, K/32, N] (``scales.kernel_scales``,
        done once at weight-load time); implementations other than the kernel convert it back."""
    if selection is None:
        selection = registry.KernelSelection.from_env()
    chosen = registry.resolve("grouped_matmul", impl=impl, selection=selection, device=registry.device_of(x_mk))
    if scales_prepared:
        if w_scale is None:
            raise ValueError("scales_prepared=True needs a w_scale in the kernel layout [G, K/32, N]")
        fmt = check_prepared(w, w_scale)
        if chosen.name == registry.PALLAS_MOSAIC_GPU:
            return chosen.load()(x_mk, w, group_ids_m, w_scale, out_dtype=out_dtype, config=config,
                                 scales_prepared=True)
        w_scale = checkpoint_scales(w_scale, fmt)
    check_inputs(x_mk, w, group_ids_m, w_scale)
    if chosen.name == registry.REFERENCE:
        return grouped_matmul_reference(x_mk, w, group_ids_m, w_scale, out_dtype=out_dtype)
    return chosen.load()(x_mk, w, group_ids_m, w_scale, out_dtype=out_dtype, config=config)
