"""Sinkhorn rounds for mHC's stream-mixing matrices (DeepSeek-V4's manifold-constrained hyper-connections).

The op::

    sinkhorn_rounds(comb_bthk f32 [B, T, hc, hc], *, rounds, eps) -> f32 [B, T, hc, hc]

Each round divides every row of each matrix by (its sum + eps), then every column by (its sum + eps).
mHC runs 19 of them (``hc_sinkhorn_iters`` - 1) on a 4 x 4 matrix per token, after a softmax and a first
column normalization that stay with the caller. Every matrix is independent of the others, so any
implementation is batch-invariant; they differ from each other by a few ulps (summation order, and the
GPU kernel's division).

Implementations (same signature), chosen by ``pallas_kernels.registry``:

* ``kernel.sinkhorn_rounds_pallas`` -- Mosaic GPU: a thread per matrix, its hc * hc entries in registers,
  all rounds in one launch. XLA compiles the same unrolled rounds into one fusion chain per call whose
  pricing by its GPU fusion pass was slow enough to stop the 12-layer slice's decode step compiling
  within a device call (benchmarks/NOTES.md), or, cut into segments, into ~24 kernels a call;
* ``xla.sinkhorn_rounds_xla`` -- the rounds unrolled, cut by barriers every few rounds (or a while loop);
* ``reference.sinkhorn_rounds_reference`` -- a float64 numpy oracle (tests only).
"""

from __future__ import annotations

import jax

from pallas_kernels.sinkhorn.config import SinkhornConfig, kernel_unsupported_reason
from pallas_kernels.sinkhorn.reference import sinkhorn_rounds_reference
from pallas_kernels.sinkhorn.xla import SEGMENT_ROUNDS, sinkhorn_rounds_xla

__all__ = ["SEGMENT_ROUNDS", "SinkhornConfig", "kernel_unsupported_reason", "sinkhorn_rounds",
           "sinkhorn_rounds_pallas", "sinkhorn_rounds_reference", "sinkhorn_rounds_xla"]


def sinkhorn_rounds_pallas(*args, **kwargs):
    """Lazy import: the Mosaic GPU module is only loaded when the kernel is asked for."""
    from pallas_kernels.sinkhorn.kernel import sinkhorn_rounds_pallas as impl

    return impl(*args, **kwargs)


def sinkhorn_rounds(comb_bthk: jax.Array, *, rounds: int, eps: float, impl: str | None = None, selection=None,
                    config: SinkhornConfig = SinkhornConfig()) -> jax.Array:
    """The op (see module docstring) on the implementation the registry picks for comb's platform."""
    from pallas_kernels import registry

    if selection is None:
        selection = registry.KernelSelection.from_env()
    chosen = registry.resolve("sinkhorn_rounds", impl=impl, selection=selection,
                              device=registry.device_of(comb_bthk))
    if chosen.name == registry.PALLAS_MOSAIC_GPU:
        if (why := kernel_unsupported_reason(comb_bthk.shape[-1])) is not None:
            if impl is not None:
                raise registry.KernelUnavailableError(f"sinkhorn_rounds: {why}")
            chosen = registry.resolve("sinkhorn_rounds", impl=registry.XLA, selection=selection)
        else:
            return chosen.load()(comb_bthk, rounds=rounds, eps=eps, config=config)
    return chosen.load()(comb_bthk, rounds=rounds, eps=eps)
