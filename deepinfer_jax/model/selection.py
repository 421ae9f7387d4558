"""Deterministic top-k used by the router, the indexer and the candidate pool.

Ties go to the lower index, so a selection is a function of the row's scores alone: a stable sort on
descending score (``-inf`` entries sort last and come back as -1 where they were picked).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_desc(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices) of the k largest along the last axis, lower index first among equals."""
    order = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(scores, order, axis=-1), order.astype(jnp.int32)


def topk_positions(scores: jax.Array, k: int) -> jax.Array:
    """Indices of the k best reachable (> -inf) entries, re-sorted ascending; unreachable picks are -1 (last)."""
    k = min(k, scores.shape[-1])
    vals, idx = topk_desc(scores, k)
    big = jnp.iinfo(jnp.int32).max
    keyed = jnp.where(vals > -jnp.inf, idx, big)
    keyed = jnp.sort(keyed, axis=-1)
    return jnp.where(keyed == big, -1, keyed).astype(jnp.int32)
