"""Codecs for the checkpoint's stored formats (spec §5.4, quantizers of §2.10).

* FP8-E4M3 weights [out, in] with one E8M0 scale per BxB block, scale [ceil(out/B), ceil(in/B)]
  (B = 32 for V4.1, 128 for V4; edge blocks may be partial);
* packed FP4-E2M1 experts: I8 [out, in/2], element 2k in the low nibble and 2k+1 in the high nibble,
  one E8M0 scale per 1x32 along K, scale [out, in/32];
* E8M0 scale byte b means 2^(b - 127); b = 255 is NaN and propagates; b = 0 is 2^-127.

Host (numpy) decoders and the encoders used by the tiny-checkpoint generator come first; the jnp
decoders (``*_jnp``) are for jitted model code and accept any leading dims (stacked experts
[E, out, in/2]). Both give bitwise-equal results wherever the result is a normal fp32 number; XLA
flushes subnormal fp32 results to zero, which only scale bytes below ~10 could produce (real scales
are ~2^-15..2^-3).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP4_BLOCK = 32  # FP4 scales cover 1x32 along K, whatever the FP8 block size is
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4  # as the reference quantizer: keeps all-zero blocks at a finite scale
FP4_AMAX_FLOOR = 6.0 * 2.0**-126

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# nibble -> E2M1 value; bit 3 is the sign
FP4_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ----------------------------------------------------------------------------------------------------
# numpy decoders

def e4m3_to_f32(w) -> np.ndarray:
    """E4M3 bytes (uint8 or float8_e4m3fn, any shape) -> fp32. 0x7F/0xFF are NaN."""
    return np.asarray(w).view(E4M3).astype(np.float32)


def e8m0_to_f32(scale) -> np.ndarray:
    """E8M0 scale bytes (uint8 or float8_e8m0fnu) -> 2^(b-127) in fp32; 255 -> NaN."""
    b = np.asarray(scale).view(np.uint8).astype(np.int32)
    out = np.ldexp(np.float32(1.0), np.minimum(b, 254) - 127).astype(np.float32)
    return np.where(b == 255, np.float32(np.nan), out)


def unpack_fp4(packed) -> np.ndarray:
    """[..., n/2] packed bytes -> [..., n] fp32 E2M1 values (element 2k from the low nibble of byte k)."""
    p = np.asarray(packed).view(np.uint8)
    vals = np.stack([FP4_VALUES[p & 0x0F], FP4_VALUES[p >> 4]], axis=-1)
    return vals.reshape(*p.shape[:-1], p.shape[-1] * 2)


def _check_fp8_scale(w_shape, scale_shape, block: int) -> None:
    want = (*w_shape[:-2], math.ceil(w_shape[-2] / block), math.ceil(w_shape[-1] / block))
    if tuple(scale_shape) != want:
        raise ValueError(f"FP8 weight {list(w_shape)} with {block}x{block} blocks needs scale {list(want)}, "
                         f"got {list(scale_shape)}")


def _check_fp4_scale(w_shape, scale_shape) -> None:
    want = (*w_shape[:-1], math.ceil(2 * w_shape[-1] / FP4_BLOCK))
    if tuple(scale_shape) != want:
        raise ValueError(f"packed FP4 weight {list(w_shape)} needs scale {list(want)}, got {list(scale_shape)}")


def dequant_fp8_block(w_f8, scale_e8m0, block: int) -> np.ndarray:
    """[..., out, in] e4m3 with [..., ceil(out/B), ceil(in/B)] E8M0 -> fp32 (W[i,k] = w[i,k]·s[i//B, k//B])."""
    w_f8, scale_e8m0 = np.asarray(w_f8), np.asarray(scale_e8m0)
    _check_fp8_scale(w_f8.shape, scale_e8m0.shape, block)
    out_dim, in_dim = w_f8.shape[-2:]
    s = np.repeat(np.repeat(e8m0_to_f32(scale_e8m0), block, axis=-2), block, axis=-1)[..., :out_dim, :in_dim]
    return e4m3_to_f32(w_f8) * s


def dequant_fp4(w_u8, scale_e8m0) -> np.ndarray:
    """[..., out, in/2] packed E2M1 with [..., out, in/32] E8M0 -> fp32 [..., out, in]."""
    w_u8, scale_e8m0 = np.asarray(w_u8), np.asarray(scale_e8m0)
    _check_fp4_scale(w_u8.shape, scale_e8m0.shape)
    w = unpack_fp4(w_u8)
    return w * np.repeat(e8m0_to_f32(scale_e8m0), FP4_BLOCK, axis=-1)[..., : w.shape[-1]]


# ----------------------------------------------------------------------------------------------------
# jnp decoders (inside jit; same semantics as the numpy ones)

_FP4_VALUES_LIST = FP4_VALUES.tolist()


def e8m0_to_f32_jnp(scale_e8m0: jax.Array) -> jax.Array:
    """float8_e8m0fnu or uint8 scale bytes -> fp32 (the E8M0 cast is exact: 2^(b-127), 255 -> NaN)."""
    if scale_e8m0.dtype == jnp.uint8:
        scale_e8m0 = jax.lax.bitcast_convert_type(scale_e8m0, jnp.float8_e8m0fnu)
    return scale_e8m0.astype(jnp.float32)


def dequant_fp8_block_jnp(w_f8: jax.Array, scale_e8m0: jax.Array, block: int) -> jax.Array:
    """[..., out, in] float8_e4m3fn with [..., ceil(out/B), ceil(in/B)] E8M0 -> fp32."""
    _check_fp8_scale(w_f8.shape, scale_e8m0.shape, block)
    if w_f8.dtype == jnp.uint8:
        w_f8 = jax.lax.bitcast_convert_type(w_f8, jnp.float8_e4m3fn)
    out_dim, in_dim = w_f8.shape[-2:]
    s = e8m0_to_f32_jnp(scale_e8m0)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :out_dim, :in_dim]
    return w_f8.astype(jnp.float32) * s


def dequant_fp4_jnp(w_u8: jax.Array, scale_e8m0: jax.Array) -> jax.Array:
    """[..., out, in/2] packed E2M1 (uint8) with [..., out, in/32] E8M0 -> fp32 [..., out, in]."""
    _check_fp4_scale(w_u8.shape, scale_e8m0.shape)
    table = jnp.asarray(_FP4_VALUES_LIST, jnp.float32)
    w_u8 = w_u8.astype(jnp.uint8)
    lo = table[(w_u8 & 0x0F).astype(jnp.int32)]
    hi = table[(w_u8 >> 4).astype(jnp.int32)]
    w = jnp.stack([lo, hi], axis=-1).reshape(*w_u8.shape[:-1], w_u8.shape[-1] * 2)
    s = jnp.repeat(e8m0_to_f32_jnp(scale_e8m0), FP4_BLOCK, axis=-1)[..., : w.shape[-1]]
    return w * s


# ----------------------------------------------------------------------------------------------------
# numpy encoders (the tiny-checkpoint generator; spec §2.10 scale rules)

def pow2_ceil(x: np.ndarray) -> np.ndarray:
    """2^ceil(log2(x)) for positive fp32 x, exactly (from the frexp exponent, as the reference uses bits)."""
    mant, exp = np.frexp(np.asarray(x, np.float32))
    return np.ldexp(np.float32(1.0), np.where(mant == 0.5, exp - 1, exp)).astype(np.float32)


def f32_to_e4m3(x) -> np.ndarray:
    """fp32 -> e4m3 with round-to-nearest-even, saturating at ±448 (no inf in e4m3fn)."""
    return np.clip(np.asarray(x, np.float32), -FP8_MAX, FP8_MAX).astype(E4M3)


def quantize_fp8_block(w_f32: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [out, in] -> (e4m3 [out, in], E8M0 [ceil(out/B), ceil(in/B)]); scale 2^ceil(log2(amax·(1/448))).

    Partial edge blocks take their amax over the real elements only (zero padding cannot raise it).
    """
    w = np.asarray(w_f32, np.float32)
    out_dim, in_dim = w.shape
    bo, bi = math.ceil(out_dim / block), math.ceil(in_dim / block)
    padded = np.zeros((bo * block, bi * block), np.float32)
    padded[:out_dim, :in_dim] = w
    blocks = padded.reshape(bo, block, bi, block)
    amax = np.maximum(np.abs(blocks).max(axis=(1, 3)), np.float32(FP8_AMAX_FLOOR))
    s = pow2_ceil(amax * np.float32(1.0 / FP8_MAX))  # the reference multiplies by the fp32 reciprocal
    q = (blocks / s[:, None, :, None]).reshape(bo * block, bi * block)[:out_dim, :in_dim]
    return f32_to_e4m3(q), s.astype(E8M0)


def quantize_fp4(w_f32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [..., out, in] -> (packed uint8 [..., out, in/2], E8M0 [..., out, in/32]).

    Per 1x32 block along K: scale 2^ceil(log2(amax/6)), values rounded to nearest-even on the E2M1 grid.
    """
    w = np.asarray(w_f32, np.float32)
    *lead, in_dim = w.shape
    if in_dim % FP4_BLOCK:
        raise ValueError(f"FP4 needs the input dim to be a multiple of {FP4_BLOCK}, got {in_dim}")
    blocks = w.reshape(*lead, in_dim // FP4_BLOCK, FP4_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1), np.float32(FP4_AMAX_FLOOR))
    s = pow2_ceil(amax * np.float32(1.0 / FP4_MAX))
    q = np.clip(blocks / s[..., None], -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn)
    codes = q.view(np.uint8).reshape(*lead, in_dim // 2, 2)  # ml_dtypes keeps the E2M1 code in the low nibble
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8), s.astype(E8M0)
