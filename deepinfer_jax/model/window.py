"""The per-layer sliding-window ring: slot = position mod W, each slot remembering its position."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.topk.select import true_columns


def window_keys(win_kv_bwd: jax.Array, win_pos_bw: jax.Array, kv_btd: jax.Array, pos_bt: jax.Array,
                window: int) -> tuple[jax.Array, jax.Array]:
    """Keys for the chunk's queries: the ring as it was before this step, then the chunk's own rows.

    Returns (keys [B, W+T, D], mask [B, T, W+T]). Ring rows are only trusted below the chunk's first
    position: anything at or above it is stale (an earlier request in the slot) or re-computed here.
    """
    key_pos = jnp.concatenate([_trusted_ring_positions(win_pos_bw, pos_bt), pos_bt], axis=1)  # [B, W+T]
    q = pos_bt[:, :, None]
    k = key_pos[:, None, :]
    mask = (k >= 0) & (k <= q) & (k > q - window) & (q >= 0)
    return jnp.concatenate([win_kv_bwd, kv_btd.astype(win_kv_bwd.dtype)], axis=1), mask


def _trusted_ring_positions(win_pos_bw: jax.Array, pos_bt: jax.Array) -> jax.Array:
    """The ring slots' positions, -1 for the slots ``window_keys`` does not trust (empty, or at or above
    the chunk's first position)."""
    first = jnp.min(jnp.where(pos_bt >= 0, pos_bt, jnp.iinfo(jnp.int32).max), axis=1)  # [B]
    return jnp.where((win_pos_bw >= 0) & (win_pos_bw < first[:, None]), win_pos_bw, -1)


def chunk_window_index(win_pos_bw: jax.Array, pos_bt: jax.Array, window: int, width: int) -> jax.Array:
    """``window_index(window_keys(...)[1], width)`` without the [B, T, W+T] mask: each query's visible ring
    columns (a [B, T, W] mask, compacted), then its visible chunk columns, a contiguous range.

    Needs what ``window_update`` needs of a chunk: its valid rows (pos >= 0) are one run of consecutive
    positions (the engine's chunks: a prefix, then -1). Then chunk row c is visible to row t exactly for
    c in [max(first valid row, t - window + 1), t]. Same indices, so the same attention bits.

    Why: at a prefill chunk of T rows the mask and its compaction (a cumsum and a scatter over T x (W+T))
    took ~25 ms of the H200's 32k prefill at chunk 8192 (session 24 trace), for [T, <= W] of output."""
    t, w = pos_bt.shape[1], win_pos_bw.shape[1]
    q = pos_bt[:, :, None]
    ring_pos = _trusted_ring_positions(win_pos_bw, pos_bt)[:, None, :]
    ring_vis = (ring_pos >= 0) & (ring_pos > q - window) & (q >= 0)      # ring positions are all below q
    ring_cols = true_columns(ring_vis, width)                           # [B, T, width], -1 padded
    n_ring = jnp.sum(ring_vis, axis=-1, dtype=jnp.int32)[..., None]      # [B, T, 1]
    valid = pos_bt >= 0
    rows = jnp.arange(t, dtype=jnp.int32)[None, :]
    start = jnp.maximum(jnp.argmax(valid, axis=1).astype(jnp.int32)[:, None], rows - (window - 1))
    n_chunk = jnp.where(valid, rows - start + 1, 0)[..., None]
    i = jnp.arange(width, dtype=jnp.int32)
    chunk_cols = w + start[..., None] + (i - n_ring)
    return jnp.where(i < n_ring, ring_cols, jnp.where(i < n_ring + n_chunk, chunk_cols, -1))


def window_index(mask_btk: jax.Array, width: int) -> jax.Array:
    """mask [B, T, K] -> each query's visible key columns in column order, padded with -1 to [B, T, width]:
    the index list the sparse-attention ops take. ``width`` must be at least the most keys any query
    sees: for ``window_keys``' masks the ring size W (a query sees distinct positions in (q - window, q],
    window <= W); columns past it would be dropped.

    Why: the mask's W+T columns would make every query of a T-token prefill chunk walk T/64 blocks of
    skipped rows in the attention kernel (and decode 3 blocks instead of 2). Row-local, so batch-invariant."""
    k = mask_btk.shape[-1]
    if width >= k:
        return jnp.where(mask_btk, jnp.arange(k, dtype=jnp.int32), -1)
    return true_columns(mask_btk, width)


def window_update(win_stored: dict, win_pos_bw: jax.Array, kv_stored: dict,
                  pos_bt: jax.Array) -> tuple[dict, jax.Array]:
    """Write the chunk's newest W rows into their slots (rows are contiguous in position).

    win_stored / kv_stored: the storage leaves (kv_codec) of the ring [B, W, ...] and of the chunk [B, T, ...].
    """
    w = win_pos_bw.shape[1]
    t = pos_bt.shape[1]
    valid = pos_bt >= 0
    p_last = jnp.max(jnp.where(valid, pos_bt, -1), axis=1)[:, None]
    p_first = jnp.min(jnp.where(valid, pos_bt, jnp.iinfo(jnp.int32).max), axis=1)[:, None]
    t_first = jnp.argmax(valid, axis=1)[:, None]
    slot = jnp.arange(w)[None, :]
    p = p_last - jnp.mod(p_last - slot, w)  # newest position of the chunk that maps to each slot
    take = (p >= p_first) & (p_last >= 0)
    rows = jnp.clip(p - p_first + t_first, 0, t - 1)
    new = {k: jnp.where(take[..., None], jnp.take_along_axis(kv_stored[k], rows[..., None], axis=1), v)
           for k, v in win_stored.items()}
    return new, jnp.where(take, p, win_pos_bw)
