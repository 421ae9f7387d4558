"""Exact top-k by bisection on order-preserving integer keys (``topk_indices_xla(method="select")``).

A row's k-th largest value is found by counting passes over uint32 keys whose unsigned order is the
float order, ``BITS_PER_PASS`` bits of it a pass; what is above it, plus the lowest-index ties, is
already in index order. No sort. ``order_key`` is shared with the sampler's top-k/top-p thresholds and
``true_columns`` with the window's mask compaction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF_KEY = 0x007FFFFF   # order_key(-inf); select_topk maps NaN below it

# 16 passes of 3 counts instead of 32 of one: on the H200 (``benchmarks/topk_gpu.py``, 2026-12-04,
# session 12; [2048, S] rows, k = 512, the whole top-k) at S = 16392: 2.11 ms one bit a pass, 1.59 ms
# two, 1.96 ms four, 2.98 ms for the stable sort; at S = 4104 and 8200 two bits was the fastest too.
BITS_PER_PASS = 2


def select_topk(scores: jax.Array, k: int, *, bits_per_pass: int = BITS_PER_PASS) -> jax.Array:
    """[..., S] -> [..., k] int32 (k <= S): the k best reachable entries in index order, then -1.
    Same picks as ``pallas_kernels.topk.topk_indices``; 32 / bits_per_pass counting passes and two
    prefix sums a row."""
    x = scores.astype(jnp.float32)
    key = jnp.where(jnp.isnan(x), jnp.uint32(0), order_key(x))
    reachable = key > _NEG_INF_KEY
    need = jnp.int32(k)
    rows = key.reshape(-1, key.shape[-1])
    t = least_key_below(rows, need, bits_per_pass).reshape(*key.shape[:-1], 1)   # the k-th largest key
    above = key > t
    tie = key == t
    room = need - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    keep = reachable & (above | (tie & (jnp.cumsum(tie, axis=-1, dtype=jnp.int32) <= room)))
    return true_columns(keep, k)


def order_key(x_v: jax.Array, fold_signed_zeros: bool = True) -> jax.Array:
    """float32 -> uint32 whose unsigned order is the float order (-inf lowest; -0.0 folded into +0.0).
    fold_signed_zeros=False keeps -0.0 below +0.0: the total order ``lax.top_k`` ranks by (NaN above
    +inf either way)."""
    if fold_signed_zeros:   # (not x + 0.0: XLA's simplifier drops that add under jit, -0.0 and all)
        x_v = jnp.where(x_v == 0, jnp.zeros_like(x_v), x_v)
    bits = jax.lax.bitcast_convert_type(x_v, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def least_key_below(key_rs: jax.Array, budget: jax.Array, bits_per_pass: int,
                    mass_rs: jax.Array | None = None) -> jax.Array:
    """key_rs uint32 [R, S] -> uint32 [R]: per row, the least t whose mass above it, sum(mass[key > t]),
    is below ``budget`` (scalar or [R]); mass is 1 per key when None (integer counts: with budget k, the
    k-th largest key when k <= S), else a non-negative [R, S] array.
    Each pass narrows t's range 2**bits_per_pass-fold: one variadic reduce sums the mass above every
    sub-range's top, so the row is read once a pass. The mass above t can only fall as t grows (with
    float masses too: zeroing a term of a fixed-order sum of non-negative terms cannot raise it), so
    every pass width finds the same t as a one-bit bisection that evaluates the same sums."""
    if 32 % bits_per_pass:
        raise ValueError(f"bits_per_pass={bits_per_pass} must divide 32")
    n = (1 << bits_per_pass) - 1
    budget = jnp.broadcast_to(jnp.asarray(budget), key_rs.shape[:1])
    if mass_rs is None:
        terms = lambda top: (key_rs > top[:, None]).astype(jnp.int32)                      # noqa: E731
    else:
        terms = lambda top: jnp.where(key_rs > top[:, None], mass_rs, jnp.zeros((), mass_rs.dtype))  # noqa: E731
    zero = jnp.zeros((), jnp.int32 if mass_rs is None else mass_rs.dtype)
    lo = jnp.zeros(key_rs.shape[0], jnp.uint32)   # t lies in [lo, lo + 2**(shift + bits_per_pass) - 1]
    for shift in range(32 - bits_per_pass, -1, -bits_per_pass):
        tops = [lo + jnp.uint32(((j + 1) << shift) - 1) for j in range(n)]
        sums = jax.lax.reduce(tuple(terms(top) for top in tops), (zero,) * n,
                              lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))
        # the sub-ranges whose top still has the budget or more above it lie below t
        below = sum((c >= budget).astype(jnp.uint32) for c in sums)
        lo = lo + (below << shift)
    return lo


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
