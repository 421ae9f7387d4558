"""The oracle for ``index_scores``: float32 HIGHEST einsums (tests only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def index_scores_reference(q_bthd: jax.Array, k_bsd: jax.Array, w_bth: jax.Array,
                           n_visible_bt: jax.Array | None = None) -> jax.Array:
    hi = jax.lax.Precision.HIGHEST
    dots = jnp.einsum("bthd,bsd->bths", q_bthd.astype(jnp.float32), k_bsd.astype(jnp.float32), precision=hi)
    scores = jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w_bth.astype(jnp.float32), precision=hi)
    if n_visible_bt is None:
        return scores
    keys = jnp.arange(scores.shape[-1])
    return jnp.where(keys < jnp.asarray(n_visible_bt)[..., None], scores, -jnp.inf)
