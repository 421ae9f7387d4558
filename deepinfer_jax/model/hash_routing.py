"""Hash routing of V4-Flash's first ``num_hash_layers`` MoE layers (spec §3.3).

The experts of a token are fixed by its id: ids = tid2eid[token] (int64 [vocab, k]); only the weights
come from the router, s = sqrt(softplus(x . Wg^T)) gathered at those ids, normalised over the k picks and
scaled by routed_scaling_factor. There is no selection bias on these layers. Row-local, like ``route``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.linear import dot_f32


def hash_route(p_gate: dict, cfg: ModelConfig, x_md: jax.Array, token_ids_m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (expert ids [M, k] int32, routing weights [M, k] fp32) for tokens x [M, D] with ids [M]."""
    from deepinfer_jax.model.moe import torch_softplus  # local: moe imports this module

    logits = dot_f32(x_md, p_gate["weight"])   # fp32 logits (bf16 operands: exact products)
    scores = jnp.sqrt(torch_softplus(logits))
    # padding rows carry token id -1: clamp to a valid row, their output is never read
    ids = p_gate["tid2eid"][jnp.clip(token_ids_m, 0, cfg.vocab_size - 1)].astype(jnp.int32)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob and ids.shape[-1] > 1:
        # the official V4 code divides by the plain sum; transformers adds 1e-20, which cannot change an
        # fp32 sum of positive sqrt-softplus scores (>= ~1e-19 only for logits below -40)
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor
