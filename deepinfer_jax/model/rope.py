"""Partial interleaved RoPE on the last ``rope_dim`` dims, with DeepSeek-YaRN on compressed layers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import RopeSpec


def rope_inv_freq(spec: RopeSpec, rope_dim: int) -> np.ndarray:
    """float64[rope_dim/2]; YaRN ramps pairs between the beta_fast and beta_slow boundaries to f/factor."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    freq = spec.theta ** (-2.0 * i / rope_dim)
    if spec.yarn_factor == 1.0:
        return freq

    def boundary(beta: float) -> float:
        return rope_dim * math.log(spec.yarn_original_len / (beta * 2 * math.pi)) / (2 * math.log(spec.theta))

    low = max(math.floor(boundary(spec.yarn_beta_fast)), 0)
    high = min(math.ceil(boundary(spec.yarn_beta_slow)), rope_dim - 1)
    ramp = np.clip((i - low) / max(high - low, 1e-3), 0.0, 1.0)
    return freq * (1 - ramp) + freq / spec.yarn_factor * ramp


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, inverse: bool = False,
               join: str = "select") -> jax.Array:
    """Rotate adjacent pairs of x[..., -rope_dim:] by position * inv_freq.

    x: [..., T, (heads,) dim] with positions broadcastable to x.shape[:-1] after adding the heads axis by
    the caller. Math in fp32, result in x.dtype.

    The rotated columns are padded back to full width and selected by column, not concatenated to the
    untouched ones: XLA:GPU kept a concatenate's operands as kernels of their own when x came from
    another fusion (the decode step's attention output: two slices and a concatenate, three launches a
    layer where one does; deviceless H200 compile). Same values: the select copies x's columns exactly.
    join="concatenate" keeps the concatenate, for a consumer XLA fuses with it but not with the select
    (the FP4 attention kernel's column permutation of q). join="update" writes the rotated columns into
    x with a dynamic-update-slice, which XLA does in place: for a large x that is materialized anyway
    (a prefill chunk's q and attention output, 537 MB each at 8,192 tokens) it moves the rope columns
    (1/8 of the bytes) instead of rewriting the whole array (deviceless H200 compile: a slice kernel and
    an in-place update kernel, no copy added).
    """
    rope_dim = 2 * inv_freq.shape[0]
    nope = x.shape[-1] - rope_dim
    rot = x[..., nope:].astype(jnp.float32)
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    a, b = rot[..., 0::2], rot[..., 1::2]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape).astype(x.dtype)
    if nope == 0:
        return out
    if join == "concatenate":
        return jnp.concatenate([x[..., :nope], out], axis=-1)
    if join == "update":
        return jax.lax.dynamic_update_slice(x, out, (0,) * (x.ndim - 1) + (nope,))
    out = jnp.pad(out, [(0, 0)] * (x.ndim - 1) + [(nope, 0)])
    is_rope = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) >= nope
    return jnp.where(is_rope, out, x)
