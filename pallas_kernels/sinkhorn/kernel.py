"""Mosaic GPU kernel for the Sinkhorn rounds: one thread per matrix, every round in registers.

Layout: the wrapper hands the kernel comb transposed to [hc * hc, N] (entry-major, N padded to the
block), so entry k of 128 consecutive matrices is one contiguous 512-byte row that a warpgroup loads as a
vector of one value per thread. A CTA copies its [hc * hc, block_rows] tile to shared memory by TMA,
runs the rounds in a loop (sums in entry order 0, 1, ..., hc - 1, then + eps, then a division) and
copies the result back. The transposes around it fuse into the XLA code that makes and reads comb.

Division is Mosaic GPU's lowering of ``/`` (``div.full.f32`` in the PTX, within 2 ulp), not XLA's
correctly rounded one, so this path and the XLA path differ by a few ulps; each is batch-invariant
(a matrix's result depends on nothing else in the call). Padding matrices are zeros: 0 / eps = 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.mosaic import wait_for_prior_grids
from pallas_kernels.sinkhorn.config import WARPGROUP_THREADS, SinkhornConfig


def rounds_on_entries(c: list[list], rounds: int, eps: float) -> list[list]:
    """The rounds on c[i][j], one array (or scalar) per entry: the kernel's order of operations. Shared
    with the tests, which run it in numpy to check the kernel's bits in the interpreter."""
    hc = len(c)

    def total(values):
        s = values[0]
        for v in values[1:]:
            s = s + v
        return s + eps

    for _ in range(rounds):
        row = [total(c[i]) for i in range(hc)]
        c = [[c[i][j] / row[i] for j in range(hc)] for i in range(hc)]
        col = [total([c[i][j] for i in range(hc)]) for j in range(hc)]
        c = [[c[i][j] / col[j] for j in range(hc)] for i in range(hc)]
    return c


def _one_round(flat: tuple, hc: int, eps: float) -> tuple:
    c = rounds_on_entries([list(flat[hc * i:hc * (i + 1)]) for i in range(hc)], 1, eps)
    return tuple(v for row in c for v in row)


def _build(hc: int, n_pad: int, rounds: int, eps: float, block: int, pdl: bool = False):
    entries = hc * hc

    def body(x_ref, o_ref, x_smem, o_smem, loaded):
        wait_for_prior_grids(pdl)
        n0 = lax.axis_index("n") * block
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(n0, block)], x_smem, loaded.at[0])
        plgpu.barrier_wait(loaded.at[0])
        for g in range(block // WARPGROUP_THREADS):
            cols = pl.ds(g * WARPGROUP_THREADS, WARPGROUP_THREADS)
            flat = tuple(x_smem[k, cols] for k in range(entries))
            # A loop, not the rounds unrolled: the same operations in the same order, and Mosaic GPU's
            # layout inference, superlinear in the ops it solves at once, then sees one round's instead of
            # 19 rounds' (14 s of the B=64 decode step's lowering deviceless, 2026-12-05).
            flat = lax.fori_loop(0, rounds, lambda _, f: _one_round(f, hc, eps), flat)
            for k in range(entries):
                o_smem[k, cols] = flat[k]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[:, pl.ds(n0, block)])
        plgpu.wait_smem_to_gmem(0)

    def entry(x_ref, o_ref):
        pl.run_scoped(lambda xs, os_, bar: body(x_ref, o_ref, xs, os_, bar),
                      plgpu.SMEM((entries, block), jnp.float32), plgpu.SMEM((entries, block), jnp.float32),
                      plgpu.Barrier(num_arrivals=1, num_barriers=1))

    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((entries, n_pad), jnp.float32),
                        grid=(n_pad // block,), grid_names=("n",))


@functools.partial(jax.jit, static_argnames=("rounds", "eps", "config"))
def sinkhorn_rounds_pallas(comb_bthk: jax.Array, *, rounds: int, eps: float,
                           config: SinkhornConfig = SinkhornConfig()) -> jax.Array:
    """-> f32 [..., hc, hc]. Same contract as ``pallas_kernels.sinkhorn.sinkhorn_rounds``."""
    *lead, hc, hc2 = comb_bthk.shape
    if hc != hc2:
        raise ValueError(f"sinkhorn_rounds: comb must end in square matrices, got shape {comb_bthk.shape}")
    if rounds == 0:
        return comb_bthk.astype(jnp.float32)
    n = math.prod(lead)
    block = config.block_rows
    n_pad = -(-n // block) * block
    comb_kn = jnp.pad(comb_bthk.astype(jnp.float32).reshape(n, hc * hc).T, ((0, 0), (0, n_pad - n)))
    out_kn = _build(hc, n_pad, rounds, float(eps), block, config.pdl)(comb_kn)
    return out_kn[:, :n].T.reshape(comb_bthk.shape)
