"""The V4-Flash reference-revision switch (spec §3.9, §10.7): "current" (the official reading, default)
clamps the shared expert and rounds the window / compressed KV to FP8; "initial" does neither."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ConfigError
from deepinfer_jax.model.attention import attention
from deepinfer_jax.model.cache import init_cache
from deepinfer_jax.model.moe import moe, shared_expert
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.v4_quant import fake_quant_kv_v4


@pytest.fixture(scope="module")
def revisions(tiny_v4):
    cfg, params, _ = tiny_v4
    return cfg, dataclasses.replace(cfg, v4_revision="initial"), params


def test_switch_values(revisions, tiny_cfg):
    cur, ini, _ = revisions
    assert cur.v4_revision == "current" and cur.shared_expert_clamp and cur.kv_fp8_rounding
    assert not ini.shared_expert_clamp and not ini.kv_fp8_rounding
    assert "v4_revision" not in cur.to_dict()  # not a config.json key
    ini41 = dataclasses.replace(tiny_cfg, v4_revision="initial")  # V4.1 has both fixes whatever the switch
    assert ini41.shared_expert_clamp and ini41.kv_fp8_rounding
    with pytest.raises(ConfigError, match="v4_revision"):
        dataclasses.replace(cur, v4_revision="latest")


def test_initial_revision_shared_expert_is_unclamped(revisions):
    """moe(initial) - moe(current) = shared expert unclamped - clamped; inputs large enough that the clamp
    at 10 bites. fp32 ('exact'): the two sides differ only by rounding of the sums, ~1e-6 of the scale."""
    cur, ini, params = revisions
    p = params["layers"][3]["ffn"]  # a top-k (not hash-routed) layer
    x = 40 * jax.random.normal(jax.random.key(0), (1, 6, cur.hidden_size), jnp.float32)
    num = Numerics.exact()
    m_cur, m_ini = moe(p, cur, x, num), moe(p, ini, x, num)
    xm = x.reshape(6, -1)
    d_shared = (shared_expert(p["shared_experts"], xm, None, num, cur.act_quant_block)
                - shared_expert(p["shared_experts"], xm, cur.swiglu_limit, num, cur.act_quant_block))
    scale = np.abs(np.asarray(m_cur)).max()
    np.testing.assert_allclose(np.asarray(m_ini - m_cur)[0], np.asarray(d_shared), rtol=0, atol=1e-5 * scale)
    assert np.abs(np.asarray(d_shared)).max() > 1e-2 * scale  # the clamp matters for these inputs


def _is_fp8_rounded(kv: np.ndarray, rope_dim: int) -> np.ndarray:
    """Per row: is the row already on V4's KV grid (FP8 non-RoPE dims, block 64)?"""
    kv = jnp.asarray(kv, jnp.bfloat16)
    return np.all(np.asarray(fake_quant_kv_v4(kv, rope_dim) == kv), axis=-1)


@pytest.mark.parametrize("layer", [0, 2])  # SWA window KV; ratio 4: window and compressed KV
def test_initial_revision_keeps_the_kv_unrounded(revisions, layer):
    cur, ini, params = revisions
    num = Numerics.reference(kv_quant=False)
    x = jax.random.normal(jax.random.key(1), (1, 8, cur.hidden_size), jnp.float32).astype(jnp.bfloat16)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    for cfg, rounded in ((cur, True), (ini, False)):
        cache = init_cache(cfg, 1, 16, num)
        _, win, sources = attention(params["layers"][layer]["attn"], cfg, cfg.layer_plan(layer), x, pos,
                                    cache["window"][layer], cache["sources"], {}, num)
        rows = [np.asarray(win["kv"]["values"][0])[np.asarray(win["pos"][0]) >= 0]]
        if layer == 2:
            rows.append(np.asarray(sources["layer_2"]["kv"]["values"][0, :2]))  # entries of tokens 0..3, 4..7
        for r in rows:
            assert len(r) and np.all(_is_fp8_rounded(r, cfg.qk_rope_head_dim) == rounded), (layer, cfg.v4_revision)


def test_initial_revision_has_no_deployment_cache(revisions):
    _, ini, _ = revisions
    with pytest.raises(ValueError, match="initial-revision"):
        init_cache(ini, 1, 16, Numerics.reference())
