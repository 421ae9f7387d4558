"""The oracle for ``sparse_sink_attention``: a plain gather + einsum in float32 at HIGHEST precision.

Slow and memory-hungry on purpose (it materialises every selected row in float32); use it in tests only.
The op is defined in ``pallas_kernels.attention`` (see ``__init__``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def sparse_sink_attention_reference(q_bthd: jax.Array, kv_bsd: jax.Array, idx_btk: jax.Array, sink_h: jax.Array,
                                    scale: float) -> jax.Array:
    """-> o_bthd float32. Same contract as ``pallas_kernels.attention.sparse_sink_attention``."""
    qf = q_bthd.astype(jnp.float32)
    kvf = kv_bsd.astype(jnp.float32)
    valid_btk = idx_btk >= 0
    rows_btkd = jnp.take_along_axis(kvf[:, None], jnp.maximum(idx_btk, 0)[..., None], axis=2)  # [B, T, K, D]
    z_bthk = jnp.einsum("bthd,btkd->bthk", qf, rows_btkd, precision=_HI) * scale
    z_bthk = jnp.where(valid_btk[:, :, None, :], z_bthk, -jnp.inf)
    sink = sink_h.astype(jnp.float32)[None, None, :]
    m_bth = jnp.maximum(jnp.max(z_bthk, axis=-1), sink)
    e_bthk = jnp.exp(z_bthk - m_bth[..., None])
    denom_bth = jnp.sum(e_bthk, axis=-1) + jnp.exp(sink - m_bth)
    return jnp.einsum("bthk,btkd->bthd", e_bthk, rows_btkd, precision=_HI) / denom_bth[..., None]


def sparse_sink_attention_fp4_reference(q_bthd: jax.Array, win_kv_bsd: jax.Array, win_idx_btk: jax.Array,
                                        comp_values_bnc: jax.Array, comp_scale_bng: jax.Array,
                                        comp_idx_btk: jax.Array, sink_h: jax.Array, scale: float) -> jax.Array:
    """-> o_bthd float32; ``sparse_sink_attention_fp4``'s contract, by the float32 oracle above."""
    from pallas_kernels.attention.xla import two_source_rows

    b, t, h, d = q_bthd.shape
    kv, idx = two_source_rows(win_kv_bsd, win_idx_btk, comp_values_bnc, comp_scale_bng, comp_idx_btk, jnp.float32)
    return sparse_sink_attention_reference(q_bthd.reshape(b * t, 1, h, d), kv, idx, sink_h, scale).reshape(b, t, h, d)
