"""V4-Flash variant: config plan, tensor list, transformers name map, Hadamard, chunking invariance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.tiny_configs import TINY_V4FLASH
from deepinfer_jax.checkpoint import hf_names
from deepinfer_jax.checkpoint.names import DTYPES
from deepinfer_jax.checkpoint.tensor_specs import expected_tensors
from deepinfer_jax.config import AttnMode, ModelConfig
from deepinfer_jax.model import hadamard
from deepinfer_jax.model.cache import init_cache
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.transformer import forward
from v4flash_tiny import random_native_tensors, to_transformers_tensors, write_tiny_v4flash

# The official V4-Flash root config.json (spec §1.2, later revision with expert_dtype).
REAL = json.loads((Path(__file__).parent / "fixtures" / "v4_flash_config.json").read_text())


def test_real_config_plan():
    cfg = ModelConfig.from_dict(REAL)
    plans = cfg.layer_plans
    assert [p.ratio for p in plans].count(0) == 2
    csa = [p for p in plans if p.ratio == 4]
    hca = [p for p in plans if p.ratio == 128]
    assert len(csa) == 21 and len(hca) == 20  # spec §1.2: 41 compressors, 21 indexers
    assert all(p.mode is AttnMode.FULL and p.kv_source == p.layer_id for p in csa + hca)
    assert all(p.overlap and p.has_index_query for p in csa)
    assert not any(p.overlap or p.has_index_query for p in hca)
    assert [p.layer_id for p in plans if p.hash_routed] == [0, 1, 2]
    assert cfg.quant.block == 128 and cfg.per_head_q_norm and cfg.has_hc_head and not cfg.delayed_pre_mhc


def test_real_tensor_list_matches_the_release():
    """Spec §5.3/§5.5: 69,187 tensors and exactly total_size = 159,609,485,896 bytes (MTP included)."""
    specs = expected_tensors(ModelConfig.from_dict(REAL))
    assert len(specs) == 69187
    assert sum(math.prod(s.shape) * DTYPES[s.dtype].itemsize for s in specs.values()) == 159_609_485_896
    assert specs["layers.0.ffn.gate.tid2eid"].shape == (129280, 6) and "layers.3.ffn.gate.tid2eid" not in specs
    assert specs["layers.2.attn.compressor.ape"].shape == (4, 1024)
    assert specs["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert specs["layers.2.attn.wq_a.scale"].shape == (8, 32)  # 128x128 blocks
    assert "layers.3.attn.indexer.wq_b.weight" not in specs


def test_transformers_name_map_round_trip_and_spellings():
    cfg = ModelConfig.from_dict(TINY_V4FLASH)
    for n in expected_tensors(cfg):
        assert hf_names.to_native(hf_names.to_transformers(n)) == n, n
    cases = {  # transformers' module state dict
        "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
        "model.hc_head.hc_fn": "hc_head_fn", "model.layers.0.attn_hc.fn": "layers.0.hc_attn_fn",
        "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight":
            "layers.2.attn.indexer.weights_proj.weight",
        "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight": "layers.2.attn.indexer.wq_b.weight",
        "model.layers.2.self_attn.compressor.indexer.kv_norm.weight": "layers.2.attn.indexer.compressor.norm.weight",
        "model.layers.2.self_attn.compressor.indexer.position_bias": "layers.2.attn.indexer.compressor.ape",
        "model.layers.3.self_attn.compressor.gate_proj.weight": "layers.3.attn.compressor.wgate.weight",
        "model.layers.3.self_attn.kv_norm.weight": "layers.3.attn.kv_norm.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
        # spec §5.7 spellings of HF re-uploads
        "model.layers.0.self_attn.sinks": "layers.0.attn.attn_sink", "model.hc_head_fn": "hc_head_fn",
        "model.layers.1.mlp.experts.3.gate_proj.weight": "layers.1.ffn.experts.3.w1.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv": "layers.1.ffn.experts.3.w2.scale",
        "model.layers.1.mlp.gate.tid2eid": "layers.1.ffn.gate.tid2eid",
        # native with transformers' save_pretrained prefix
        "model.layers.0.attn.wq_a.weight": "layers.0.attn.wq_a.weight",
    }
    for hf, native in cases.items():
        assert hf_names.to_native(hf) == native, hf


def test_stacked_experts_split_back():
    cfg = ModelConfig.from_dict(TINY_V4FLASH)
    native = random_native_tensors(cfg, seed=3)
    hf = to_transformers_tensors(cfg, native)
    gate_up = hf["model.layers.4.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (8, 64, 64)
    split = hf_names.split_stacked_experts("layers.4.ffn.experts.gate_up_proj", gate_up)
    np.testing.assert_array_equal(split["layers.4.ffn.experts.5.w3.weight"], native["layers.4.ffn.experts.5.w3.weight"])


def test_hadamard_is_orthonormal_sylvester():
    h = hadamard.hadamard_matrix(8)
    np.testing.assert_allclose(h @ h.T, np.eye(8), atol=1e-15)
    assert np.all(h[0] > 0) and np.array_equal(np.sign(h[1]), [1, -1] * 4)  # natural (Sylvester) order
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32)), jnp.float32)
    # fp32 matmul of 32 terms: ~1e-6 relative
    np.testing.assert_allclose(np.asarray(hadamard.rotate(hadamard.rotate(x))), np.asarray(x), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tiny_v4):
    cfg, params, _ = tiny_v4
    return cfg, params


def test_loader_rejects_missing_and_unexpected(tmp_path, tiny):
    from deepinfer_jax.checkpoint.safetensors_io import CheckpointError, write_checkpoint
    from deepinfer_jax.checkpoint.transformers_format import load_transformers_params

    cfg, _ = tiny
    ckpt = tmp_path / "bad"
    write_tiny_v4flash(ckpt, seed=0)
    hf = to_transformers_tensors(cfg, random_native_tensors(cfg, 0))
    del hf["model.layers.2.self_attn.compressor.indexer.position_bias"]
    hf["model.layers.2.self_attn.bogus.weight"] = np.zeros(2, np.float32)
    for f in ckpt.glob("*.safetensors*"):
        f.unlink()
    write_checkpoint(ckpt, hf, {n: "I64" if a.dtype == np.int64 else "F32" for n, a in hf.items()}, 1 << 30)
    with pytest.raises(CheckpointError, match=r"(?s)missing.*indexer\.compressor\.ape.*unexpected.*bogus"):
        load_transformers_params(ckpt, cfg)


def test_prefill_equals_chunked_and_token_by_token(tiny):
    """The compressors' carried rows make chunking invisible: one 140-token prefill == chunks of 7 ==
    one token at a time (covers ratio-4 overlap across chunk edges and the ratio-128 entry at 127).
    fp32 ('exact') numerics; only summation shapes differ, so agreement is ~1e-6 relative (tol 1e-5)."""
    cfg, params = tiny
    numerics = Numerics.exact()
    step = jax.jit(lambda p, c, tok, pos: forward(p, cfg, c, tok, pos, None, numerics))
    tokens = np.random.default_rng(5).integers(3, cfg.vocab_size, size=140).astype(np.int32)

    def run(chunk):
        cache = init_cache(cfg, 1, 160, numerics)
        out = []
        for s in range(0, len(tokens), chunk):
            tok = tokens[s:s + chunk]
            logits, cache = step(params, cache, jnp.asarray(tok[None]), jnp.arange(s, s + len(tok), dtype=jnp.int32)[None])
            out.append(np.asarray(logits[0]))
        return np.concatenate(out)

    full = run(140)
    scale = np.abs(full).max(-1, keepdims=True)
    for chunk in (7, 1):
        err = (np.abs(run(chunk) - full) / scale).max()
        assert err < 1e-5, f"chunk {chunk}: rel err {err:.2e}"


def test_reference_numerics_run(tiny):
    """BF16 with V4's fake-quant sites, with BF16 and with deployment-precision caches (test_kv_cache_v4.py
    compares the two)."""
    cfg, params = tiny
    tok = jnp.asarray(np.arange(3, 23, dtype=np.int32)[None])
    pos = jnp.arange(20, dtype=jnp.int32)[None]
    for numerics in (Numerics.reference(kv_quant=False), Numerics.reference()):
        logits, _ = forward(params, cfg, init_cache(cfg, 1, 32, numerics), tok, pos, None, numerics)
        assert np.isfinite(np.asarray(logits)).all()
