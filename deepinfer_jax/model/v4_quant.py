"""V4-Flash's KV fake-quantization site (spec §3.2, current revision §3.9): unlike V4.1 (all 512 dims,
FP8 per 32), V4 rounds only the non-RoPE dims to FP8-E4M3 with one power-of-two scale per 64 values and
keeps the RoPE tail in BF16. Used for the window KV and the compressed KV of both compressor kinds;
``kv_codec.v4_kv_layout`` stores exactly these values."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.numerics import fake_quant_fp8, fit_block

KV_FP8_BLOCK = 64


def kv_block(nope_dim: int) -> int:
    """Values per FP8 scale over the non-RoPE dims (64; one block for tiny configs, numerics.fit_block)."""
    return fit_block(nope_dim, KV_FP8_BLOCK)


def fake_quant_kv_v4(x: jax.Array, rope_dim: int) -> jax.Array:
    """x [..., head_dim]: FP8 (block 64) on x[..., :-rope_dim], the last rope_dim dims unchanged."""
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    return jnp.concatenate([fake_quant_fp8(nope, kv_block(nope.shape[-1])), rope], axis=-1)
