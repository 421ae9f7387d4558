"""The V4.1 / V4-Flash forward pass as pure functions: ``forward(params, cfg, cache, tokens, positions, ...)``.

One call processes T tokens for each of B slots at their own absolute positions (prefill chunks and
decode steps alike); rows with position -1 are padding and write nothing. Layers run in order, a
Python loop over the per-layer plan: roles differ by layer, so there is no scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import LayerPlan, ModelConfig
from deepinfer_jax.model import engram, hc_head, mhc
from deepinfer_jax.model.attention import attention
from deepinfer_jax.model.linear import dot_f32
from deepinfer_jax.model.moe import moe
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.numerics import Numerics, kernel_route
from pallas_kernels.sinkhorn import kernel_unsupported_reason as sinkhorn_unsupported

__all__ = ["Numerics", "block_step", "forward", "forward_hidden", "head_input", "lm_head"]


def _mix(p: dict, site: str, x_bthd: jax.Array, cfg: ModelConfig, numerics: Numerics, parallel=None):
    route, impl = kernel_route(numerics, "sinkhorn", "sinkhorn_rounds", sinkhorn_unsupported(cfg.hc_mult))
    with jax.named_scope(f"mhc_{site}"):
        return mhc.mixes(x_bthd, p[f"hc_{site}_fn"], p[f"hc_{site}_base"], p[f"hc_{site}_scale"],
                         norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters,
                         unroll=numerics.unroll_sinkhorn(), segment_rows=numerics.sinkhorn_segment_rows,
                         bf16_dot=numerics.bf16_stream_dot(), sinkhorn_impl=impl if route == "op" else None,
                         rows_local=getattr(parallel, "batch_local", None) if route == "op" else None,
                         fn_parts=p.get(f"hc_{site}_fn{mhc.SPLIT_SUFFIX}"), pdl=numerics.kernel_pdl)


def block(p: dict, cfg: ModelConfig, layer_id: int, x_bthd: jax.Array, carried_pre: jax.Array, pos_bt: jax.Array,
          cache: dict, published: dict, numerics: Numerics, parallel=None, tokens_bt: jax.Array | None = None):
    """Backbone block ``layer_id`` on the whole cache: -> (stream [B, T, hc, D], pre to carry, new cache)."""
    x_bthd, f_pre, new_win, sources = block_step(p, cfg, cfg.layer_plan(layer_id), x_bthd, carried_pre, pos_bt,
                                                 cache["window"][layer_id], cache["sources"], published, numerics,
                                                 parallel, tokens_bt)
    window = tuple(new_win if i == layer_id else w for i, w in enumerate(cache["window"]))
    return x_bthd, f_pre, {"window": window, "sources": sources}


def block_step(p: dict, cfg: ModelConfig, plan: LayerPlan, x_bthd: jax.Array, carried_pre: jax.Array | None,
               pos_bt: jax.Array, window_cache: dict, sources: dict, published: dict, numerics: Numerics,
               parallel=None, tokens_bt: jax.Array | None = None):
    """One block on its own window ring -> (stream [B, T, hc, D], FFN pre [B, T, hc], new ring, sources).

    V4.1 (delayed-pre mHC): attention collapses with the carried pre, the FFN with the attention site's
    pre, and the FFN site's pre is carried to the next block. V4 (cfg.delayed_pre_mhc off): each site
    collapses with its own pre; the carried pre is unused (None is fine).

    parallel: a ``parallel.ParallelContext`` (mesh-parallel attention and routed experts) or None; any
    object with its ``attention`` and ``routed_experts`` methods will do (notebooks record selections
    that way), ``batch_local`` being optional.
    tokens_bt: the token ids, needed by hash-routed MoE layers (V4's first num_hash_layers)."""
    dt = numerics.dtype
    eps = cfg.rms_norm_eps
    a_pre, a_post, a_comb = _mix(p, "attn", x_bthd, cfg, numerics, parallel)
    attn_pre = carried_pre if cfg.delayed_pre_mhc else a_pre
    x = rms_norm(mhc.pre_apply(x_bthd, attn_pre, dt), p["attn_norm"]["weight"], eps, dt)
    attend = attention if parallel is None else parallel.attention
    with jax.named_scope("attention"):
        attn_out, new_win, sources = attend(p["attn"], cfg, plan, x, pos_bt, window_cache, sources, published,
                                            numerics)
    x_bthd = mhc.post_apply(attn_out, x_bthd, a_post, a_comb, dt)
    f_pre, f_post, f_comb = _mix(p, "ffn", x_bthd, cfg, numerics, parallel)
    x = rms_norm(mhc.pre_apply(x_bthd, a_pre if cfg.delayed_pre_mhc else f_pre, dt), p["ffn_norm"]["weight"], eps, dt)
    experts_impl = None if parallel is None else parallel.routed_experts
    hash_ids = tokens_bt.reshape(-1) if plan.hash_routed else None
    with jax.named_scope("moe"):
        ffn_out = moe(p["ffn"], cfg, x, numerics, experts_impl=experts_impl, token_ids=hash_ids)
    x_bthd = mhc.post_apply(ffn_out, x_bthd, f_post, f_comb, dt)
    return x_bthd, f_pre, new_win, sources


PARTS = ("all", "lower", "upper")


def forward_hidden(params: dict, cfg: ModelConfig, cache: dict, tokens_bt: jax.Array, positions_bt: jax.Array,
                   engram_rows_btnc: jax.Array | None, numerics: Numerics, replay_mask_bt: jax.Array | None = None,
                   return_layer_states: bool = False, parallel=None, *, part: str = "all", carry=None):
    """-> (h_btd after the final norm, new cache[, per-layer 4-stream states [L] of [B,T,hc,D]]).

    parallel: a ``parallel.ParallelContext`` to run over its mesh (None: single device).
    part: "all" runs every layer; "lower" runs the layers up to the last KV-source layer and returns
    (carry, new cache) instead of h; "upper" continues from that carry with the layers above it (the
    ones bounded replay restricts) -> (h, new cache). The engine runs the two parts as two programs so
    that a prefill step whose rows all lie before their replay window skips the upper layers entirely
    (spec §7), while every row's lower layers are always computed by the same program."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    edge = (lambda a: a) if parallel is None else parallel.constrain_stream
    dt = numerics.dtype
    last_source = max(cfg.kv_source_layer_ids, default=-1)
    if part == "upper":
        if carry is None:
            raise ValueError('part="upper" needs the carry returned by part="lower"')
        x_bthd, pre, published = carry
        published = dict(published)
        layers = range(last_source + 1, cfg.num_hidden_layers)
    else:
        b, t = tokens_bt.shape
        hc = cfg.hc_mult
        e = params["embed"]["weight"][tokens_bt].astype(dt)
        x_bthd = edge(jnp.broadcast_to(e[:, :, None, :], (b, t, hc, e.shape[-1])))
        pre = jnp.broadcast_to(jax.nn.one_hot(0, hc, dtype=jnp.float32), (b, t, hc))
        published = {}
        layers = range(cfg.num_hidden_layers if part == "all" else last_source + 1)
    upper_pos = positions_bt if replay_mask_bt is None else jnp.where(replay_mask_bt, positions_bt, -1)
    states = []
    for layer_id in layers:
        if layer_id in cfg.engram_layer_ids:
            rows = engram_rows_btnc[:, :, cfg.engram_layer_ids.index(layer_id)]
            x_bthd = edge(engram.inject(params["layers"][layer_id]["engram"], x_bthd, rows, eps=cfg.rms_norm_eps,
                                        numerics=numerics, act_block=cfg.act_quant_block))
        pos = positions_bt if layer_id <= last_source else upper_pos
        with jax.named_scope(f"layer{layer_id}"):  # profiles and HLO dumps name each kernel's layer
            x_bthd, pre, cache = block(params["layers"][layer_id], cfg, layer_id, x_bthd, pre, pos, cache,
                                       published, numerics, parallel, tokens_bt=tokens_bt)
        x_bthd = edge(x_bthd)
        if return_layer_states:
            states.append(x_bthd)
    if part == "lower":
        return (x_bthd, pre, published), cache
    h = edge(head_input(params, cfg, x_bthd, pre, numerics))
    if return_layer_states:
        return h, cache, states
    return h, cache


def head_input(p: dict, cfg: ModelConfig, x_bthd: jax.Array, carried_pre: jax.Array | None,
               numerics: Numerics) -> jax.Array:
    """The final collapse of the stream [B, T, hc, D] and its norm -> h [B, T, D]. V4: a learned mix from
    p's ``hc_head_*`` (the model's, or an MTP layer's own, spec §3.5-3.6); V4.1: the carried pre. Then
    RMS with ``p["norm"]``."""
    pre = carried_pre
    if cfg.has_hc_head:
        pre = hc_head.hc_head_pre(x_bthd, p["hc_head_fn"], p["hc_head_base"], p["hc_head_scale"],
                                  norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, bf16_dot=numerics.bf16_stream_dot(),
                                  fn_parts=p.get(f"hc_head_fn{mhc.SPLIT_SUFFIX}"))
    dt = numerics.dtype
    return rms_norm(mhc.pre_apply(x_bthd, pre, dt), p["norm"]["weight"], cfg.rms_norm_eps, dt)


def lm_head(params: dict, h_btd: jax.Array) -> jax.Array:
    """fp32 logits (the head is stored BF16 and used in fp32, untied from the embedding; ``dot_f32``
    runs bf16 h on the bf16 head without an fp32 copy, same products)."""
    return dot_f32(h_btd, params["head"]["weight"])


def forward(params: dict, cfg: ModelConfig, cache: dict, tokens_bt: jax.Array, positions_bt: jax.Array,
            engram_rows_btnc: jax.Array | None, numerics: Numerics, replay_mask_bt: jax.Array | None = None,
            *, parallel=None):
    """-> (logits_btv fp32, new cache). parallel: see ``forward_hidden``."""
    h, cache = forward_hidden(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics,
                              replay_mask_bt, parallel=parallel)
    return lm_head(params, h), cache
