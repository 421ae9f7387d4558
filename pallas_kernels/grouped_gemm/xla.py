"""XLA fallback for ``grouped_matmul``: group-sorted fixed-size tiles, one expert per tile, in a loop.

Why this shape: every tile is the same [xla_block_m, K] x [K, N] product, compiled once and run by
``lax.map``, so a row's arithmetic is the same whatever M is, whichever other rows share its tile and
however large its group is. ``jax.lax.ragged_dot`` is not used: it is dense on CPU (M x G x N work)
and its result changes with the group sizes.

Weights are dequantized to bfloat16 one expert at a time inside the loop (exact for FP8 x E8M0 and
FP4 x E8M0, whose values have at most 3 mantissa bits), and the dot accumulates in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_gemm.config import GroupedMatmulConfig, check_inputs
from pallas_kernels.grouped_gemm.plan import make_tile_plan, scatter_back, take_rows
from pallas_kernels.grouped_gemm.reference import dequantize


def grouped_matmul_xla(x_mk: jax.Array, w: jax.Array, group_ids_m: jax.Array, w_scale: jax.Array | None = None,
                       *, out_dtype=jnp.bfloat16, config: GroupedMatmulConfig = GroupedMatmulConfig()) -> jax.Array:
    """-> y_mn [M, N]. Same contract as ``pallas_kernels.grouped_gemm.grouped_matmul``."""
    _, g, n, _ = check_inputs(x_mk, w, group_ids_m, w_scale)
    m = x_mk.shape[0]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    bm = config.xla_block_m
    plan = make_tile_plan(group_ids_m, g, bm)
    x_tbk = take_rows(x_mk, plan.row_src).reshape(-1, bm, x_mk.shape[1])   # padded, group-sorted rows

    def tile(args):
        x_bk, grp = args
        grp = jnp.maximum(grp, 0)        # unused tiles compute garbage that no row reads
        w_nk = dequantize(w[grp], None if w_scale is None else w_scale[grp]).astype(jnp.bfloat16)
        return jnp.einsum("bk,nk->bn", x_bk, w_nk, preferred_element_type=jnp.float32)

    y_tbn = jax.lax.map(tile, (x_tbk, plan.tile_group))
    return scatter_back(y_tbn.reshape(-1, n), plan, out_dtype)
