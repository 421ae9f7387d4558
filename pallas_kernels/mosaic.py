"""Pieces shared by the Mosaic GPU kernels: shared-memory tilings and the warpgroup roles."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


def interpreting() -> bool:
    """Whether the kernel being traced will run in the Mosaic GPU interpreter (``gpu_interpreter()``)."""
    from jax._src import config as jax_config

    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def wait_for_prior_grids(pdl: bool) -> None:
    """With ``pdl`` (a kernel config's programmatic dependent launch), wait on ``griddepcontrol.wait``:
    called by every thread before its kernel reads or writes global memory, it lets the kernel be
    launched while the grids it depends on still run. Tracing the wait marks the kernel as using PDL, so
    the runtime launches it that way. Nothing in the interpreter, which runs kernels one by one."""
    if pdl and not interpreting():
        plgpu.griddepcontrol_wait()


def tiled(swizzle_bytes: int, itemsize: int) -> tuple:
    """The transforms of a shared-memory tile that TMA swizzles by ``swizzle_bytes`` (8-row tiles)."""
    return (plgpu.TilingTransform((8, swizzle_bytes // itemsize)), plgpu.SwizzleTransform(swizzle_bytes))


def ref_type(*, write: bool, transforms: tuple = ()) -> plgpu.RefType:
    """An ``inline_mgpu`` reference argument the inline code reads, and writes only if ``write``. jax
    0.12.1 checks a kernel's writes to its inputs and takes a ``RefType`` as written unless told not
    to; earlier versions have no such fields and no such check, so there the plain form is right.
    transforms: the shared-memory buffer's (``tiled``), which the inline code then sees laid out."""
    if "write" in {f.name for f in dataclasses.fields(plgpu.RefType)}:
        return plgpu.RefType(transforms=transforms, write=write)
    return plgpu.RefType(transforms=transforms)


# setmaxnreg shares out registers the CTA got at launch; it cannot take more. ptxas sizes the launch
# for ``.maxntid`` threads at the most each may have: per warp in units of 256 registers (8 a thread),
# all warps within the SM's 65,536. An ``increase`` the pool cannot meet waits forever.
_SM_REGISTERS = 65_536
_REGISTERS_PER_THREAD_UNIT = 8
_MAX_REGISTERS_PER_THREAD = 256


def launch_register_pool(warpgroups: int) -> int:
    """Registers a CTA of ``warpgroups`` x 128 threads holds at launch, with each thread at its most."""
    threads = 128 * warpgroups
    per_thread = _SM_REGISTERS // threads // _REGISTERS_PER_THREAD_UNIT * _REGISTERS_PER_THREAD_UNIT
    return threads * min(per_thread, _MAX_REGISTERS_PER_THREAD)


def consumer_registers(consumers: int, producers: int, producer_registers: int) -> int:
    """The most registers a consumer thread can ``set_max_registers(..., "increase")`` to, once each of
    the ``producers`` warpgroups has decreased to ``producer_registers``: what is left of the launch pool,
    in setmaxnreg's multiples of 8 (24..256). 2 consumers + 1 producer at 40: 232; 4 + 1 at 40: 104 (the
    pool is 640 x 96 registers there, not the SM's 65,536: asking 112 hung the kernel)."""
    pool = launch_register_pool(consumers + producers)
    left = (pool - 128 * producers * producer_registers) // (128 * consumers)
    regs = min(left // _REGISTERS_PER_THREAD_UNIT * _REGISTERS_PER_THREAD_UNIT, _MAX_REGISTERS_PER_THREAD)
    if regs < 24:
        raise ValueError(f"{consumers} consumer and {producers} producer warpgroups at {producer_registers} "
                         f"registers leave {left} a consumer thread; setmaxnreg needs >= 24")
    return regs


def run_warpgroups(consumer: Callable[[int], None], producers: Sequence[Callable[[], None]],
                   consumers: int = 2) -> None:
    """The kernels' roles: ``consumer(j)`` on warpgroup j for j < consumers, then ``producers[i]()``
    on warpgroup consumers + i (thread axis "wg")."""
    wg = lax.axis_index("wg")
    for j in range(consumers):
        pl.when(wg == j)(lambda j=j: consumer(j))
    for i, producer in enumerate(producers):
        pl.when(wg == consumers + i)(producer)
