"""Engram (device side): gather the hashed n-gram rows and inject them into the 4 streams with a gate.

The row ids are hashed on the host (``engram_hash``); here rows are dequantized on lookup, projected by
the FP8 ``wkv`` into 4 keys and one value, and each stream copy c gets ``x_c + g_c * value``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.linear import quant_linear
from deepinfer_jax.model.numerics import Numerics


def lookup(table: dict, rows_btc: jax.Array, dtype) -> jax.Array:
    """rows [B, T, C] -> u [B, T, C * head_dim]: FP8 rows times their per-32-column E8M0 scales."""
    w = table["weight"][rows_btc].astype(jnp.float32)  # [B, T, C, hd]
    if "scale" not in table:  # an unquantized table
        return w.reshape(*rows_btc.shape[:2], -1).astype(dtype)
    s = table["scale"][rows_btc].astype(jnp.float32)  # [B, T, C, hd/32]
    w = w * jnp.repeat(s, w.shape[-1] // s.shape[-1], axis=-1)
    return w.reshape(*rows_btc.shape[:2], -1).astype(dtype)


def inject(p: dict, x_bthd: jax.Array, rows_btc: jax.Array, *, eps: float, numerics: Numerics,
           act_block: int) -> jax.Array:
    b, t, hc, d = x_bthd.shape
    u = lookup(p["embed"], rows_btc, numerics.dtype)
    kv = quant_linear(u, p["wkv"], numerics, act_block=act_block).astype(jnp.float32).reshape(b, t, hc + 1, d)
    keys, val = kv[:, :, :hc], kv[:, :, hc]
    h = x_bthd.astype(jnp.float32)
    w = p["q_weight"].astype(jnp.float32) * p["k_weight"].astype(jnp.float32)  # [hc, D]
    dot = jnp.sum(h * w * keys, axis=-1)
    dot = dot * jax.lax.rsqrt(jnp.mean(h * h, axis=-1) + eps) * jax.lax.rsqrt(jnp.mean(keys * keys, axis=-1) + eps)
    dot = dot / jnp.sqrt(jnp.float32(d))
    gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
    return (h + gate[..., None] * val[:, :, None, :]).astype(numerics.dtype)
