"""The oracle for ``topk_indices``: an explicit two-key sort on (score descending, index ascending)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def canonical_scores(scores: jax.Array) -> jax.Array:
    """float32 scores with -0.0 folded into +0.0 (they tie) and NaN treated as unreachable (-inf)."""
    s = scores.astype(jnp.float32)
    s = jnp.where(s == 0, jnp.float32(0), s)
    return jnp.where(jnp.isnan(s), -jnp.inf, s)


def ascending_with_unreachable_last(vals: jax.Array, idx: jax.Array) -> jax.Array:
    """Picked indices re-sorted ascending; picks whose score is -inf become -1 and go last."""
    big = jnp.iinfo(jnp.int32).max
    keyed = jnp.sort(jnp.where(vals > -jnp.inf, idx.astype(jnp.int32), big), axis=-1)
    return jnp.where(keyed == big, -1, keyed).astype(jnp.int32)


def pad_to_k(idx: jax.Array, k: int) -> jax.Array:
    """Right-pad with -1 up to k columns (k larger than the number of positions)."""
    short = k - idx.shape[-1]
    if short <= 0:
        return idx
    return jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, short)], constant_values=-1)


def topk_indices_reference(scores_bts: jax.Array, k: int, *, width: int | None = None,
                           may_branch: bool = False) -> jax.Array:
    """-> idx_btk int32. Same contract as ``pallas_kernels.topk.topk_indices`` (one sort: never branches)."""
    s = canonical_scores(scores_bts[..., :width])
    n = s.shape[-1]
    kk = min(k, n)
    iota = lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1)
    neg = jnp.where(s == 0, jnp.float32(0), -s)  # keep the folded zeros a single key value
    neg_sorted, idx_sorted = lax.sort((neg, iota), dimension=s.ndim - 1, num_keys=2)
    vals = -neg_sorted[..., :kk]
    return pad_to_k(ascending_with_unreachable_last(vals, idx_sorted[..., :kk]), k)
