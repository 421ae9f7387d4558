"""Cache storage codecs: the KV caches at deployment precision (spec §2.9-2.10, §4) or in BF16.

A ``Layout`` says how one cache tensor's entries are stored when quantized. Per entry:
* V4.1 (§4.1; head_dim 512, index_head_dim 128):
  window ring: FP8-E4M3 values + one E8M0 (power-of-two) scale per 32 values    -> 512 + 16 = 528 B
  compressed KV: packed FP4-E2M1 + one E4M3 scale per 16 values                  -> 256 + 32 = 288 B
  index-K: packed FP4-E2M1 + one E8M0 scale per 32 values                        ->  64 +  4 =  68 B
* V4-Flash (§4.2, FlashMLA's "MODEL1" layout): window ring and compressed KV alike hold the 448 non-RoPE
  dims in FP8 with one E8M0 scale per 64, the 64 RoPE dims unquantized (BF16), and the 7 scales padded
  to 8 bytes -> 448 + 128 + 8 = 584 B; index-K as V4.1's, 68 B.
The quantizers are the reference's fake-quantizers, so with ``Numerics.fake_quant`` on, a quantized
cache decodes to exactly the values a BF16 cache would hold (both are exact in BF16): the choice
changes memory, never results. Scales are per entry, never per batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepinfer_jax.model.numerics import (FP4_MAX, FP8_MAX, block_amax, fp4_e4m3_scale, fp4_pow2_scale, fp8_scale,
                                         round_to_e2m1)
from deepinfer_jax.model.v4_quant import kv_block

_E2M1 = jnp.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one cache tensor's entries are stored at deployment precision.

    Storage leaves: ``values`` (FP8 [..., q] or packed FP4 [..., q/2], q = the quantized dims), ``scale``
    [..., q/block rounded up to a multiple of scale_align], and with rope_tail > 0 ``rope`` [..., rope_tail]
    in the activation dtype. Unquantized storage is ``values`` [..., dim] in the activation dtype alone."""

    values: str  # "fp8" (E4M3) or "fp4" (E2M1, two per byte)
    block: int  # values per scale
    scale: str  # "e8m0" (power of two) or "e4m3"
    rope_tail: int = 0  # the last dims, kept unquantized (V4: the RoPE dims)
    scale_align: int = 1  # scale bytes per entry padded to a multiple of this (V4: 7 scales + 1 pad byte)

    def n_scales(self, dim: int) -> int:
        return (dim - self.rope_tail) // self.block

    def n_scale_slots(self, dim: int) -> int:
        return -(-self.n_scales(dim) // self.scale_align) * self.scale_align


WINDOW = Layout("fp8", 32, "e8m0")
COMPRESSED = Layout("fp4", 16, "e4m3")
INDEX_K = Layout("fp4", 32, "e8m0")


def v4_kv_layout(head_dim: int, rope_dim: int) -> Layout:
    """V4-Flash's window and compressed KV (``v4_quant.fake_quant_kv_v4`` stores exactly into it)."""
    return Layout("fp8", kv_block(head_dim - rope_dim), "e8m0", rope_tail=rope_dim, scale_align=8)


class CacheLayouts(NamedTuple):
    window: Layout
    compressed: Layout
    index_k: Layout


def layouts(cfg) -> CacheLayouts:
    """The layouts of a config's caches (cfg: a ``ModelConfig``)."""
    if cfg.variant == "v4":
        kv = v4_kv_layout(cfg.head_dim, cfg.qk_rope_head_dim)
        return CacheLayouts(kv, kv, INDEX_K)
    return CacheLayouts(WINDOW, COMPRESSED, INDEX_K)


def _scale_dtype(layout: Layout):
    return jnp.float8_e8m0fnu if layout.scale == "e8m0" else jnp.float8_e4m3fn


def stored_shapes(layout: Layout, lead: tuple[int, ...], dim: int, quantized: bool, act_dtype) -> dict:
    """ShapeDtypeStructs of one cache tensor's storage (the leaves of ``Layout``'s docstring)."""
    if not quantized:
        return {"values": jax.ShapeDtypeStruct((*lead, dim), act_dtype)}
    q = dim - layout.rope_tail
    if layout.values == "fp8":
        values = jax.ShapeDtypeStruct((*lead, q), jnp.float8_e4m3fn)
    else:
        values = jax.ShapeDtypeStruct((*lead, q // 2), jnp.uint8)
    out = {"values": values,
           "scale": jax.ShapeDtypeStruct((*lead, layout.n_scale_slots(dim)), _scale_dtype(layout))}
    if layout.rope_tail:
        out["rope"] = jax.ShapeDtypeStruct((*lead, layout.rope_tail), act_dtype)
    return out


def _fp4_codes(q: jax.Array) -> jax.Array:
    """Values already on the E2M1 grid -> 4-bit codes (sign in bit 3), as uint8."""
    mag = jnp.abs(q)
    idx = jnp.searchsorted(_E2M1[:8], mag, method="compare_all").astype(jnp.uint8)   # no while loop
    return idx | (jnp.signbit(q).astype(jnp.uint8) << 3)


def _pad_scales(layout: Layout, s: jax.Array, dim: int) -> jax.Array:
    """s [..., n_scales] -> [..., n_scale_slots]; the pad slots hold 1.0 (finite in E8M0 and E4M3)."""
    pad = layout.n_scale_slots(dim) - s.shape[-1]
    return jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)], constant_values=1.0) if pad else s


def encode(layout: Layout, x: jax.Array, quantized: bool, act_dtype) -> dict:
    """x [..., dim] -> storage dict. Quantizes exactly like the fake-quantizers of ``numerics``."""
    if not quantized:
        return {"values": x.astype(act_dtype)}
    *lead, dim = x.shape
    out = {}
    if layout.rope_tail:
        x, out["rope"] = x[..., :-layout.rope_tail], x[..., -layout.rope_tail:].astype(act_dtype)
    q = x.shape[-1]
    block = layout.block
    xb = x.astype(jnp.float32).reshape(*lead, q // block, block)
    amax = block_amax(xb)
    if layout.values == "fp8":
        s = fp8_scale(amax)
        out["values"] = jnp.clip(xb / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).reshape(*lead, q)
    else:
        # (an E4M3 scale is rounded onto the E4M3 grid first, so its float32 value is stored exactly)
        s = fp4_pow2_scale(amax) if layout.scale == "e8m0" else fp4_e4m3_scale(amax)
        v = round_to_e2m1(jnp.clip(xb / s, -FP4_MAX, FP4_MAX))
        codes = _fp4_codes(v).reshape(*lead, q // 2, 2)
        out["values"] = codes[..., 0] | (codes[..., 1] << 4)
    out["scale"] = _pad_scales(layout, s[..., 0], dim).astype(_scale_dtype(layout))
    return out


def decode(layout: Layout, stored: dict, act_dtype) -> jax.Array:
    values = stored["values"]
    if "scale" not in stored:
        return values.astype(act_dtype)
    if layout.values == "fp8":
        v = values.astype(jnp.float32)
    else:
        lo = _E2M1[(values & 0x0F).astype(jnp.int32)]
        hi = _E2M1[(values >> 4).astype(jnp.int32)]
        v = jnp.stack([lo, hi], axis=-1).reshape(*values.shape[:-1], values.shape[-1] * 2)
    *lead, q = v.shape
    n = q // layout.block
    s = stored["scale"][..., :n].astype(jnp.float32)
    v = (v.reshape(*lead, n, layout.block) * s[..., None]).reshape(*lead, q).astype(act_dtype)
    if layout.rope_tail:
        v = jnp.concatenate([v, stored["rope"].astype(act_dtype)], axis=-1)
    return v


def scatter(stored: dict, rows_b1: jax.Array, idx_bt: jax.Array, new: dict, unique: bool = False) -> dict:
    """stored[b, idx[b, t]] = new[b, t] for every leaf (out-of-range indices are dropped).

    unique: the caller promises that no two (b, idx[b, t]) are equal, the dropped ones included (give
    each its own out-of-range index), so XLA may write the rows in parallel (``unique_indices``)."""
    return {k: stored[k].at[rows_b1, idx_bt].set(new[k], mode="drop", unique_indices=unique) for k in stored}


def gather(stored: dict, rows: jax.Array, idx: jax.Array) -> dict:
    return {k: v[rows, idx] for k, v in stored.items()}
