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


# "auto" selects by bisection from this many scores per call (a 2048-token prefill chunk over 2048+
# index keys), and sorts below it: at decode (64-256 rows) a sort is one small launch, the bisection 32.
SELECT_MIN_SCORES = 1 << 22


def topk_positions(scores: jax.Array, k: int, method: str = "auto") -> jax.Array:
    """Indices of the k best reachable (> -inf, not NaN) entries, ascending; unreachable picks are -1 (last).

    The k best are the k largest, lower index first among equals (+0.0 and -0.0 are equal). method:
    "select" finds each row's k-th largest value by bisection on order-preserving integer keys and keeps
    what is above it, plus the lowest-index ties, already in index order: 32 counting passes and two
    prefix sums over the row. "sort" is a stable sort of the whole row (the H200 prefill trace of
    2026-12-04: XLA's segmented radix sort of [2048, 8192] rows, ~3.5 ms per indexer layer and 2048-token
    chunk). "auto": "select" from ``SELECT_MIN_SCORES`` scores, else "sort". Both are exact functions of
    the row and give the same indices, so the choice by shape keeps results batch-invariant."""
    if method == "auto":
        method = "select" if scores.size >= SELECT_MIN_SCORES else "sort"
    if method == "sort":
        return _topk_positions_sorted(scores, k)
    if method != "select":
        raise ValueError(f"topk_positions: unknown method {method!r} (want 'auto', 'select' or 'sort')")
    k = min(k, scores.shape[-1])
    x = scores.astype(jnp.float32)
    key = jnp.where(jnp.isnan(x), jnp.uint32(0), order_key(jnp.where(x == 0, jnp.float32(0), x)))
    reachable = key > _NEG_INF_KEY
    need = jnp.int32(k)
    rows = key.reshape(-1, key.shape[-1])
    # t = the least key with fewer than k keys above it: the k-th largest key of the row.
    t = least_key(lambda t: jnp.sum(rows > t[:, None], axis=-1, dtype=jnp.int32) < need,
                  rows.shape[0]).reshape(*key.shape[:-1], 1)
    above = key > t
    tie = key == t
    room = need - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    keep = reachable & (above | (tie & (jnp.cumsum(tie, axis=-1, dtype=jnp.int32) <= room)))
    return true_columns(keep, k)


def _topk_positions_sorted(scores: jax.Array, k: int) -> jax.Array:
    k = min(k, scores.shape[-1])
    vals, idx = topk_desc(scores, k)
    big = jnp.iinfo(jnp.int32).max
    keyed = jnp.where(vals > -jnp.inf, idx, big)
    keyed = jnp.sort(keyed, axis=-1)
    return jnp.where(keyed == big, -1, keyed).astype(jnp.int32)


_NEG_INF_KEY = 0x007FFFFF   # order_key(-inf); topk_positions maps NaN below it


def order_key(x_v: jax.Array) -> jax.Array:
    """float32 -> uint32 whose unsigned order is the float order (-inf lowest; -0.0 folded into +0.0)."""
    bits = jax.lax.bitcast_convert_type(x_v + 0.0, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def least_key(holds, n_rows: int, n_steps: jax.Array | None = None) -> jax.Array:
    """uint32[B]: per row, the smallest t with holds(t) (holds: uint32[B] -> bool[B], monotone false ...
    true and true at 2**32 - 1), by bisection: 32 steps, each one masked pass over the rows. n_steps is
    32, or 0 to skip the search when no row needs it (the results are then unused); None runs the 32
    steps unrolled, with no loop at all (the GPU form: there, each while iteration's predicate is a
    device-to-host round trip that also stops the host from queueing the next step)."""

    def step(state):
        i, lo, hi = state
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return i + 1, jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    start = (jnp.int32(0), jnp.zeros(n_rows, jnp.uint32), jnp.full(n_rows, 0xFFFFFFFF, jnp.uint32))
    if n_steps is None:
        return jax.lax.fori_loop(0, 32, lambda _, s: step(s), start, unroll=True)[2]
    return jax.lax.while_loop(lambda s: s[0] < n_steps, step, start)[2]


def true_columns(mask: jax.Array, width: int) -> jax.Array:
    """mask [..., K] -> [..., width] int32: the True columns of each row in column order, then -1.
    Columns past ``width`` True ones are dropped. Row-local, so batch-invariant."""
    *lead, k = mask.shape
    m = mask.reshape(-1, k)
    cols = jax.lax.broadcasted_iota(jnp.int32, m.shape, 1)
    # the rest go past the end (dropped), each to its own slot, so every index is unique
    slot = jnp.where(m, jnp.cumsum(m, axis=-1, dtype=jnp.int32) - 1, width + cols)
    rows = jnp.arange(m.shape[0], dtype=jnp.int32)[:, None]
    out = jnp.full((m.shape[0], width), -1, jnp.int32).at[rows, slot].set(cols, mode="drop", unique_indices=True)
    return out.reshape(*lead, width)
