"""Wall-clock timing shared by the benchmark scripts (run them with the repo root on PYTHONPATH)."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_ms(fn, *args, reps: int = 10) -> float:
    """Median wall time of ``fn(*args)`` to completion over ``reps`` calls, after one untimed call (the
    compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))
