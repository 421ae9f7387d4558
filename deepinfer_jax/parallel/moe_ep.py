"""Expert parallelism for the routed experts: local experts for all tokens, then a fixed-order combine.

Inside ``jax.shard_map`` every device of an expert group holds E/n consecutive experts and sees all of
its data shard's tokens (tokens are replicated over the expert axes, slots are split over ``data``).
Each device runs the single-device expert function on every (token, rank) pair, with the pairs routed
elsewhere masked to weight 0 and zeroed, so it returns [M, k, D] partials in which each (m, k) entry
is non-zero on exactly one device. The combine adds the gathered partials in device-index order
(``collectives.ordered_sum``): one real term plus exact zeros, so every (m, k) term is bit-identical
to what one device computes, and ``moe`` then adds the k terms in rank order exactly as on one device.
Expert parallelism therefore never changes a bit, at any mesh or batch size.

Why not all-to-all dispatch (``ragged_all_to_all``) on one host: the token counts at decode are small,
so replicating tokens and gathering [M, k, D] results over NVLink costs little; all-to-all needs
data-dependent send sizes and worst-case receive buffers, is the collective with the open NVIDIA bugs
(spec jax_kernels_and_style.md §2.7 / §3), and would reorder each token's terms by where its experts
live unless undone with care. The price here is that every device evaluates the masked pairs too with
the gather path; a grouped-GEMM ``local_impl`` that skips zero-weight pairs removes that cost without
changing the combine.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from deepinfer_jax.model.moe import routed_experts_gather
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.parallel.collectives import flat_axis_index, ordered_sum
from deepinfer_jax.sharding import DEFAULT_RULES, ShardingError, ShardingRules, mesh_spec_of

# (p_exp, x_md, ids_mk, w_mk, limit, numerics, act_block) -> [M, k, D] in numerics.expert_out_dtype: the
# single-device expert function.
ExpertsFn = Callable[..., jax.Array]


def _spec(axes: tuple[str, ...]) -> P:
    return P(axes) if axes else P()


def routed_experts_ep(p_exp: dict, x_md: jax.Array, ids_mk: jax.Array, w_mk: jax.Array, limit: float,
                      numerics: Numerics, act_block: int, *, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                      local_impl: ExpertsFn = routed_experts_gather, combine: str = "gather") -> jax.Array:
    """Drop-in for ``routed_experts_gather`` on a mesh -> [M, k, D] in ``numerics.expert_out_dtype`` (rows
    split like the batch).

    combine="gather": all_gather + index-order sum (the default). combine="psum": a psum of the same
    partials; also exact, because each element has a single non-zero contributor and x + 0 = x in any
    order; kept to show that equivalence in the tests and as the cheaper option once verified on GPU."""
    if combine not in ("gather", "psum"):
        raise ValueError(f"combine must be 'gather' or 'psum', got {combine!r}")
    ms = mesh_spec_of(mesh)
    exp_axes = rules.mesh_axes("experts")
    batch_axes = rules.mesh_axes("batch")
    n_shards = ms.axis_size(exp_axes)
    n_experts = jax.tree.leaves(p_exp)[0].shape[0]
    if n_experts % n_shards:
        raise ShardingError(f"{n_experts} routed experts do not split over the expert axes {exp_axes} "
                            f"(size {n_shards}) of mesh {ms}")
    e_local = n_experts // n_shards

    def local(p, x, ids, w):
        lo = flat_axis_index(exp_axes) * e_local
        owned = (ids >= lo) & (ids < lo + e_local)
        r = local_impl(p, x, jnp.where(owned, ids - lo, 0), jnp.where(owned, w, 0.0), limit, numerics,
                       act_block)
        r = jnp.where(owned[..., None], r, jnp.zeros((), r.dtype))   # (one real term: exact in any dtype)
        if combine == "psum" and exp_axes:
            return jax.lax.psum(r, exp_axes)
        return ordered_sum(r, exp_axes, dtype=r.dtype)

    bspec = _spec(batch_axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(_spec(exp_axes), bspec, bspec, bspec), out_specs=bspec)(
        p_exp, x_md, ids_mk, w_mk)
