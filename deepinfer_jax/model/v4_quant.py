"""V4-Flash's KV fake-quantization site (spec §3.2, current revision §3.9): unlike V4.1 (all 512 dims,
FP8 per 32), V4 rounds only the non-RoPE dims to FP8-E4M3 with one power-of-two scale per 64 values and
keeps the RoPE tail in BF16. Used for the window KV and the compressed KV of both compressor kinds."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.numerics import fake_quant_fp8

KV_FP8_BLOCK = 64


def fake_quant_kv_v4(x: jax.Array, rope_dim: int) -> jax.Array:
    """x [..., head_dim]: FP8 (block 64) on x[..., :-rope_dim], the last rope_dim dims unchanged."""
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    block = KV_FP8_BLOCK if nope.shape[-1] % KV_FP8_BLOCK == 0 else nope.shape[-1]  # tiny configs: one block
    return jnp.concatenate([fake_quant_fp8(nope, block), rope], axis=-1)
