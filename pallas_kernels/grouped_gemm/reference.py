"""The oracle for ``grouped_matmul``: dequantize every expert, then one float32 dot per row.

Slow and memory-hungry (it materialises each row's dequantized expert), exact in its definition:
tests only. The dequantizers here are also the definition of the stored formats that the XLA path
and the kernel must agree with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCALE_BLOCK = 32  # elements per E8M0 scale along K (both formats) and along N (FP8 only)

# E2M1 nibble -> value; index = the 4-bit code (bit 3 is the sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_to_f32(scale_u8: jax.Array) -> jax.Array:
    """E8M0 byte b -> 2^(b-127) in float32 (b = 0xFF -> NaN); uint8 or float8_e8m0fnu input."""
    if scale_u8.dtype == jnp.float8_e8m0fnu:
        return scale_u8.astype(jnp.float32)
    b = scale_u8.astype(jnp.float32)
    return jnp.where(b == 255, jnp.nan, jnp.exp2(b - 127.0))


def dequant_fp8(w_gnk: jax.Array, scale_gnk: jax.Array) -> jax.Array:
    """e4m3 [..., N, K] with E8M0 [..., N/32, K/32] 32x32 block scales -> float32 [..., N, K]."""
    s = e8m0_to_f32(scale_gnk)
    s = jnp.repeat(jnp.repeat(s, SCALE_BLOCK, axis=-2), SCALE_BLOCK, axis=-1)
    return w_gnk.astype(jnp.float32) * s


def unpack_fp4(w_packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> float32 [..., K]: byte k holds element 2k (low nibble) and 2k+1 (high)."""
    table = jnp.asarray(FP4_VALUES, jnp.float32)
    lo = table[(w_packed & 0x0F).astype(jnp.int32)]
    hi = table[(w_packed >> 4).astype(jnp.int32)]
    return jnp.stack([lo, hi], axis=-1).reshape(*w_packed.shape[:-1], w_packed.shape[-1] * 2)


def dequant_fp4(w_packed: jax.Array, scale_gnk: jax.Array) -> jax.Array:
    """packed E2M1 uint8 [..., N, K/2] with E8M0 [..., N, K/32] 1x32 scales -> float32 [..., N, K]."""
    return unpack_fp4(w_packed) * jnp.repeat(e8m0_to_f32(scale_gnk), SCALE_BLOCK, axis=-1)


def dequantize(w: jax.Array, w_scale: jax.Array | None) -> jax.Array:
    """Any supported expert-weight format -> float32 [..., N, K] (format told apart by dtype)."""
    if w_scale is None:
        return w.astype(jnp.float32)
    if w.dtype == jnp.uint8:
        return dequant_fp4(w, w_scale)
    return dequant_fp8(w, w_scale)


def grouped_matmul_reference(x_mk: jax.Array, w: jax.Array, group_ids_m: jax.Array,
                             w_scale: jax.Array | None = None, *, out_dtype=jnp.float32) -> jax.Array:
    """-> y_mn = x_mk[m] . dequant(w)[group_ids_m[m]]^T in float32 (HIGHEST precision).

    Rows whose group id is outside [0, G) give 0, like every implementation."""
    g = w.shape[0]
    valid = (group_ids_m >= 0) & (group_ids_m < g)
    w_mnk = dequantize(w[jnp.clip(group_ids_m, 0, g - 1)], None if w_scale is None
                       else w_scale[jnp.clip(group_ids_m, 0, g - 1)])
    y = jnp.einsum("mk,mnk->mn", x_mk.astype(jnp.float32), w_mnk, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(valid[:, None], y, 0.0).astype(out_dtype)
