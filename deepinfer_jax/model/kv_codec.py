"""Cache storage codecs: the KV caches at deployment precision (spec §2.9-2.10, §4.1) or in BF16.

Deployment layout per entry (head_dim 512, index_head_dim 128):
* window ring: FP8-E4M3 values + one E8M0 (power-of-two) scale per 32 values   -> 512 + 16 = 528 B
* compressed KV: packed FP4-E2M1 + one E4M3 scale per 16 values                 -> 256 + 32 = 288 B
* index-K: packed FP4-E2M1 + one E8M0 scale per 32 values                       ->  64 +  4 =  68 B
The quantizers are the reference's fake-quantizers, so with ``Numerics.fake_quant`` on, a quantized
cache decodes to exactly the values a BF16 cache would hold (both are exact in BF16): the choice
changes memory, never results. Scales are per entry, never per batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.numerics import FP4_MAX, FP8_MAX, fp4_e4m3_scale, fp4_pow2_scale, fp8_scale

_E2M1 = jnp.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)

WINDOW, COMPRESSED, INDEX_K = "window", "compressed", "index_k"
# kind -> (values per scale, scale kind)
_LAYOUT = {WINDOW: (32, "e8m0"), COMPRESSED: (16, "e4m3"), INDEX_K: (32, "e8m0")}
_VALUE_KIND = {WINDOW: "fp8", COMPRESSED: "fp4", INDEX_K: "fp4"}


def stored_shapes(kind: str, lead: tuple[int, ...], dim: int, quantized: bool, act_dtype) -> dict:
    """ShapeDtypeStructs of one cache tensor's storage (``values`` and, when quantized, ``scale``)."""
    if not quantized:
        return {"values": jax.ShapeDtypeStruct((*lead, dim), act_dtype)}
    block, skind = _LAYOUT[kind]
    if _VALUE_KIND[kind] == "fp8":
        values = jax.ShapeDtypeStruct((*lead, dim), jnp.float8_e4m3fn)
    else:
        values = jax.ShapeDtypeStruct((*lead, dim // 2), jnp.uint8)
    sdt = jnp.float8_e8m0fnu if skind == "e8m0" else jnp.float8_e4m3fn
    return {"values": values, "scale": jax.ShapeDtypeStruct((*lead, dim // block), sdt)}


def _fp4_codes(q: jax.Array) -> jax.Array:
    """Values already on the E2M1 grid -> 4-bit codes (sign in bit 3), as uint8."""
    mag = jnp.abs(q)
    idx = jnp.searchsorted(_E2M1[:8], mag).astype(jnp.uint8)
    return idx | (jnp.signbit(q).astype(jnp.uint8) << 3)


def encode(kind: str, x: jax.Array, quantized: bool, act_dtype) -> dict:
    """x [..., dim] -> storage dict. Quantizes exactly like the fake-quantizers of ``numerics``."""
    if not quantized:
        return {"values": x.astype(act_dtype)}
    block, skind = _LAYOUT[kind]
    *lead, dim = x.shape
    xb = x.astype(jnp.float32).reshape(*lead, dim // block, block)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    if _VALUE_KIND[kind] == "fp8":
        s = fp8_scale(amax)
        q = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).reshape(*lead, dim)
        return {"values": q, "scale": s[..., 0].astype(jnp.float8_e8m0fnu)}
    if skind == "e8m0":
        s = fp4_pow2_scale(amax)
        s_stored = s.astype(jnp.float8_e8m0fnu)
    else:
        s_stored = fp4_e4m3_scale(amax)
        s = s_stored.astype(jnp.float32)
    q = jnp.clip(xb / s, -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn).astype(jnp.float32)
    codes = _fp4_codes(q).reshape(*lead, dim // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return {"values": packed, "scale": s_stored[..., 0]}


def decode(kind: str, stored: dict, act_dtype) -> jax.Array:
    values = stored["values"]
    if "scale" not in stored:
        return values.astype(act_dtype)
    block, _ = _LAYOUT[kind]
    s = stored["scale"].astype(jnp.float32)
    if _VALUE_KIND[kind] == "fp8":
        v = values.astype(jnp.float32)
    else:
        lo = _E2M1[(values & 0x0F).astype(jnp.int32)]
        hi = _E2M1[(values >> 4).astype(jnp.int32)]
        v = jnp.stack([lo, hi], axis=-1).reshape(*values.shape[:-1], values.shape[-1] * 2)
    *lead, dim = v.shape
    v = v.reshape(*lead, dim // block, block) * s[..., None]
    return v.reshape(*lead, dim).astype(act_dtype)


def scatter(stored: dict, rows_b1: jax.Array, idx_bt: jax.Array, new: dict) -> dict:
    """stored[b, idx[b, t]] = new[b, t] for every leaf (out-of-range indices are dropped)."""
    return {k: stored[k].at[rows_b1, idx_bt].set(new[k], mode="drop") for k in stored}


def gather(stored: dict, rows: jax.Array, idx: jax.Array) -> dict:
    return {k: v[rows, idx] for k, v in stored.items()}
