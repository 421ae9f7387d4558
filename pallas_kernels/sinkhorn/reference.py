"""float64 numpy oracle of the Sinkhorn rounds (tests only)."""

from __future__ import annotations

import numpy as np


def sinkhorn_rounds_reference(comb_bthk, *, rounds: int, eps: float) -> np.ndarray:
    """Row then column normalization, ``rounds`` times, in float64 -> float64 [..., hc, hc]."""
    c = np.asarray(comb_bthk, np.float64)
    for _ in range(rounds):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c
