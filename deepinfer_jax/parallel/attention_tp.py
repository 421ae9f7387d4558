"""Tensor parallelism for one attention layer: query heads and output groups split over ``tensor``.

The whole layer runs inside ``jax.shard_map``: each device computes the queries of its H/t heads, the
softmax over the (replicated) shared K=V latent, the grouped output projection of its g/t groups and
its slice of ``wo_b``'s input columns, which leaves a partial [B, T, D] sum per device. Those partials
are added in device-index order (``collectives.ordered_sum``), so a given mesh always sums the same
way at every batch size. The single KV head, the compressor, the indexer and every cache are the same
on each tensor device (MQA: nothing to split), and slots stay split over ``data``.

The one reduction split across devices is that of ``wo_b`` over its g*o_lora_rank inputs: t fp32
partial dots (rounded to the activation dtype by ``quant_linear``) plus their sum, against one dot
on one device; that is the only place tensor parallelism changes bits (docs in tests/test_sharding.py).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, PartitionSpec as P

from deepinfer_jax.config import LayerPlan, ModelConfig
from deepinfer_jax.model.attention import attention
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.parallel.collectives import ordered_sum
from deepinfer_jax.sharding import DEFAULT_RULES, ShardingRules, leaf_spec, mesh_spec_of, tree_paths, \
    validate_model_mesh


def _spec(axes: tuple[str, ...]) -> P:
    return P(axes) if axes else P()


def attention_tp(p: dict, cfg: ModelConfig, plan: LayerPlan, x_btd: jax.Array, pos_bt: jax.Array,
                 layer_cache: dict, source_caches: dict, published: dict, numerics: Numerics, *, mesh: Mesh,
                 rules: ShardingRules = DEFAULT_RULES) -> tuple[jax.Array, dict, dict]:
    """Same contract as ``model.attention.attention`` (``published`` is updated in place)."""
    ms = mesh_spec_of(mesh)
    validate_model_mesh(cfg, ms, rules)
    head_axes = rules.mesh_axes("heads")
    t = ms.axis_size(head_axes)
    local_cfg = cfg if t == 1 else dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // t, o_groups=cfg.o_groups // t)
    # Block-relative axes are the same for backbone layers and DSpark stages; the prefix only names them.
    flat, treedef = jax.tree_util.tree_flatten(p)
    p_specs = jax.tree_util.tree_unflatten(treedef, [
        leaf_spec(("layers", plan.layer_id, "attn") + path, leaf.shape, ms, rules) for path, leaf in tree_paths(p)])
    bspec = _spec(rules.mesh_axes("batch"))

    def local(p_loc, x, pos, win, sources, pub_in):
        pub = dict(pub_in)
        out, new_win, new_sources = attention(p_loc, local_cfg, plan, x, pos, win, sources, pub, numerics)
        # Also at t = 1: the gather of one shard is exact and tells shard_map the result is replicated.
        out = ordered_sum(out, head_axes).astype(out.dtype)
        return out, new_win, new_sources, pub

    out, new_win, new_sources, new_pub = jax.shard_map(
        local, mesh=mesh, in_specs=(p_specs, bspec, bspec, bspec, bspec, bspec), out_specs=bspec)(
        p, x_btd, pos_bt, layer_cache, source_caches, dict(published))
    published.update(new_pub)
    return out, new_win, new_sources
