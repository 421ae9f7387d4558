"""The oracle for ``index_scores``: float32 HIGHEST einsums (tests only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def index_scores_reference(q_bthd: jax.Array, k_bsd: jax.Array, w_bth: jax.Array) -> jax.Array:
    hi = jax.lax.Precision.HIGHEST
    dots = jnp.einsum("bthd,bsd->bths", q_bthd.astype(jnp.float32), k_bsd.astype(jnp.float32), precision=hi)
    return jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w_bth.astype(jnp.float32), precision=hi)
