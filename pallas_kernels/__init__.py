"""Kernels for deepinfer-jax: Mosaic GPU (Hopper) Pallas kernels with portable XLA fallbacks.

Each op lives in its own package (``grouped_gemm``, ``attention``, ``topk``) with the same files:
``reference.py`` (the float32 oracle), ``xla.py`` (runs anywhere, batch-invariant by construction),
``kernel.py`` (the Mosaic GPU kernel) and ``config.py`` (frozen tuning config + input checks).
``registry`` maps (op, platform) to an implementation. Nothing here knows about the model.
"""

from pallas_kernels.registry import (AUTO, PALLAS_MOSAIC_GPU, REFERENCE, REGISTRY, XLA, KernelSelection,
                                     KernelUnavailableError, platform_name, resolve)

__all__ = ["AUTO", "PALLAS_MOSAIC_GPU", "REFERENCE", "REGISTRY", "XLA", "KernelSelection",
           "KernelUnavailableError", "platform_name", "resolve"]
