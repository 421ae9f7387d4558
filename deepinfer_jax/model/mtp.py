"""V4-Flash's multi-token-prediction layer ``mtp.{s}`` (spec §3.6; layer id num_hidden_layers + s = 43):
given the main model's final 4-stream state X_t (after the last block, before hc_head) and the id of
token t+1, predict token t+2.

    e  = RMS(embed[id_{t+1}]; enorm)                           (the backbone's embedding, shared)
    X' = e_proj(e) (broadcast over the hc copies) + h_proj(RMS(X_t; hnorm))    (hnorm per copy; FP8 linears)
    X' = one standard V4 block at layer id 43 (SWA only, its own window ring; MoE routed by top-k + bias)
    logits = head(RMS(hc_head mix of X'; norm))                 (the MTP layer's own hc_head_* and norm;
                                                                 the backbone's head, shared)
Its attention sees the same positions as the main model (position t for row t). The weights load with
the ``DSPARK`` tensor group (``load_params(..., groups=(BACKBONE, DSPARK))``) into ``params["mtp"]``. Not
wired into speculative decoding: this is the forward only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import AttnMode, ModelConfig
from deepinfer_jax.model import kv_codec
from deepinfer_jax.model.cache import init_leaf
from deepinfer_jax.model.linear import quant_linear
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.transformer import block_step, head_input, lm_head


def _check(cfg: ModelConfig, stage: int) -> int:
    """-> the stage's layer id; refuses what this module does not implement."""
    if cfg.variant != "v4":
        raise NotImplementedError("mtp.py is V4-Flash's MTP layer; V4.1's DSpark draft head is another "
                                  "architecture (spec §2.7)")
    if not 0 <= stage < cfg.num_nextn_predict_layers:
        raise ValueError(f"MTP stage {stage} out of range [0, {cfg.num_nextn_predict_layers})")
    layer_id = cfg.num_hidden_layers + stage
    if cfg.layer_plan(layer_id).mode is not AttnMode.SWA:
        raise NotImplementedError(f"MTP layer {layer_id} has compress ratio {cfg.compress_ratios[layer_id]}; "
                                  "only the official SWA-only MTP layer (ratio 0) is implemented")
    return layer_id


def mtp_cache_shapes(cfg: ModelConfig, batch: int, numerics: Numerics) -> tuple[dict, ...]:
    """Per stage: its window ring {"kv" [B, W, head_dim] storage (kv_codec), "pos" [B, W]} (ShapeDtypeStructs)."""
    w = cfg.sliding_window
    ring = kv_codec.layouts(cfg).window
    out = []
    for stage in range(cfg.num_nextn_predict_layers):
        _check(cfg, stage)
        out.append({"kv": kv_codec.stored_shapes(ring, (batch, w), cfg.head_dim, numerics.kv_quant, numerics.dtype),
                    "pos": jax.ShapeDtypeStruct((batch, w), jnp.int32)})
    return tuple(out)


def init_mtp_cache(cfg: ModelConfig, batch: int, numerics: Numerics) -> tuple[dict, ...]:
    return jax.tree.map(init_leaf, mtp_cache_shapes(cfg, batch, numerics))


def mtp_forward(params: dict, cfg: ModelConfig, mtp_cache: tuple[dict, ...], hidden_bthd: jax.Array,
                next_tokens_bt: jax.Array, positions_bt: jax.Array, numerics: Numerics,
                stage: int = 0) -> tuple[jax.Array, tuple[dict, ...]]:
    """-> (logits [B, T, V] fp32 for token t+2, new MTP cache).

    hidden_bthd: the main model's final stream X [B, T, hc, D] at positions_bt [B, T] (-1 = padding), as
    ``forward_hidden(..., return_layer_states=True)`` returns last; next_tokens_bt: the ids of token t+1."""
    layer_id = _check(cfg, stage)
    p = params["mtp"][stage]
    dt, eps, ab = numerics.dtype, cfg.rms_norm_eps, cfg.act_quant_block
    e = rms_norm(params["embed"]["weight"][next_tokens_bt].astype(dt), p["enorm"]["weight"], eps, dt)
    h = rms_norm(hidden_bthd.astype(dt), p["hnorm"]["weight"], eps, dt)
    x = (quant_linear(e, p["e_proj"], numerics, act_block=ab)[:, :, None, :]
         + quant_linear(h, p["h_proj"], numerics, act_block=ab)).astype(dt)
    x, _, ring, _ = block_step(p, cfg, cfg.layer_plan(layer_id), x, None, positions_bt, mtp_cache[stage], {}, {},
                               numerics, tokens_bt=next_tokens_bt)
    logits = lm_head(params, head_input(p, cfg, x, None, numerics))
    return logits, tuple(ring if i == stage else c for i, c in enumerate(mtp_cache))
