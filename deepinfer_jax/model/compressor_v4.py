"""V4-Flash compressors (spec §3.2): softmax-gated pooling of ratio-r windows with a learned position bias.

* ratio 128 (HCA): entry j pools tokens 128j..128j+127: per channel, softmax over the window of
  (score + ape[t mod r]) weights the kv rows. Projections are width C = head_dim.
* ratio 4 (CSA, ``overlap``): projections are width C = 2 * dim, two halves A = [:dim], B = [dim:].
  Entry j pools 2r slots: half A of the previous window's tokens (4j-4..4j-1; absent for j = 0) and
  half B of this window's (4j..4j+3), with one per-channel softmax over all 2r slots. The indexer's own
  compressor is the same at dim = index_head_dim.
An entry is emitted by the row of its window's last token (pos mod r = r - 1), then RMS-normed; RoPE and
the cache write are the caller's. Windows are aligned to absolute positions, and the projected rows of
the last S = 2r (overlap) or r positions are carried in an fp32 ring in the cache (slot = pos mod S), so
chunk boundaries never change what a window pools.

Cache leaves (names start with ``pend_`` so ``cache.reset_slots`` empties them on admission):
``pend_kv`` / ``pend_score`` fp32 [B, S, C] and ``pend_pos1`` int32 [B, S] = position + 1 (0 = empty); the
indexer's compressor has the same leaves named ``pend_idx_*``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.linear import plain_linear
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.window import window_update

_NEG = -1e30  # a finite "minus infinity": a row with no valid slot (padding) pools garbage, not NaN


def state_len(ratio: int, overlap: bool) -> int:
    return 2 * ratio if overlap else ratio


def state_shapes(batch: int, ratio: int, overlap: bool, dim: int, prefix: str = "") -> dict:
    """ShapeDtypeStructs of one compressor's carried rows (``prefix`` tells the indexer's apart)."""
    s = state_len(ratio, overlap)
    width = 2 * dim if overlap else dim
    return {f"pend_{prefix}kv": jax.ShapeDtypeStruct((batch, s, width), jnp.float32),
            f"pend_{prefix}score": jax.ShapeDtypeStruct((batch, s, width), jnp.float32),
            f"pend_{prefix}pos1": jax.ShapeDtypeStruct((batch, s), jnp.int32)}


def _window_rows(ring_bsc: jax.Array, ring_pos_bs: jax.Array, chunk_btc: jax.Array, pos_bt: jax.Array,
                 want_bto: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows at positions want [B, T, O] from the ring (positions below the chunk) or the chunk itself.

    -> (rows [B, T, O, C], valid [B, T, O]). Chunk rows are contiguous in position, so a position at or
    above the chunk's first is found by offset; one below it must sit in its ring slot."""
    b, s, _ = ring_bsc.shape
    t = pos_bt.shape[1]
    valid_row = pos_bt >= 0
    p_first = jnp.min(jnp.where(valid_row, pos_bt, jnp.iinfo(jnp.int32).max), axis=1)[:, None, None]
    t_first = jnp.argmax(valid_row, axis=1)[:, None, None]
    in_chunk = want_bto >= p_first
    chunk_idx = jnp.clip(want_bto - p_first + t_first, 0, t - 1)
    slot = jnp.mod(want_bto, s)
    bi = jnp.arange(b)[:, None, None]
    ring_ok = (jnp.take_along_axis(ring_pos_bs[:, None, :], slot.reshape(b, 1, -1), axis=2).reshape(slot.shape)
               == want_bto)
    rows = jnp.where(in_chunk[..., None], chunk_btc[bi, chunk_idx], ring_bsc[bi, slot])
    causal = want_bto <= pos_bt[..., None]
    valid = (want_bto >= 0) & causal & jnp.where(in_chunk, True, ring_ok) & valid_row[..., None]
    return rows, valid


def compress(p: dict, x_btd: jax.Array, pos_bt: jax.Array, ratio: int, overlap: bool, state: dict, *, eps: float,
             numerics: Numerics, prefix: str = "") -> tuple[jax.Array, jax.Array, dict]:
    """-> (latent [B, T, dim] pre-RoPE, emits [B, T] bool, new carried state). Row t emits entry pos_t // r."""
    kv = plain_linear(x_btd, p["wkv"], numerics, jnp.float32, compute_dtype=jnp.float32)
    score = plain_linear(x_btd, p["wgate"], numerics, jnp.float32, compute_dtype=jnp.float32)
    ape = p["ape"].astype(jnp.float32)  # [r, C]
    score = score + ape[jnp.mod(jnp.maximum(pos_bt, 0), ratio)]
    dim = kv.shape[-1] // 2 if overlap else kv.shape[-1]

    ring_kv, ring_score = state[f"pend_{prefix}kv"], state[f"pend_{prefix}score"]
    ring_pos = state[f"pend_{prefix}pos1"] - 1
    first = jnp.min(jnp.where(pos_bt >= 0, pos_bt, jnp.iinfo(jnp.int32).max), axis=1)[:, None]
    ring_pos = jnp.where((ring_pos >= 0) & (ring_pos < first), ring_pos, -1)  # at/above the chunk: stale

    j = jnp.maximum(pos_bt, 0) // ratio
    n_slots = state_len(ratio, overlap)
    start = (j - 1) * ratio if overlap else j * ratio
    want = start[..., None] + jnp.arange(n_slots)[None, None, :]  # [B, T, O]
    k_rows, valid = _window_rows(ring_kv, ring_pos, kv, pos_bt, want)
    s_rows, _ = _window_rows(ring_score, ring_pos, score, pos_bt, want)
    if overlap:  # slots 0..r-1: the previous window's half A; slots r..2r-1: this window's half B
        prev = jnp.arange(n_slots) < ratio
        k_rows = jnp.where(prev[:, None], k_rows[..., :dim], k_rows[..., dim:])
        s_rows = jnp.where(prev[:, None], s_rows[..., :dim], s_rows[..., dim:])
    s_rows = jnp.where(valid[..., None], s_rows, _NEG)
    gate = jax.nn.softmax(s_rows, axis=2)
    pooled = jnp.sum(gate * jnp.where(valid[..., None], k_rows, 0.0), axis=2)
    latent = rms_norm(pooled, p["norm"]["weight"], eps, numerics.dtype)
    emits = (pos_bt >= 0) & (jnp.mod(pos_bt, ratio) == ratio - 1)

    new_ring, new_pos = window_update({"kv": ring_kv, "score": ring_score}, ring_pos,
                                      {"kv": kv, "score": score}, pos_bt)
    new_state = {f"pend_{prefix}kv": new_ring["kv"], f"pend_{prefix}score": new_ring["score"],
                 f"pend_{prefix}pos1": new_pos + 1}
    return latent, emits, new_state
