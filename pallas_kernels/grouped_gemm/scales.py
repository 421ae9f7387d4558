"""E8M0 weight scales in the checkpoint's layout and in the kernel's (one byte per weight row and K block).

The Mosaic GPU kernel reads scales as uint8 [G, K/32, N] so that one TMA box covers a tile's
block_n rows for each 32-wide K block. The checkpoint stores FP4 scales as [G, N, K/32] and FP8 scales
as [G, N/32, K/32]. Converting per call is one pass over the scales every step (measured on the H200
at batch 64: ~5 ms of a 38 ms 12-layer decode step); doing it once when the weights are loaded
(``deepinfer_jax.model.moe.prepare_expert_scales``) removes that pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.grouped_gemm.config import WeightFormat
from pallas_kernels.grouped_gemm.reference import SCALE_BLOCK


def kernel_scales(w_scale: jax.Array, fmt: WeightFormat, n: int) -> jax.Array:
    """Checkpoint scales -> the kernel's layout uint8 [G, K/32, N].

    FP4 [G, N, K/32] is transposed; FP8 [G, N/32, K/32] is repeated over the 32 rows of each block."""
    s = lax.bitcast_convert_type(w_scale, jnp.uint8) if w_scale.dtype == jnp.float8_e8m0fnu else w_scale
    if fmt is WeightFormat.FP8:
        s = jnp.repeat(s, SCALE_BLOCK, axis=1)[:, :n]
    return jnp.swapaxes(s, 1, 2)


def checkpoint_scales(s_kn: jax.Array, fmt: WeightFormat) -> jax.Array:
    """The inverse of ``kernel_scales``: uint8 [G, K/32, N] -> float8_e8m0fnu (the checkpoint's dtype)
    FP4 [G, N, K/32] or FP8 [G, ceil(N/32), K/32]."""
    s = jnp.swapaxes(s_kn, 1, 2)
    s = s[:, ::SCALE_BLOCK] if fmt is WeightFormat.FP8 else s
    return lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)


def prepared_format(w: jax.Array) -> WeightFormat:
    """The format of quantized weights whose scales are in the kernel layout (told apart by dtype)."""
    if w.dtype == jnp.uint8:
        return WeightFormat.FP4
    if w.dtype == jnp.float8_e4m3fn:
        return WeightFormat.FP8
    raise ValueError(f"kernel-layout scales need uint8 (packed FP4) or float8_e4m3fn weights, got {w.dtype}")


def check_prepared(w: jax.Array, s_kn: jax.Array) -> WeightFormat:
    """Shape/dtype check of kernel-layout scales for weights w -> the weight format."""
    fmt = prepared_format(w)
    g, n, kw = w.shape
    k = kw * 2 if fmt is WeightFormat.FP4 else kw
    if tuple(s_kn.shape) != (g, k // SCALE_BLOCK, n) or s_kn.dtype != jnp.uint8:
        raise ValueError(f"kernel-layout scales for {fmt.value} weights {tuple(w.shape)} must be uint8 "
                         f"[G, K/32, N] = {(g, k // SCALE_BLOCK, n)}, got {s_kn.dtype} {tuple(s_kn.shape)}")
    return fmt
