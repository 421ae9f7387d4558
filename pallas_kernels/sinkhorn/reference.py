"""float64 numpy oracle of the Sinkhorn rounds, and inputs shaped like mHC's (tests and benchmarks only)."""

from __future__ import annotations

import numpy as np


def example_comb(seed: int, *lead: int, hc: int = 4, eps: float = 1e-6) -> np.ndarray:
    """float32 [*lead, hc, hc] as mHC hands the rounds: a softmax over each row of 3 x standard-normal
    logits, + eps, then one column normalization."""
    logits = np.random.default_rng(seed).standard_normal((*lead, hc, hc)) * 3
    c = np.exp(logits - logits.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    return (c / (c.sum(-2, keepdims=True) + eps)).astype(np.float32)


def sinkhorn_rounds_reference(comb_bthk, *, rounds: int, eps: float) -> np.ndarray:
    """Row then column normalization, ``rounds`` times, in float64 -> float64 [..., hc, hc]."""
    c = np.asarray(comb_bthk, np.float64)
    for _ in range(rounds):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c
