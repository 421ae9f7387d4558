"""jax's persistent compilation cache, and with it XLA's per-fusion autotuning cache.

A cached program is not compiled again by a later process with the same jax, device and program. On the
H200 the 12-layer slice's prefill and decode programs took 100-230 s each to compile (benchmarks/NOTES.md).

The autotuning cache matters for more than time. XLA picks some GEMM kernels by timing candidates while
it compiles, so two compilations of one program may pick different kernels, and so give other bits
(spec: batch_invariance_and_ascend.md). Under this cache the first compilation's picks are written to
``<dir>/xla_gpu_per_fusion_autotune_cache_dir`` (jax's default for ``jax_persistent_cache_enable_xla_caches``)
and every later compilation that meets the same fusion reads them back. The directory holds small files
that can be copied to another machine of the same GPU. On CPU nothing is autotuned and only whole
programs are cached.

The cache is process-wide jax configuration, so it is set here on request only, never as a side effect
of importing the package.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
from jax.experimental.compilation_cache.compilation_cache import reset_cache

log = logging.getLogger(__name__)

AUTOTUNE_SUBDIR = "xla_gpu_per_fusion_autotune_cache_dir"


def enable_compile_cache(path: str | Path) -> Path:
    """Use ``path`` (created if missing) as jax's persistent compilation cache for this process -> the
    resolved path. Programs compiled before the call are not cached. Raises ValueError if another
    directory is already configured (a process has one cache)."""
    path = Path(path).expanduser().resolve()
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current).expanduser().resolve() != path:
        raise ValueError(f"jax's compilation cache is already {current!r}; not switching it to {str(path)!r}")
    path.mkdir(parents=True, exist_ok=True)
    if not current:
        # jax decides once, at the first compilation, whether a cache is used; forget that decision
        reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(path))
    log.info("jax compilation cache (and XLA's autotuning cache) at %s", path)
    return path


def autotune_dir(cache: str | Path) -> Path:
    """Where XLA keeps its per-fusion autotuning results under a cache directory."""
    return Path(cache) / AUTOTUNE_SUBDIR
