"""Float64 numpy reference of DeepSeek-V4-Flash's MTP layer (architecture spec §3.6), for tests.

Written from the spec, importing nothing from ``deepinfer_jax``. V4 keeps V4.1's definitions of RMSNorm,
RoPE, the mHC mixes, sink attention and the sqrt-softplus MoE (§3: "everything not listed here is as in
§2"), so those come from ``numpy_v41``; what is V4's own is here: the per-head query norm (§3.2), the
standard (not delayed) mHC block (§3.4), the hc_head collapse (§3.5) and the MTP wiring (§3.6):

    e = RMS(embed[id_{t+1}]; enorm);  X' = e_proj(e) (every copy) + h_proj(RMS(X_t; hnorm) per copy)
    X' = block(X') at layer id 43 (SWA only, theta = rope_theta, no YaRN; MoE top-k + bias)
    logits = RMS(sum_c pre_c X'_c; norm) @ head^T,  pre = hc_head mix of X' (the MTP layer's own params)

Semantics as ``numpy_v41.reference_forward``: one causal pass over positions 0..T-1, float64 throughout,
no simulated quantization. Weights are the native names, float arrays (FP8/FP4 ones already dequantized).
"""

from __future__ import annotations

import numpy as np

from reference.numpy_v41 import (RefConfig, apply_rope, layer_rope_freqs, mhc_mixes, moe, parse_config, post_apply,
                                 pre_apply, rms_norm, sigmoid, sparse_sink_attention, window_indices)


def _swa_attention(x_td: np.ndarray, w: dict, a: str, cfg: RefConfig) -> np.ndarray:
    """A V4 SWA-only attention layer (ratio 0) whose weights live at prefix ``a`` -> [T, D]."""
    t_len, d, eps = x_td.shape[0], cfg.head_dim, cfg.norm_eps
    positions = np.arange(t_len)
    freqs = layer_rope_freqs(cfg, 0)
    qr = rms_norm(x_td @ w[f"{a}.wq_a.weight"].T, w[f"{a}.q_norm.weight"], eps)
    q = rms_norm((qr @ w[f"{a}.wq_b.weight"].T).reshape(t_len, cfg.n_heads, d), 1.0, eps)  # per head, no weight
    kv = rms_norm(x_td @ w[f"{a}.wkv.weight"].T, w[f"{a}.kv_norm.weight"], eps)
    q, kv = apply_rope(q, positions, freqs), apply_rope(kv, positions, freqs)
    o = sparse_sink_attention(q, kv, window_indices(t_len, cfg.sliding_window), w[f"{a}.attn_sink"], d**-0.5)
    o = apply_rope(o, positions, freqs, inverse=True).reshape(t_len, cfg.o_groups, -1)
    wo_a = w[f"{a}.wo_a.weight"].reshape(cfg.o_groups, cfg.o_lora_rank, -1)
    return np.einsum("tgi,gri->tgr", o, wo_a).reshape(t_len, -1) @ w[f"{a}.wo_b.weight"].T


def _v4_block(x_thd: np.ndarray, w: dict, prefix: str, cfg: RefConfig) -> np.ndarray:
    """§3.4: each sub-layer mixes from its own input stream and collapses with its own pre."""
    mix = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    for site in ("attn", "ffn"):
        pre, post, comb = mhc_mixes(x_thd, w[f"{prefix}.hc_{site}_fn"], w[f"{prefix}.hc_{site}_base"],
                                    w[f"{prefix}.hc_{site}_scale"], **mix)
        x = rms_norm(pre_apply(x_thd, pre), w[f"{prefix}.{site}_norm.weight"], cfg.norm_eps)
        y = _swa_attention(x, w, f"{prefix}.attn", cfg) if site == "attn" else moe(x, w, prefix, cfg)[0]
        x_thd = post_apply(y, x_thd, post, comb)
    return x_thd


def hc_head_pre(x_thd: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, cfg: RefConfig) -> np.ndarray:
    """§3.5: pre [T, hc] = sigmoid((fn . f) rsqrt(mean f^2 + eps) * scale + base) + hc_eps, no Sinkhorn."""
    f = x_thd.reshape(x_thd.shape[0], -1)
    m = (f @ fn.T) / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + cfg.norm_eps)
    return sigmoid(m * scale[0] + base) + cfg.hc_eps


def mtp_logits(config: dict, w: dict[str, np.ndarray], hidden_thd: np.ndarray, next_ids: np.ndarray,
               stage: int = 0) -> np.ndarray:
    """logits [T, V] of MTP stage ``stage`` from the main model's final stream X [T, hc, D] at positions
    0..T-1 and the ids of the next tokens [T]."""
    cfg = parse_config(config)
    if config["compress_ratios"][cfg.num_layers + stage] != 0:
        raise NotImplementedError("only the SWA-only MTP layer of spec §3.6 is written here")
    p, eps = f"mtp.{stage}", cfg.norm_eps
    e = rms_norm(w["embed.weight"][np.asarray(next_ids)], w[f"{p}.enorm.weight"], eps)
    h = rms_norm(hidden_thd, w[f"{p}.hnorm.weight"], eps)
    x = (e @ w[f"{p}.e_proj.weight"].T)[:, None, :] + h @ w[f"{p}.h_proj.weight"].T
    x = _v4_block(x, w, p, cfg)
    pre = hc_head_pre(x, w[f"{p}.hc_head_fn"], w[f"{p}.hc_head_base"], w[f"{p}.hc_head_scale"], cfg)
    return rms_norm(pre_apply(x, pre), w[f"{p}.norm.weight"], eps) @ w["head.weight"].T
