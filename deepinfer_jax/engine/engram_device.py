"""Engram n-gram row ids computed inside the jitted step, bit-identical to ``model.engram_hash``.

Why on the device: a decode step's Engram rows depend on the token the previous step sampled. Hashing on
the host would make the host wait for every sampled token before it can launch the next step; hashing
in-graph lets the engine launch step N+1 while step N still runs (the sampled token never leaves the
device on the critical path).

The host hash is int64 arithmetic (JAX runs in 32-bit mode), so it is rebuilt exactly from uint32 parts:
* ``c * m_s`` (a compressed id times the layer's odd multiplier for n-gram slot s) comes from a table
  built on the host with numpy int64, stored as (hi, lo) uint32 words;
* the rolling XOR is done word by word;
* ``value mod p`` (p < 2**31) is Horner's rule over k-bit digits with k chosen so ``p << k`` fits 32 bits.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.engram_hash import engram_multipliers, engram_primes


def engram_tables(cfg: ModelConfig, n_keys: int) -> dict[str, np.ndarray]:
    """Host-built constants for ``engram_rows_device`` (pass them to the step as arguments).

    n_keys: number of compressed ids (every value of the token map and the pad id are below it)."""
    if n_keys > cfg.engram_compressed_vocab_size:
        # the multipliers are bounded so that id * multiplier < 2**63 only for ids below this size
        raise ValueError(f"{n_keys} Engram keys exceed engram_compressed_vocab_size="
                         f"{cfg.engram_compressed_vocab_size} in config.json")
    hi, lo, primes, offsets = [], [], [], []
    comp = np.arange(n_keys, dtype=np.int64)
    for lid in cfg.engram_layer_ids:
        p = np.asarray(engram_primes(cfg, lid), np.int64)  # [n-1, heads]
        prod = comp[:, None] * engram_multipliers(cfg, lid)[None, :]  # [keys, n]; < 2**63 by construction
        hi.append((prod >> 32).astype(np.uint32))
        lo.append((prod & 0xFFFFFFFF).astype(np.uint32))
        primes.append(p)
        offsets.append(np.concatenate([[0], np.cumsum(p.reshape(-1))[:-1]]).reshape(p.shape))
    if not primes:
        return {}
    primes_arr = np.stack(primes)
    if primes_arr.max() >= 2**31 or np.stack(offsets).max() + primes_arr.max() >= 2**31:
        raise OverflowError("Engram primes/rows exceed int32; the table is larger than any known checkpoint")
    return {"prod_hi": np.stack(hi, axis=1), "prod_lo": np.stack(lo, axis=1),  # [keys, layers, n]
            "primes": primes_arr.astype(np.uint32), "offsets": np.stack(offsets).astype(np.int32)}


def digit_bits(max_prime: int) -> int:
    """The largest k in (16, 8, 4, 2, 1) with max_prime << k < 2**32 (Horner digits of k bits)."""
    for k in (16, 8, 4, 2, 1):
        if max_prime < 1 << (32 - k):
            return k
    raise OverflowError(f"Engram prime {max_prime} does not fit 31 bits")


def _mod_u64(hi: jax.Array, lo: jax.Array, p: jax.Array, k: int) -> jax.Array:
    """(hi * 2**32 + lo) mod p for uint32 words and uint32 p < 2**(32-k)."""
    mask = jnp.uint32((1 << k) - 1)
    r = jnp.zeros(jnp.broadcast_shapes(hi.shape, p.shape), jnp.uint32)
    for word in (hi, lo):
        for shift in range(32 - k, -1, -k):
            r = ((r << k) | ((word >> shift) & mask)) % p
    return r


def engram_rows_device(tables: dict[str, jax.Array], hist_bh: jax.Array, comp_bt: jax.Array, pad_id: int,
                       max_prime: int) -> jax.Array:
    """int32[B, T, n_layers, (n-1)*heads]: the rows of T new tokens per slot.

    hist_bh: int32[B, n-1] compressed ids of the tokens before the chunk, oldest first (-1 = none, e.g.
    at the start of a sequence); comp_bt: int32[B, T] compressed ids of the new tokens, -1 = padding
    (padding rows produce rows the model never reads). Equals ``model.engram_hash.engram_rows``.
    """
    b, t = comp_bt.shape
    n1 = hist_bh.shape[1]
    seq = jnp.concatenate([hist_bh, comp_bt], axis=1)  # [B, n-1+T]
    idx = (n1 + jnp.arange(t))[:, None] - jnp.arange(n1 + 1)[None, :]  # [T, n]: s-th most recent token
    toks = seq[:, idx]  # [B, T, n]
    alive = jnp.cumprod(toks >= 0, axis=-1).astype(bool)  # sticky, as on the host
    toks = jnp.where(alive, toks, pad_id)
    hi = tables["prod_hi"][toks]  # [B, T, n, layers, n_mult]
    lo = tables["prod_lo"][toks]
    slot = jnp.arange(n1 + 1)
    hi = hi[:, :, slot, :, slot].transpose(1, 2, 3, 0)  # -> [B, T, layers, n]: multiplier s for slot s
    lo = lo[:, :, slot, :, slot].transpose(1, 2, 3, 0)
    roll_hi = jax.lax.associative_scan(jnp.bitwise_xor, hi, axis=-1)[..., 1:]  # orders 2..n
    roll_lo = jax.lax.associative_scan(jnp.bitwise_xor, lo, axis=-1)[..., 1:]
    primes = tables["primes"][None, None]  # [1, 1, layers, n-1, heads]
    r = _mod_u64(roll_hi[..., None], roll_lo[..., None], primes, digit_bits(max_prime))
    rows = r.astype(jnp.int32) + tables["offsets"][None, None]
    return rows.reshape(b, t, rows.shape[2], -1)


def advance_history(hist_bh: jax.Array, comp_bt: jax.Array) -> jax.Array:
    """The n-1 most recent compressed ids after appending each row's live tokens (comp >= 0 come first
    in the row, padding after)."""
    n1 = hist_bh.shape[1]
    n_live = jnp.sum(comp_bt >= 0, axis=1)  # [B]
    seq = jnp.concatenate([hist_bh, comp_bt], axis=1)
    take = n_live[:, None] + jnp.arange(n1)[None, :]
    return jnp.take_along_axis(seq, take, axis=1)


__all__ = ["advance_history", "digit_bits", "engram_rows_device", "engram_tables"]
