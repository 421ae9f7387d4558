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


def cupti_kernels_ms(f, *args, iters: int = 10) -> list[list[tuple[str, float]]] | None:
    """Per call of ``f(*args)`` (after one untimed call), every GPU kernel it ran as (name, ms), timed by
    CUPTI through Mosaic GPU's profiler: device time only, without the host's launch work that a
    wall clock adds. None where that profiler is unavailable (no GPU, no CUPTI)."""
    jax.block_until_ready(f(*args))
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, per_iter = profiler.measure(f, aggregate=False, iterations=iters)(*args)
    except Exception:  # noqa: BLE001 - callers fall back to wall-clock timing
        return None
    return [list(it) for it in per_iter]


def cupti_ms(f, *args, iters: int = 10, match: str | None = None) -> tuple[float, float | None] | None:
    """(median total GPU ms per call, median ms of the kernels whose name contains ``match``, or of the
    largest kernel when match is None) by ``cupti_kernels_ms``; None without CUPTI."""
    per_iter = cupti_kernels_ms(f, *args, iters=iters)
    if per_iter is None:
        return None
    totals = [sum(t for _, t in it) for it in per_iter]
    if match is None:
        part = [max(t for _, t in it) for it in per_iter]
    else:
        part = [sum(t for name, t in it if match in name) for it in per_iter]
    return float(np.median(totals)), float(np.median(part)) if any(part) else None


def device_ms(fn, *args, reps: int) -> tuple[float, str]:
    """(ms per call, timer): CUPTI's device time where it is available ("cupti"), else the median wall
    time ("wall")."""
    got = cupti_ms(fn, *args, iters=reps)
    if got is not None:
        return got[0], "cupti"
    return median_ms(fn, *args, reps=reps), "wall"
