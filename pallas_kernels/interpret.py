"""Run the Mosaic GPU kernels on a CPU, in the Mosaic GPU interpreter (tests and smoke runs only).

``gpu_interpreter()`` is a context manager: every ``plgpu.kernel`` traced inside it runs in the
interpreter (optionally with its race detector), under an abstract H100-class device so that Mosaic's
GPU-only checks pass. It works inside an outer ``jax.jit`` trace as well (the kernels read it when they
are traced). It is slow (Python callbacks per warpgroup thread): use it on small shapes.
"""

from __future__ import annotations

import contextlib


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
    return stack


def races_found() -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.get_races().races_found)
