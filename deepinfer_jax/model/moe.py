"""MoE: sqrt-softplus router (bias for selection only), dropless routed experts, shared expert.

Routing is row-local with a fixed tie-break, and each token's top-k expert outputs are summed in rank
order, so a token's result never depends on which other tokens share its experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.linear import dense, dequant_fp4, quant_linear
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp8
from deepinfer_jax.model.selection import topk_desc


def torch_softplus(x: jax.Array) -> jax.Array:
    """softplus with torch's threshold 20 (identity above), the reference's definition."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def route(p_gate: dict, cfg: ModelConfig, x_md: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """-> (expert ids [M, k] in descending biased score, routing weights [M, k] fp32)."""
    logits = jnp.einsum("md,ed->me", x_md.astype(jnp.float32), p_gate["weight"].astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jnp.sqrt(torch_softplus(logits))
    _, ids = topk_desc(scores + p_gate["bias"].astype(jnp.float32), top_k)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


def swiglu(g: jax.Array, u: jax.Array, limit: float) -> jax.Array:
    u = jnp.clip(u, -limit, limit)
    g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u


def routed_experts_gather(p_exp: dict, x_md: jax.Array, ids_mk: jax.Array, w_mk: jax.Array, limit: float,
                          numerics: Numerics) -> jax.Array:
    """XLA path: gather each token's k experts and run them row by row -> [M, k, D] fp32.

    Memory is M*k*(3*inter*D) dequantized weights: right for CPU tests and small batches; the GPU path
    is the grouped GEMM in ``pallas_kernels``.
    """
    wdt = jnp.float32 if numerics.dtype == jnp.float32 else jnp.bfloat16

    def deq(name):
        if "scale" not in p_exp[name]:  # unquantized experts (tests, converted checkpoints)
            return p_exp[name]["weight"][ids_mk].astype(wdt)
        return dequant_fp4(p_exp[name]["weight"][ids_mk], p_exp[name]["scale"][ids_mk]).astype(wdt)

    xq = fake_quant_fp8(x_md) if numerics.fake_quant else x_md
    xq = xq.astype(wdt)
    g = jnp.einsum("md,mkid->mki", xq, deq("w1"), precision=numerics.precision, preferred_element_type=jnp.float32)
    u = jnp.einsum("md,mkid->mki", xq, deq("w3"), precision=numerics.precision, preferred_element_type=jnp.float32)
    hid = swiglu(g, u, limit) * w_mk[..., None]
    hid = hid.astype(numerics.dtype)
    if numerics.fake_quant:
        hid = fake_quant_fp8(hid)
    return jnp.einsum("mki,mkdi->mkd", hid.astype(wdt), deq("w2"), precision=numerics.precision,
                      preferred_element_type=jnp.float32)


def shared_expert(p: dict, x_md: jax.Array, limit: float, numerics: Numerics) -> jax.Array:
    g = quant_linear(x_md, p["w1"], numerics, jnp.float32)
    u = quant_linear(x_md, p["w3"], numerics, jnp.float32)
    hid = swiglu(g, u, limit).astype(numerics.dtype)
    return quant_linear(hid, p["w2"], numerics, jnp.float32)


def moe(p: dict, cfg: ModelConfig, x_btd: jax.Array, numerics: Numerics, top_k: int | None = None,
        experts_impl=None) -> jax.Array:
    """experts_impl: a replacement for ``routed_experts_gather`` with its signature (e.g. the
    expert-parallel ``parallel.moe_ep``); None = the single-device gather path."""
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)
    ids, w = route(p["gate"], cfg, x, top_k or cfg.num_experts_per_tok)
    routed = (experts_impl or routed_experts_gather)(p["experts"], x, ids, w, cfg.swiglu_limit, numerics)
    y = shared_expert(p["shared_experts"], x, cfg.swiglu_limit, numerics)
    for k in range(routed.shape[1]):  # fixed rank order, not a tree chosen by the compiler
        y = y + routed[:, k]
    return y.astype(numerics.dtype).reshape(b, t, d)


__all__ = ["moe", "route", "swiglu", "dense"]
