"""Helpers that build model-step inputs for tests (tokens, positions, Engram rows) from token ids."""

from __future__ import annotations

import numpy as np

from deepinfer_jax.model.engram_hash import engram_rows


def rows_for(cfg, token_map, ids: list[int], start: int = 0, history: list[int] | None = None) -> np.ndarray:
    """Engram rows [T, NE, C] for ids[start:] with the tokens before ``start`` as history."""
    comp = token_map[np.asarray(ids, np.int64)]
    hist = comp[max(0, start - (cfg.engram_max_ngram_size - 1)):start] if history is None else history
    return engram_rows(cfg, comp[start:], hist, int(token_map[cfg.engram_pad_token_id]))


def step_inputs(cfg, token_map, rows_of_ids: list[list[int]], starts: list[int], t: int):
    """Batch rows b feed ids[b][starts[b]: starts[b] + t] (padding with position -1 past the end)."""
    b = len(rows_of_ids)
    tokens = np.zeros((b, t), np.int32)
    pos = np.full((b, t), -1, np.int32)
    rows = np.zeros((b, t, len(cfg.engram_layer_ids), cfg.engram_columns), np.int32)
    for i, (ids, s) in enumerate(zip(rows_of_ids, starts)):
        chunk = ids[s:s + t]
        n = len(chunk)
        if n == 0:
            continue
        tokens[i, :n] = chunk
        pos[i, :n] = np.arange(s, s + n)
        rows[i, :n] = rows_for(cfg, token_map, ids[:s + n], start=s)
    return tokens, pos, rows
