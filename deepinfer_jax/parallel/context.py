"""ParallelContext: the mesh and rules that ``model.transformer.forward(..., parallel=ctx)`` runs under.

The model stays single-device code; the context supplies the three places where the mesh matters:
the residual stream's sharding at block edges (slots over ``data``, everything else whole), the
tensor-parallel attention and the expert-parallel routed experts. ``sharded_step`` jits one model step
with the param, cache, input and logits shardings of the rules table.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.moe import routed_experts_gather
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.parallel.attention_tp import attention_tp
from deepinfer_jax.parallel.moe_ep import routed_experts_ep
from deepinfer_jax.sharding import DEFAULT_RULES, ShardingRules, mesh_spec_of, tree_shardings, validate_model_mesh


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    mesh: Mesh
    rules: ShardingRules = DEFAULT_RULES
    experts_local_impl: Callable = routed_experts_gather  # swap in a grouped-GEMM kernel here
    ep_combine: str = "gather"

    def __post_init__(self):
        mesh_spec_of(self.mesh)  # checks the axis names
        self.rules.validate()

    def batch_spec(self, rank: int = 1) -> P:
        axes = self.rules.mesh_axes("batch")
        return P(axes if axes else None, *([None] * (rank - 1)))

    def constrain_stream(self, x: jax.Array) -> jax.Array:
        """Batch-first activation at a block edge: slots split over ``data``, every other dim whole, so
        no op downstream can be partitioned along a dim it contracts."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.batch_spec(x.ndim)))

    def batch_local(self, fn: Callable) -> Callable:
        """fn (batch-first arrays in and out, rows independent) run on each device's own slots. For
        kernels GSPMD cannot partition (a Pallas call): it would otherwise gather every device's rows
        and run the whole batch on each device."""
        spec = self.batch_spec()
        # check_vma off: jax 0.12's pad rule asserts on a replicated pad value beside a varying operand
        # (the kernels' wrappers pad rows to whole blocks); fn sees only its own rows either way.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=spec, out_specs=spec, check_vma=False)

    def attention(self, p, cfg, plan, x_btd, pos_bt, layer_cache, source_caches, published, numerics):
        return attention_tp(p, cfg, plan, x_btd, pos_bt, layer_cache, source_caches, published, numerics,
                            mesh=self.mesh, rules=self.rules)

    def routed_experts(self, p_exp, x_md, ids_mk, w_mk, limit, numerics, act_block):
        return routed_experts_ep(p_exp, x_md, ids_mk, w_mk, limit, numerics, act_block, mesh=self.mesh,
                                 rules=self.rules, local_impl=self.experts_local_impl, combine=self.ep_combine)

    def logits_sharding(self) -> NamedSharding:
        vocab = self.rules.mesh_axes("vocab")
        return NamedSharding(self.mesh, P(*self.batch_spec(2), vocab if vocab else None))


def sharded_step(ctx: ParallelContext, cfg: ModelConfig, numerics: Numerics, params, cache, *,
                 with_replay_mask: bool = False, donate_cache: bool = True):
    """A jitted ``step(params, cache, tokens_bt, positions_bt, engram_rows_btnc[, replay_mask_bt])`` ->
    (logits_btv, new cache) with the rules' shardings on every input and output; the input cache is
    donated (updated in place) unless ``donate_cache=False``.

    ``params`` and ``cache`` may be arrays or ShapeDtypeStructs (only their structure and shapes are read).
    Place them first with ``jax.device_put(tree, tree_shardings(tree, ctx.mesh, ctx.rules, cfg))``."""
    from deepinfer_jax.model.transformer import forward

    slots = jax.tree.leaves(cache)[0].shape[0]
    validate_model_mesh(cfg, mesh_spec_of(ctx.mesh), ctx.rules, slots=slots)
    p_sh = tree_shardings(params, ctx.mesh, ctx.rules, cfg)
    c_sh = tree_shardings(cache, ctx.mesh, ctx.rules, cfg)
    b2 = NamedSharding(ctx.mesh, ctx.batch_spec(2))
    b4 = NamedSharding(ctx.mesh, ctx.batch_spec(4))

    if with_replay_mask:
        def step(params, cache, tokens_bt, positions_bt, engram_rows_btnc, replay_mask_bt):
            return forward(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics, replay_mask_bt,
                           parallel=ctx)
        in_sh = (p_sh, c_sh, b2, b2, b4, b2)
    else:
        def step(params, cache, tokens_bt, positions_bt, engram_rows_btnc):
            return forward(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics, parallel=ctx)
        in_sh = (p_sh, c_sh, b2, b2, b4)
    from deepinfer_jax.platform import step_compiler_options

    return jax.jit(step, in_shardings=in_sh, out_shardings=(ctx.logits_sharding(), c_sh),
                   donate_argnums=(1,) if donate_cache else (), compiler_options=step_compiler_options() or None)
