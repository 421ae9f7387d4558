"""Exact top-k by bisection on order-preserving integer keys (``topk_indices_xla(method="select")``).

A row's k-th largest value is found by counting passes over uint32 keys whose unsigned order is the
float order, ``BITS_PER_PASS`` bits of it a pass; what is above it, plus the lowest-index ties, is
already in index order. No sort. ``order_key`` is shared with the sampler's top-k/top-p thresholds and
``true_columns`` with the window's mask compaction.

Long rows select on a short candidate list (``select_on_candidates``): the blocks of ``PREFILTER_BLOCK``
keys whose maximum reaches the k-th largest block maximum hold every key the row's top-k can contain,
and there are about k of them. The passes and the prefix sums then read ~k * block keys a row instead
of S, plus 8 passes over the top halves of the S / block maxima. When some row's block maxima tie too
often for the list, the whole call selects on whole rows (``lax.cond``). Either way the picks are the
same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF_KEY = 0x007FFFFF   # order_key(-inf); select_topk maps NaN below it

# 16 passes of 3 counts instead of 32 of one: on the H200 (``benchmarks/topk_gpu.py``, 2026-12-04,
# session 12; [2048, S] rows, k = 512, the whole top-k) at S = 16392: 2.11 ms one bit a pass, 1.59 ms
# two, 1.96 ms four, 2.98 ms for the stable sort; at S = 4104 and 8200 two bits was the fastest too.
BITS_PER_PASS = 2

# The prefilter's block (keys whose maximum one block-max stands for) and its candidate list: room for
# k + k / PREFILTER_SLACK_DIV blocks (ties at the k-th block maximum beyond that fall back). Used from
# PREFILTER_MIN_RATIO x the list's keys a row. Why: the deviceless H200 HLO of a chunk-16384 prefill has
# a ratio-1 indexer's 16 passes reading 35 GB a layer-chunk ([16384, 32784] uint32 keys each pass),
# ~70 % of its top-k's bytes; with blocks of 8 the passes read k * 8 * 1.25 keys a row, plus the maxima's
# top halves (1/16 of the keys' bytes) in half as many passes.
PREFILTER_BLOCK = 8
PREFILTER_SLACK_DIV = 4
PREFILTER_MIN_RATIO = 2


def select_topk(scores: jax.Array, k: int, *, bits_per_pass: int = BITS_PER_PASS,
                width: int | None = None, prefilter: bool = True) -> jax.Array:
    """[..., S] -> [..., k] int32 (k <= width): the k best reachable entries among the first ``width``
    (default S) in index order, then -1. Same picks as ``pallas_kernels.topk.topk_indices``; 32 /
    bits_per_pass counting passes and two prefix sums a row (on the candidate list where ``prefilter``
    allows it and ``prefilter_capacity`` gives one; the list puts a ``lax.cond`` in the program).
    Reading the first columns of the whole array (not a slice of it) lets every pass read them in
    place: a slice passed on would be written out first."""
    *lead, s = scores.shape
    width = s if width is None else width
    rows = scores.astype(jnp.float32).reshape(-1, s)
    capacity = prefilter_capacity(k, width) if prefilter else 0
    if capacity:
        picks = select_on_candidates(rows, k, PREFILTER_BLOCK, capacity, bits_per_pass, width)
    else:
        picks = select_rows(score_key(rows[:, :width]), k, bits_per_pass)
    return picks.reshape(*lead, k)


def score_key(x: jax.Array) -> jax.Array:
    """float32 scores -> ``order_key``, with NaN at key 0: below order_key(-inf), never picked."""
    return jnp.where(jnp.isnan(x), jnp.uint32(0), order_key(x))


def select_rows(key_rs: jax.Array, k: int, bits_per_pass: int = BITS_PER_PASS) -> jax.Array:
    """uint32 [R, S] -> [R, k] int32: the columns of each row's k largest keys above order_key(-inf)
    (lower column first among equals), ascending, then -1."""
    return true_columns(selected_keys(key_rs, k, bits_per_pass), k)


def selected_keys(key_rs: jax.Array, k: int, bits_per_pass: int = BITS_PER_PASS) -> jax.Array:
    """uint32 [R, S] -> bool [R, S]: ``select_rows``'s picks as a mask (each row's k largest keys above
    order_key(-inf), lower column first among equals)."""
    need = jnp.int32(k)
    t = least_key_below(key_rs, need, bits_per_pass)[:, None]   # the k-th largest key
    above = key_rs > t
    tie = key_rs == t
    room = need - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    return (key_rs > _NEG_INF_KEY) & (above | (tie & (jnp.cumsum(tie, axis=-1, dtype=jnp.int32) <= room)))


def top_mask(scores: jax.Array, k: int, bits_per_pass: int = BITS_PER_PASS) -> jax.Array:
    """float [..., S] -> bool [..., S]: the k largest scores above -inf of each row (lower index first
    among equals, -0.0 equal to +0.0, NaN never): the set a stable descending sort's first k give, less
    its -inf and NaN entries, without the sort or a scatter of its indices."""
    *lead, s = scores.shape
    keys = score_key(scores.astype(jnp.float32).reshape(-1, s))
    if k >= s:
        # every reachable score: the bisection's answer without its ~33 launches (a decode step's
        # candidate pool, 2,048 blocks of at most 520 at a 4k context, session 34 deviceless listing)
        return (keys > _NEG_INF_KEY).reshape(*lead, s)
    return selected_keys(keys, k, bits_per_pass).reshape(*lead, s)


def prefilter_capacity(k: int, s: int, block: int = PREFILTER_BLOCK) -> int:
    """Candidate blocks a row keeps in ``select_on_candidates`` for a top-k of S keys; 0: the row is
    too short for the prefilter to pay."""
    capacity = k + -(-k // PREFILTER_SLACK_DIV)
    return capacity if capacity * block * PREFILTER_MIN_RATIO <= s else 0


def select_on_candidates(x_rs: jax.Array, k: int, block: int, capacity: int,
                         bits_per_pass: int = BITS_PER_PASS, width: int | None = None) -> jax.Array:
    """float32 scores [R, S] -> ``select_rows(score_key(x_rs[:, :width]), k)``, bit for bit, from each
    row's candidate blocks (``candidate_blocks``) laid end to end: at most ``capacity`` blocks a row,
    else the whole call runs ``select_rows``. Keys are made where they are read (the block maxima, the
    gathered candidates), so no [R, S] key array is written.

    Why the picks are the same: let m be the k-th largest of a row's block maxima and t its k-th
    largest key. The k blocks at or above m each hold a key >= m, so t >= m, and every key >= t (the
    picks, the ties and the keys above) lies in a block whose maximum is >= m. Keys at or below
    order_key(-inf) are never picked, so when m is that low (fewer than k blocks hold a reachable key)
    the blocks that hold one suffice: they hold every reachable key. So the candidate blocks are those
    whose maximum is >= max(m, order_key(-inf) + 1), or >= any lower bound of m in its place (the list
    uses m with its low 16 bits cleared: cheaper to find); in ascending block order their keys keep the row's
    column order, so the lower-column-first tie rule and the ascending output carry over. Empty slots
    of the list hold key 0, which is never picked."""
    r, s = x_rs.shape
    width = s if width is None else width
    cand = candidate_blocks(x_rs[:, :width], k, block, bits_per_pass)
    overflow = jnp.any(jnp.sum(cand, axis=-1, dtype=jnp.int32) > capacity)

    def on_candidates(x_rs):
        ids = true_columns(cand, capacity)                                     # [R, capacity], -1 = none
        cols = (ids[..., None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(r, capacity * block)
        real = (cols >= 0) & (cols < width)                    # a list slot, not past the row's end
        x = jnp.take_along_axis(x_rs, jnp.where(real, cols, 0), axis=1)
        local = select_rows(jnp.where(real, score_key(x), jnp.uint32(0)), k, bits_per_pass)  # list positions
        return jnp.where(local >= 0, jnp.take_along_axis(cols, jnp.maximum(local, 0), axis=1), -1)

    return jax.lax.cond(overflow, lambda x_rs: select_rows(score_key(x_rs[:, :width]), k, bits_per_pass),
                        on_candidates, x_rs)


def candidate_blocks(x_rs: jax.Array, k: int, block: int, bits_per_pass: int = BITS_PER_PASS) -> jax.Array:
    """float32 scores [R, S] -> bool [R, ceil(S / block)]: the blocks whose maximum key (``score_key``;
    the last block padded with key 0, below every real key) is >= max(m16, order_key(-inf) + 1), where
    m16 is the k-th largest block maximum with its low 16 bits cleared (``select_on_candidates``)."""
    r, s = x_rs.shape
    nb = -(-s // block)
    blocks = jnp.pad(x_rs, ((0, 0), (0, nb * block - s)), constant_values=jnp.nan).reshape(r, nb, block)
    bmax = jnp.max(score_key(blocks), axis=-1)
    # m's top 16 bits, found on the maxima's top halves (half the passes, half the bytes): a lower bound
    # of m, so the blocks at or above it still hold every key >= m, plus those tied with m to 16 bits
    # (bf16 resolution). Keys above order_key(-inf) have top halves above its 0x007F, so the bound
    # keeps the unreachable blocks out whenever m does.
    m = least_key_below((bmax >> 16).astype(jnp.uint16), jnp.int32(k), bits_per_pass) << 16
    return bmax >= jnp.maximum(m, jnp.uint32(_NEG_INF_KEY + 1))[:, None]


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
    """key_rs uint32 (or uint16) [R, S] -> uint32 [R]: per row, the least t whose mass above it,
    sum(mass[key > t]), is below ``budget`` (scalar or [R]); mass is 1 per key when None (integer counts:
    with budget k, the k-th largest key when k <= S), else a non-negative [R, S] array.
    Each pass narrows t's range 2**bits_per_pass-fold: one variadic reduce sums the mass above every
    sub-range's top, so the row is read once a pass. The mass above t can only fall as t grows (with
    float masses too: zeroing a term of a fixed-order sum of non-negative terms cannot raise it), so
    every pass width finds the same t as a one-bit bisection that evaluates the same sums. uint16 keys
    take half the passes, each reading half the bytes."""
    if key_rs.dtype not in (jnp.uint16, jnp.uint32):
        raise ValueError(f"least_key_below takes uint16 or uint32 keys, got {key_rs.dtype}")
    key_bits = 8 * key_rs.dtype.itemsize
    if key_bits % bits_per_pass:
        raise ValueError(f"bits_per_pass={bits_per_pass} must divide the keys' {key_bits} bits")
    n = (1 << bits_per_pass) - 1
    budget = jnp.broadcast_to(jnp.asarray(budget), key_rs.shape[:1])
    wide = key_rs.astype(jnp.uint32)   # (read as stored: the convert fuses into each pass)
    if mass_rs is None:
        terms = lambda top: (wide > top[:, None]).astype(jnp.int32)                        # noqa: E731
    else:
        terms = lambda top: jnp.where(wide > top[:, None], mass_rs, jnp.zeros((), mass_rs.dtype))  # noqa: E731
    zero = jnp.zeros((), jnp.int32 if mass_rs is None else mass_rs.dtype)
    lo = jnp.zeros(key_rs.shape[0], jnp.uint32)   # t lies in [lo, lo + 2**(shift + bits_per_pass) - 1]
    for shift in range(key_bits - bits_per_pass, -1, -bits_per_pass):
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
