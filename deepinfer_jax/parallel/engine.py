"""The engine on a mesh: the scheduler's model functions with the rules table's shardings.

``mesh_model_fns(ctx)`` is a drop-in ``engine.scheduler.ModelFns``: the scheduler's jitted prefill and
decode steps stay as they are and run SPMD over ``ctx.mesh`` (jit takes the input shardings from the
placed params and state, and these functions pin the shardings the rules give):

* ``hidden`` runs ``forward_hidden(..., parallel=ctx)`` (tensor-parallel attention, expert-parallel MoE,
  residual stream split over ``data`` at every block edge) and pins the new cache to its rules
  sharding (slots over ``data``), so the donated state keeps one layout step after step and nothing
  recompiles;
* ``head`` computes the LM head with the vocabulary split as the weights are (each logit is one whole
  dot over the hidden dim) and then gathers the vocabulary, so the sampler sees whole rows: its
  softmax, top-k/top-p and Gumbel-max stay row-local, split over slots only, never over the vocabulary
  (a vocabulary-split softmax would be a cross-device reduction in an order of the partitioner's
  choosing). The gather moves values, no arithmetic;
* ``init_cache`` places the cache it builds: split over ``data`` when the batch splits, replicated
  otherwise (the scheduler's one-slot empty cache, used to reset admitted slots);
* ``readable`` replicates what the host reads back (sampled tokens, logprobs, top-20, prompt logprobs)
  onto every device inside the step. When the mesh spans several processes, a slot's token lives on
  another host's devices otherwise, and every process needs every token: each runs the same scheduler
  loop, and its admissions and stop rules must stay in step with the others'. The gather moves
  [slots]- and [slots, 20]-sized values, no arithmetic, so results are bitwise those of one process.

``place_engine_state`` puts the scheduler's other per-slot state (sampler counts, seen-mask, next token,
Engram history) on the mesh with slots over ``data``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from deepinfer_jax.parallel.context import ParallelContext
from deepinfer_jax.sharding import MeshSpec, mesh_spec_of, tree_shardings, validate_model_mesh


def _batch_sharding(ctx: ParallelContext, shape: tuple[int, ...]) -> NamedSharding:
    """Leading dim over the batch axes when it splits evenly, everything else whole."""
    axes = ctx.rules.mesh_axes("batch")
    n = mesh_spec_of(ctx.mesh).axis_size(axes)
    if not shape or not axes or shape[0] % n:
        return NamedSharding(ctx.mesh, P())
    # no trailing Nones: the spec the partitioner gives the step's outputs, so a placed input and the
    # donated output it becomes are the same sharding to jit's cache (no second compile)
    return NamedSharding(ctx.mesh, P(axes[0] if len(axes) == 1 else axes))


@dataclasses.dataclass(frozen=True)
class MeshHidden:
    """``ModelFns.hidden`` on the mesh (hashable: the scheduler caches its compiled steps by it)."""

    ctx: ParallelContext

    def __call__(self, params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics, replay_mask_bt=None,
                 *, part="all", carry=None):
        from deepinfer_jax.model.transformer import forward_hidden

        h, new_cache = forward_hidden(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics,
                                      replay_mask_bt, parallel=self.ctx, part=part, carry=carry)
        new_cache = jax.lax.with_sharding_constraint(
            new_cache, tree_shardings(new_cache, self.ctx.mesh, self.ctx.rules, cfg))
        return h, new_cache


@dataclasses.dataclass(frozen=True)
class MeshHead:
    """``ModelFns.head`` on the mesh: fp32 logits, slots over ``data``, the vocabulary whole."""

    ctx: ParallelContext

    def __call__(self, params, h_btd):
        from deepinfer_jax.model.transformer import lm_head

        logits = lm_head(params, h_btd)
        return jax.lax.with_sharding_constraint(logits, _batch_sharding(self.ctx, logits.shape))


@dataclasses.dataclass(frozen=True)
class MeshInitCache:
    """``ModelFns.init_cache`` on the mesh: the empty cache, placed."""

    ctx: ParallelContext

    def __call__(self, cfg, batch, max_len, numerics):
        from deepinfer_jax.model.cache import init_cache

        cache = init_cache(cfg, batch, max_len, numerics)
        n = mesh_spec_of(self.ctx.mesh).axis_size(self.ctx.rules.mesh_axes("batch"))
        if batch % n == 0:
            return jax.device_put(cache, tree_shardings(cache, self.ctx.mesh, self.ctx.rules, cfg))
        return jax.device_put(cache, NamedSharding(self.ctx.mesh, P()))


@dataclasses.dataclass(frozen=True)
class MeshReadable:
    """``ModelFns.readable`` on the mesh: the host-read results replicated, so every process reads them."""

    ctx: ParallelContext

    def __call__(self, tree):
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.ctx.mesh, P()))


def mesh_model_fns(ctx: ParallelContext):
    """The real model as ``engine.scheduler.ModelFns`` over ``ctx.mesh``."""
    from deepinfer_jax.engine.scheduler import REAL_MODEL

    # replace(): any other model function the scheduler grows (e.g. reset_slots, a select over the slot
    # dim) is kept as is; its output is re-pinned by MeshHidden's cache constraint in the same step.
    return dataclasses.replace(REAL_MODEL, hidden=MeshHidden(ctx), head=MeshHead(ctx), init_cache=MeshInitCache(ctx),
                               readable=MeshReadable(ctx))


def place_engine_state(state: dict, ctx: ParallelContext, cfg) -> dict:
    """The scheduler's state on the mesh: the cache by the rules, every other leaf with slots over data."""
    out = dict(state)
    for key, value in state.items():
        if key == "cache":
            out[key] = jax.device_put(value, tree_shardings(value, ctx.mesh, ctx.rules, cfg))
        else:
            out[key] = jax.tree.map(lambda x: jax.device_put(x, _batch_sharding(ctx, tuple(np.shape(x)))), value)
    return out


def mesh_scheduler(params, cfg, tokenizer, token_map, numerics, engine_config, ctx: ParallelContext, **kw):
    """An ``engine.scheduler.Scheduler`` whose steps run over ``ctx.mesh``: ``params`` placed by the rules
    (``sharding.make_place`` / ``place_tree``), the slots' state split over data."""
    from deepinfer_jax.engine.scheduler import Scheduler

    validate_model_mesh(cfg, mesh_spec_of(ctx.mesh), ctx.rules, slots=engine_config.max_slots)
    sched = Scheduler(params, cfg, tokenizer, token_map, numerics, engine_config, model=mesh_model_fns(ctx), **kw)
    # The scheduler builds its state on the default device; it is created once, in __init__.
    sched.state = place_engine_state(sched.state, ctx, cfg)
    return sched


def describe_placement(tree: Any) -> dict[str, str]:
    """path -> sharding spec of every array leaf (for logs and tests)."""
    from deepinfer_jax.sharding import path_str, tree_paths

    return {path_str(p): str(getattr(getattr(x, "sharding", None), "spec", None)) for p, x in tree_paths(tree)}


__all__ = ["MeshHidden", "MeshHead", "MeshInitCache", "MeshReadable", "mesh_model_fns", "mesh_scheduler", "place_engine_state",
           "describe_placement", "MeshSpec"]
