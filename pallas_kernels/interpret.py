"""Run the Mosaic GPU kernels on a CPU, in the Mosaic GPU interpreter (tests and smoke runs only).

``gpu_interpreter()`` is a context manager: every ``plgpu.kernel`` traced inside it runs in the
interpreter (optionally with its race detector), under an abstract H100-class device so that Mosaic's
GPU-only checks pass. It works inside an outer ``jax.jit`` trace as well (the kernels read it when they
are traced). It is slow (Python callbacks per warpgroup thread): use it on small shapes.

Inside it a wgmma sums its K products in float64 and rounds once to the accumulator's float32
(``_ExactMatmulNumpy``), instead of the interpreter's float32 ``np.matmul``. That one goes to the BLAS
numpy was built with, whose summation order depends on the CPU's kernel and on the matrix shapes: on an
AMD EPYC (AVX2) runner the same rows came out of a 128-row and a 256-row weight tile with different bits
(428 of 12,288 values, up to 1.7e-5 apart), which broke the tests that compare kernel forms bitwise.
The operands are bf16 or FP8 values, so each product is exact in float64 and so is a wgmma's K sum of
them unless its terms span over ~2^37: the result is then the same in any order, on any CPU.
"""

from __future__ import annotations

import contextlib

import numpy as np


class _ExactMatmulNumpy:
    """numpy, except ``matmul``: float64 products and sums, then the requested dtype (module docstring)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, dtype=None):
        out = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
        return out if dtype is None else out.astype(dtype)


def gpu_interpreter(detect_races: bool = False) -> contextlib.ExitStack:
    import jax
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                                               platform="gpu", num_cores=8))
    stack = contextlib.ExitStack()
    stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    stack.enter_context(plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=detect_races)))
    _use_exact_wgmma_sums()
    return stack


def _use_exact_wgmma_sums() -> None:
    """Point the interpreter's callbacks at ``_ExactMatmulNumpy`` for the rest of the process: a kernel
    traced inside ``gpu_interpreter`` under ``jax.jit`` runs its callbacks when the program executes,
    after the context has exited, so the switch cannot be undone on exit. It touches the interpreter's
    callback module only, which nothing but interpreted kernels uses."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    if getattr(gpu_callbacks, "np", None) is np:     # (a jax whose wgmma callback reads numpy so)
        gpu_callbacks.np = _ExactMatmulNumpy()


def races_found() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.get_races().races_found)
