"""The Sinkhorn rounds in plain JAX: unrolled (cut into segments) or as a while loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# XLA's GPU fusion pass prices every candidate fusion with a symbolic tiling search. Unrolled, the
# 19 rounds form one candidate chain, and for some shapes that search is slow: compiled for the H200 on
# a CPU (jax 0.12, deviceless), one mHC call took 4.1-5.1 s at 64 x 1, 1024 and 4096 rows (1.2 s at
# 2048), the 12-layer slice's prefill program 113 s at a 4096-token chunk, and its B=64 decode step did
# not finish compiling in 470 s on the H200 (548 s deviceless). Barriers every few rounds bound each
# chain (~1.3-2.3 s a call at any row count) for ~17-25 more kernels a call (benchmarks/NOTES.md).
SEGMENT_ROUNDS = 5


def _round(c: jax.Array, eps: float) -> jax.Array:
    c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
    return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)


def sinkhorn_rounds_xla(comb_bthk: jax.Array, *, rounds: int, eps: float, unroll: bool = True,
                        segment: int | None = SEGMENT_ROUNDS) -> jax.Array:
    """The op in XLA. unroll=False: a ``fori_loop`` (a much smaller graph to compile, but on a GPU each
    iteration's predicate is a device-to-host round trip). segment: with unroll, an optimization
    barrier every this many rounds (None: one chain). Same arithmetic in every form."""
    if not unroll:
        return jax.lax.fori_loop(0, rounds, lambda _, c: _round(c, eps), comb_bthk)
    c = comb_bthk
    for i in range(rounds):
        if segment is not None and i and i % segment == 0:
            c = jax.lax.optimization_barrier(c)
        c = _round(c, eps)
    return c
