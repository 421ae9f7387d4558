"""Engram n-gram hashing on the host (int64 numpy): prime layout, multipliers, per-position row ids.

Runs on the host because the hash needs exact int64 products and XORs; JAX's default x32 mode would
silently truncate them. The output ids are small enough (< 2**31 for every real table) to ship as int32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from deepinfer_jax.config import ModelConfig


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _next_prime(n: int) -> int:
    n += 1
    while not _is_prime(n):
        n += 1
    return n


def engram_primes(cfg: "ModelConfig", layer_id: int) -> list[list[int]]:
    """primes[order - 2][head] for one Engram layer; layers take unused primes in engram_layer_ids order."""
    used: set[int] = set()
    result: dict[int, list[list[int]]] = {}
    for lid in cfg.engram_layer_ids:
        per_order = []
        for _order in range(2, cfg.engram_max_ngram_size + 1):
            running = cfg.engram_vocab_size - 1
            heads = []
            for _h in range(cfg.engram_n_heads):
                p = _next_prime(running)
                while p in used:
                    p = _next_prime(p)
                used.add(p)
                heads.append(p)
                running = p
            per_order.append(heads)
        result[lid] = per_order
    if layer_id not in result:
        raise ValueError(f"layer {layer_id} is not an Engram layer ({list(cfg.engram_layer_ids)})")
    return result[layer_id]


def engram_multipliers(cfg: "ModelConfig", layer_id: int) -> np.ndarray:
    """int64[max_ngram]: odd multipliers m = 2v + 1 from a generator seeded by 10007 * layer_id."""
    bound = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2
    v = np.random.default_rng(10007 * layer_id).integers(0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64)
    return 2 * v + 1


def engram_row_ids(
    cfg: "ModelConfig", layer_id: int, comp_ids_t: np.ndarray, history: np.ndarray, pad_id: int
) -> np.ndarray:
    """Table rows for each position: int64[T, columns] with columns = (max_ngram - 1) * n_heads.

    comp_ids_t: compressed ids of the new tokens (-1 marks a dead/image position).
    history: compressed ids of the up to ``max_ngram - 1`` tokens before them, oldest first (shorter at
    the start of a sequence; -1 entries are dead too). pad_id: the compressed id of the pad token.
    """
    n = cfg.engram_max_ngram_size
    primes = np.asarray(engram_primes(cfg, layer_id), dtype=np.int64)  # [n-1, heads]
    offsets = np.concatenate([[0], np.cumsum(primes.reshape(-1))[:-1]]).reshape(primes.shape)
    mult = engram_multipliers(cfg, layer_id)
    hist = np.asarray(history, dtype=np.int64).reshape(-1)[len(history) - min(len(history), n - 1):]
    seq = np.concatenate([hist, np.asarray(comp_ids_t, dtype=np.int64).reshape(-1)])
    pos = np.arange(len(hist), len(seq))
    idx = pos[:, None] - np.arange(n)[None, :]  # [T, n]: position of the s-th most recent token
    alive = (idx >= 0) & (seq[np.clip(idx, 0, None)] >= 0)
    alive = np.cumprod(alive, axis=1).astype(bool)  # sticky: once a slot is padded, every older one is too
    toks = np.where(alive, seq[np.clip(idx, 0, None)], np.int64(pad_id))
    rolling = np.bitwise_xor.accumulate(toks * mult[None, :], axis=1)  # R_{s+1} for s = 0..n-1
    rows = rolling[:, 1:, None] % primes[None] + offsets[None]  # [T, n-1, heads]
    return rows.reshape(len(pos), -1)


def engram_rows(cfg: "ModelConfig", comp_ids_t: np.ndarray, history: np.ndarray, pad_id: int) -> np.ndarray:
    """int32[T, n_engram_layers, columns]: the rows of every Engram layer for T new tokens (host side)."""
    per_layer = [engram_row_ids(cfg, lid, comp_ids_t, history, pad_id) for lid in cfg.engram_layer_ids]
    if not per_layer:
        return np.zeros((len(comp_ids_t), 0, 0), np.int32)
    rows = np.stack(per_layer, axis=1)
    if rows.size and rows.max() >= 2**31:
        raise OverflowError("Engram row ids exceed int32; the table is larger than any known checkpoint")
    return rows.astype(np.int32)
