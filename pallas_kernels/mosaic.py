"""Pieces shared by the Mosaic GPU kernels: shared-memory tilings and the warpgroup roles."""

from __future__ import annotations

from typing import Callable, Sequence

from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


def tiled(swizzle_bytes: int, itemsize: int) -> tuple:
    """The transforms of a shared-memory tile that TMA swizzles by ``swizzle_bytes`` (8-row tiles)."""
    return (plgpu.TilingTransform((8, swizzle_bytes // itemsize)), plgpu.SwizzleTransform(swizzle_bytes))


def run_warpgroups(consumer: Callable[[int], None], producers: Sequence[Callable[[], None]],
                   consumers: int = 2) -> None:
    """The kernels' roles: ``consumer(j)`` on warpgroup j for j < consumers, then ``producers[i]()``
    on warpgroup consumers + i (thread axis "wg")."""
    wg = lax.axis_index("wg")
    for j in range(consumers):
        pl.when(wg == j)(lambda j=j: consumer(j))
    for i, producer in enumerate(producers):
        pl.when(wg == consumers + i)(producer)
