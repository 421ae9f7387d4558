"""V4-Flash's final stream collapse (``hc_head_*``, spec §3.5): a learned, Sinkhorn-free pre-mix.

pre[c] = sigmoid(m[c] * scale + base[c]) + hc_eps with m = (fn . f) * rsqrt(mean(f^2) + eps) over the
flattened 4-stream state f (stream-major, as the per-layer mixes); h = sum_c pre[c] X_c. V4.1 has no such
parameters: its final collapse reuses the last block's FFN pre (transformer.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.mhc import stream_dot


def hc_head_pre(x_bthd: jax.Array, fn_hk: jax.Array, base_h: jax.Array, scale_1: jax.Array, *, norm_eps: float,
                hc_eps: float, bf16_dot: bool = False, fn_parts: jax.Array | None = None) -> jax.Array:
    """-> pre [B, T, hc] fp32 from the stream x [B, T, hc, D]; fn [hc, hc*D], base [hc], scale [1].
    bf16_dot: ``mhc.stream_dot``'s bf16 form; fn_parts: its split of fn [3 * hc, hc*D] made ahead."""
    b, t, hc, d = x_bthd.shape
    f = x_bthd.astype(jnp.float32).reshape(b, t, hc * d)
    m = stream_dot(x_bthd.reshape(b, t, hc * d), fn_hk, bf16_dot, fn_parts)
    m = m * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + norm_eps)
    return jax.nn.sigmoid(m * scale_1.astype(jnp.float32)[0] + base_h.astype(jnp.float32)) + hc_eps
