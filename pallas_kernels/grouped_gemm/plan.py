"""Tile plan: which padded row each token row goes to, and which group each fixed-size tile belongs to.

Rows are stably sorted by group id; each group's rows are padded up to a multiple of ``block_m``, so
every tile of ``block_m`` padded rows holds rows of exactly one group (no tile straddles two groups,
and no group is special-cased by its size). The metadata is plain XLA: O(M log M + G) work, no
Python loop over groups, computed once per step and shared by every layer that uses the same routing.

Shapes are static: ``max_tiles(M, G, block_m)`` bounds the number of non-empty tiles for any routing,
and tiles past the used ones carry group -1 (the consumers skip them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


def max_tiles(m: int, num_groups: int, block_m: int) -> int:
    """Upper bound on sum_g ceil(rows_g / block_m) over every split of m rows into num_groups groups.

    With k non-empty groups the sum is at most k + (m - k) // block_m, largest at k = min(G, m)."""
    if m <= 0:
        return 0
    k = min(num_groups, m)
    return k + (m - k) // block_m


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """row_src [T*bm] int32: the token row held by each padded row (M = padding, reads as zeros).
    tile_group [T] int32: the group of each tile, -1 for unused tiles.
    dest_m [M] int32: the padded row of each token row (0 for rows with an out-of-range group).
    valid_m [M] bool: the row's group id is in [0, G).
    sorted_pos [M] int32: the padded row of the i-th row in group order (the valid rows, then 0s).
    sorted_m [M] int32: each token row's index i in that order (the order ``kernel._unpermute`` compacts
    y^T's columns in)."""

    row_src: jax.Array
    tile_group: jax.Array
    dest_m: jax.Array
    valid_m: jax.Array
    sorted_pos: jax.Array
    sorted_m: jax.Array


def bucketed_tiles(m: int, num_groups: int, block_m: int) -> int:
    """max_tiles rounded up to a power of two (at least 8): the kernel's grid, so that nearby M share
    one compiled kernel. Tiles past the used ones exit at once."""
    t = max_tiles(m, num_groups, block_m)
    return max(8, 1 << (t - 1).bit_length()) if t else 0


def make_tile_plan(group_ids_m: jax.Array, num_groups: int, block_m: int, num_tiles: int | None = None) -> TilePlan:
    """Plan for token rows routed to ``group_ids_m`` (any order; ids outside [0, G) are dropped).

    num_tiles: the static tile count (>= max_tiles); default max_tiles."""
    m = group_ids_m.shape[0]
    t = max_tiles(m, num_groups, block_m)
    if num_tiles is not None:
        if num_tiles < t:
            raise ValueError(f"num_tiles={num_tiles} is below the {t} tiles {m} rows may need")
        t = num_tiles
    gid = group_ids_m.astype(jnp.int32)
    valid = (gid >= 0) & (gid < num_groups)
    key = jnp.where(valid, gid, num_groups)                       # invalid rows sort last
    if m <= COMPARE_PLAN_ROWS:
        return _plan_by_compares(key, valid, num_groups, block_m, t)
    return _plan_by_sort(key, valid, num_groups, block_m, t)


def _plan_by_sort(key: jax.Array, valid: jax.Array, num_groups: int, block_m: int, t: int) -> TilePlan:
    """The plan from a stable sort of the rows by group and scatters: O(M log M + G) work."""
    m = key.shape[0]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sorted_key = key[order]
    counts = jnp.zeros((num_groups + 1,), jnp.int32).at[key].add(1)[:num_groups]
    tiles = (counts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles, dtype=jnp.int32)
    row_end = jnp.cumsum(counts, dtype=jnp.int32)
    g_sorted = jnp.minimum(sorted_key, num_groups - 1)
    rank = jnp.arange(m, dtype=jnp.int32) - (row_end - counts)[g_sorted]
    pos = (tile_end - tiles)[g_sorted] * block_m + rank
    sorted_valid = sorted_key < num_groups
    pos = jnp.where(sorted_valid, pos, t * block_m)               # out of range: dropped below
    row_src = jnp.full((t * block_m,), m, jnp.int32).at[pos].set(order, mode="drop")
    sorted_pos = jnp.where(sorted_valid, pos, 0)
    dest = jnp.zeros((m,), jnp.int32).at[order].set(sorted_pos)
    sorted_m = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    return TilePlan(row_src=row_src, tile_group=_tile_groups(tile_end, t), dest_m=dest, valid_m=valid,
                    sorted_pos=sorted_pos, sorted_m=sorted_m)


def _tile_groups(tile_end: jax.Array, t: int) -> jax.Array:
    """Group of each tile: how many groups end at or before it (searchsorted, side="right"), as one
    reduction of T x G compares. jnp.searchsorted's "scan" method is a while loop of log2(G) launches
    per plan (108 tiny kernels per 12-layer decode step on the H200 profile); its "compare_all" wrote
    the [T, G] compares out, then summed them (two launches)."""
    tile_ids = jnp.arange(t, dtype=jnp.int32)
    tile_group = jnp.sum(tile_end[None, :] <= tile_ids[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(tile_ids < tile_end[-1], tile_group, -1)


# Up to this many rows the plan is built from all-pairs compares (M x M, T*block_m x M) instead of a sort
# and scatters: the same plan with no sort, scatter or in-place copy, which at decode (384 routed rows)
# were ~13 launches of a few microseconds each per MoE layer. 1024 rows: at most ~4M compares per pass.
COMPARE_PLAN_ROWS = 1024


def _plan_by_compares(key: jax.Array, valid: jax.Array, num_groups: int, block_m: int, t: int) -> TilePlan:
    """``make_tile_plan`` for small M, every field the same: each row's place in the stable group order
    is (rows of lower groups) + (earlier rows of its own group), counted by compares; each padded row's
    source is the one row placed there."""
    m = key.shape[0]
    rows = jnp.arange(m, dtype=jnp.int32)
    counts_all = jnp.sum(key[None, :] == jnp.arange(num_groups + 1, dtype=jnp.int32)[:, None], axis=1,
                         dtype=jnp.int32)                          # [G+1], the invalid rows last
    rank = jnp.sum((key[None, :] == key[:, None]) & (rows[None, :] < rows[:, None]), axis=1, dtype=jnp.int32)
    counts = counts_all[:num_groups]
    tiles = (counts + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles, dtype=jnp.int32)
    sorted_m = (jnp.cumsum(counts_all, dtype=jnp.int32) - counts_all)[key] + rank
    g = jnp.minimum(key, num_groups - 1)
    dest = jnp.where(valid, (tile_end - tiles)[g] * block_m + rank, 0)
    sorted_pos = jnp.sum(jnp.where(sorted_m[None, :] == rows[:, None], dest[None, :], 0), axis=1, dtype=jnp.int32)
    padded = jnp.arange(t * block_m, dtype=jnp.int32)
    row_src = jnp.min(jnp.where(valid[None, :] & (dest[None, :] == padded[:, None]), rows[None, :], m), axis=1)
    return TilePlan(row_src=row_src, tile_group=_tile_groups(tile_end, t), dest_m=dest, valid_m=valid,
                    sorted_pos=sorted_pos, sorted_m=sorted_m)


def take_rows(a_rc: jax.Array, src_p: jax.Array) -> jax.Array:
    """a_rc [R, C] -> [P, C]: row ``src_p[i]`` of a_rc for each i, a zero row where src_p[i] is out of
    range; the same bits as ``jnp.take(a_rc, src_p, axis=0, mode="fill", fill_value=0)``.

    Why not that take: in the H200 decode step (session 24 timeline) XLA fused the rows' producers (the
    FP4 K permutation, the E4M3 quantizer, the repeat over an MoE's top-k) into its gather, so each of
    the P padded rows recomputed them, one byte a thread: the x gather [3072, 5120] E4M3 took ~20 us a
    layer, 0.8 TB/s of writes. Here the R source rows (the token or routed rows, up to ~8x fewer than P
    at decode) are materialized first, and the gather moves 32-bit words when a row is a whole number
    of them."""
    r, c = a_rc.shape
    per_word = 4 // a_rc.dtype.itemsize if a_rc.dtype.itemsize < 4 else 0
    if not per_word or c % per_word:
        return jnp.take(materialized(a_rc), src_p, axis=0, mode="fill", fill_value=0)
    words = lax.bitcast_convert_type(a_rc.reshape(r, c // per_word, per_word), jnp.uint32)
    out = jnp.take(materialized(words), src_p, axis=0, mode="fill", fill_value=0)    # zero words: zero values
    return lax.bitcast_convert_type(out, a_rc.dtype).reshape(src_p.shape[0], c)


def materialized(a: jax.Array) -> jax.Array:
    """a, computed as an array of its own (not fused into its consumer) in its row-major order. The
    barrier is on the flat array: on a 2-D one layout assignment may give it a transposed layout and
    fuse the transpose into the consumer again (seen in XLA:CPU's HLO)."""
    return lax.optimization_barrier(a.reshape(-1)).reshape(a.shape)


def scatter_back(y_pn: jax.Array, plan: TilePlan, out_dtype) -> jax.Array:
    """Padded results [T*bm, N] -> [M, N] in the caller's row order; out-of-range rows are 0."""
    y = jnp.take(y_pn, plan.dest_m, axis=0)
    return jnp.where(plan.valid_m[:, None], y, jnp.zeros((), y.dtype)).astype(out_dtype)
