"""Host-side (numpy) codecs for the checkpoint's stored formats (spec §5.4).

* FP8-E4M3 weights with one E8M0 scale per BxB block (B = 32 for V4.1, 128 for V4);
* packed FP4-E2M1 experts: I8 [out, in/2], element 2k in the low nibble, 2k+1 in the high nibble, one
  E8M0 scale per 1x32 along K;
* E8M0 scale byte b = 2^(b - 127); b = 255 is NaN and propagates.
The in-graph (jnp) dequantizers used by the model live in ``deepinfer_jax.model.linear``.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP4_BLOCK = 32
FP4_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def e8m0_to_f32(scale_bytes: np.ndarray) -> np.ndarray:
    b = np.asarray(scale_bytes).view(np.uint8).astype(np.int32)
    out = np.ldexp(np.float32(1.0), np.minimum(b, 254) - 127).astype(np.float32)
    return np.where(b == 255, np.float32(np.nan), out)


def dequant_fp8_block(w: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """[out, in] e4m3 with [ceil(out/B), ceil(in/B)] E8M0 -> fp32."""
    out_dim, in_dim = w.shape
    s = e8m0_to_f32(scale)
    s = np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:out_dim, :in_dim]
    return np.asarray(w).view(E4M3).astype(np.float32) * s


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    p = np.asarray(packed).view(np.uint8)
    vals = np.stack([FP4_VALUES[p & 0x0F], FP4_VALUES[p >> 4]], axis=-1)
    return vals.reshape(*p.shape[:-1], p.shape[-1] * 2)


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[..., out, in/2] packed E2M1 with [..., out, in/32] E8M0 -> fp32."""
    w = unpack_fp4(packed)
    s = np.repeat(e8m0_to_f32(scale), FP4_BLOCK, axis=-1)[..., : w.shape[-1]]
    return w * s


def _pow2_ceil(x: np.ndarray) -> np.ndarray:
    m, e = np.frexp(x.astype(np.float32))
    return np.ldexp(np.float32(1.0), np.where(m == 0.5, e - 1, e)).astype(np.float32)


def quantize_fp8_block(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [out, in] -> (e4m3 [out, in], E8M0 [ceil(out/B), ceil(in/B)]); scale 2^ceil(log2(amax/448))."""
    out_dim, in_dim = w.shape
    bo, bi = math.ceil(out_dim / block), math.ceil(in_dim / block)
    padded = np.zeros((bo * block, bi * block), np.float32)
    padded[:out_dim, :in_dim] = w
    blocks = padded.reshape(bo, block, bi, block)
    amax = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-4)
    s = _pow2_ceil(amax / 448.0)
    q = np.clip(blocks / s[:, None, :, None], -448, 448).reshape(bo * block, bi * block)[:out_dim, :in_dim]
    return q.astype(E4M3), s.astype(E8M0)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [..., out, in] -> (packed uint8 [..., out, in/2], E8M0 [..., out, in/32]); scale 2^ceil(log2(amax/6))."""
    *lead, in_dim = w.shape
    if in_dim % FP4_BLOCK:
        raise ValueError(f"FP4 needs the input dim to be a multiple of {FP4_BLOCK}, got {in_dim}")
    blocks = w.astype(np.float32).reshape(*lead, in_dim // FP4_BLOCK, FP4_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1), 6.0 * 2.0 ** -126)
    s = _pow2_ceil(amax / 6.0)
    q = np.clip(blocks / s[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    mag = np.searchsorted(FP4_VALUES[:8], np.abs(q)).astype(np.uint8)
    codes = (mag | (np.signbit(q).astype(np.uint8) << 3)).reshape(*lead, in_dim // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8), s.astype(E8M0)
