"""An official-layout V4-Flash checkpoint with FP8 128x128 weight blocks (spec §3.1, §5.3, §5.4), written
by the repository's generator (checkpoints/make_tiny.make_tensors + safetensors_io.write_checkpoint),
loaded by the official loader, its weights dequantized as the model does and checked against the fp32
weights they were quantized from."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.make_tiny import make_tensors
from checkpoints.tiny_configs import TINY_V4FLASH
from deepinfer_jax.checkpoint.formats import dequant_fp8_block
from deepinfer_jax.checkpoint.loader import load_params
from deepinfer_jax.checkpoint.names import param_path
from deepinfer_jax.checkpoint.safetensors_io import write_checkpoint
from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, DSPARK, expected_tensors
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.cache import init_cache
from deepinfer_jax.model.linear import weight_of
from deepinfer_jax.model.mtp import init_mtp_cache, mtp_forward
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.transformer import forward_hidden, lm_head

# Weights of several 128-blocks and partial edge blocks (shared w1 [96, 384]: 1 x 3 blocks, the first
# partial; w2 [384, 96]; e_proj [384, 384]: 3 x 3), and one layer of each kind: SWA (hash-routed), ratio
# 4, ratio 128, the MTP layer. Every GEMM input K is a multiple of 128 or shorter than one block, as the
# reference's activation quantizer requires (hidden 384, q_lora 128, o_groups x o_lora 128, inter 96).
SMALL_V4 = {**TINY_V4FLASH, "vocab_size": 300, "hidden_size": 384, "num_hidden_layers": 3,
            "compress_ratios": [0, 4, 128, 0], "num_hash_layers": 1, "q_lora_rank": 128,
            "num_attention_heads": 2, "head_dim": 128, "qk_rope_head_dim": 64, "o_groups": 2, "o_lora_rank": 64,
            "moe_intermediate_size": 96, "n_routed_experts": 4, "index_n_heads": 2, "index_head_dim": 64}
B = 128


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(cfg, loaded params with the MTP group, {weight name: fp32 source}, stored tensors)."""
    out = tmp_path_factory.mktemp("v4flash_fp8")
    (out / "config.json").write_text(json.dumps(SMALL_V4))
    cfg = ModelConfig.from_json(out)
    sources: dict[str, np.ndarray] = {}
    tensors, dtypes = make_tensors(cfg, np.arange(cfg.vocab_size), seed=0, sources=sources)
    write_checkpoint(out, tensors, dtypes, max_shard_bytes=sum(a.nbytes for a in tensors.values()) // 3)
    return cfg, load_params(out, cfg, groups=(BACKBONE, DSPARK), progress=False), sources, tensors


def _leaf(params: dict, name: str) -> dict:
    """The param dict of linear ``name`` (``....weight``); routed experts stay stacked [E, ...]."""
    path, _ = param_path(name)
    node = params
    for k in path[:-1]:
        node = node[k]
    return node


def test_the_checkpoint_is_the_official_layout(written):
    cfg, _, _, tensors = written
    specs = expected_tensors(cfg)
    assert cfg.quant.block == B and set(tensors) == set(specs)
    fp8 = [n for n, s in specs.items() if s.dtype == "F8_E4M3"]
    for n in fp8:
        out_dim, in_dim = specs[n].shape
        assert tensors[n.removesuffix("weight") + "scale"].shape == (math.ceil(out_dim / B), math.ceil(in_dim / B))
    assert tensors["layers.0.ffn.shared_experts.w1.scale"].shape == (1, 3)  # out 96: one partial block row
    assert tensors["layers.0.ffn.shared_experts.w2.scale"].shape == (3, 1)  # in 96: one partial block column
    assert tensors["mtp.0.e_proj.scale"].shape == (3, 3)
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == np.int64 and "layers.1.ffn.gate.bias" in tensors


def test_fp8_weights_dequantize_to_their_source(written):
    """Per element, |W - source| <= max(2^-4 |source|, 2^-10 s): E4M3 keeps 3 mantissa bits (round to
    nearest: half an ulp = 2^-4 of the value) down to 2^-6 s, below that a fixed step of 2^-9 s; the
    scale is the smallest power of two with amax / s <= 448, so nothing saturates and amax / s > 224. The
    model's in-graph dequantization equals the numpy decoder at the config's block, bitwise."""
    cfg, params, sources, tensors = written
    fp8 = [n for n, s in expected_tensors(cfg).items() if s.dtype == "F8_E4M3"]
    assert len(fp8) == 3 * 8 + 1 + 8 + 2  # 8 per block (wq_a, wq_b, wkv, wo_a, wo_b, shared w1 w3 w2), CSA indexer, MTP
    for n in fp8:
        p = _leaf(params, n)
        got = np.asarray(weight_of(p, jnp.float32))
        assert np.array_equal(got, dequant_fp8_block(tensors[n], tensors[n.removesuffix("weight") + "scale"], B)), n
        src = sources[n]
        s = np.repeat(np.repeat(np.asarray(p["scale"], np.float32), B, 0), B, 1)[:src.shape[0], :src.shape[1]]
        assert np.all(np.abs(got - src) <= np.maximum(2.0**-4 * np.abs(src), 2.0**-10 * s)), n
        bo, bi = p["scale"].shape
        padded = np.zeros((bo * B, bi * B), np.float32)
        padded[:src.shape[0], :src.shape[1]] = np.abs(src)
        amax = padded.reshape(bo, B, bi, B).max(axis=(1, 3))
        ratio = amax / np.asarray(p["scale"], np.float32)  # every block, partial edge blocks included
        assert np.all((ratio > 224) & (ratio <= 448)), n
        assert np.abs(got - src).max() > 0, n  # quantized, not stored as is


def test_fp4_experts_dequantize_to_their_source(written):
    """Routed experts stay FP4 with 1x32 E8M0 scales (V4 too): |W - source| <= max(|source|, s) / 4 (the
    E2M1 grid's gap is at most half the value above 1 and 0.5 below it, in units of s)."""
    cfg, params, sources, _ = written
    for layer in ("layers.0", "layers.2", "mtp.0"):
        for w in ("w1", "w2", "w3"):
            stacked = _leaf(params, f"{layer}.ffn.experts.0.{w}.weight")
            got = np.asarray(weight_of(stacked, jnp.float32))  # [E, out, in]
            assert got.shape[0] == cfg.n_routed_experts
            for e in range(cfg.n_routed_experts):
                src = sources[f"{layer}.ffn.experts.{e}.{w}.weight"]
                s = np.repeat(np.asarray(stacked["scale"][e], np.float32), 32, axis=1)
                assert np.all(np.abs(got[e] - src) <= np.maximum(np.abs(src), s) / 4), (layer, w, e)


def test_the_model_runs_from_the_fp8_checkpoint(written):
    """Prefill at reference numerics (128-wide activation blocks, FP8/FP4 KV caches), then the MTP layer
    on the final stream: finite logits that depend on the input."""
    cfg, params, _, _ = written
    numerics = Numerics.reference()
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, size=(1, 20)), jnp.int32)
    pos = jnp.arange(20, dtype=jnp.int32)[None]

    def run(p, tok):
        h, _, states = forward_hidden(p, cfg, init_cache(cfg, 1, 32, numerics), tok, pos, None, numerics,
                                      return_layer_states=True)
        mtp_logits, _ = mtp_forward(p, cfg, init_mtp_cache(cfg, 1, numerics), states[-1], jnp.roll(tok, -1, 1), pos,
                                    numerics)
        return lm_head(p, h), mtp_logits

    logits, mtp_logits = jax.jit(run)(params, tokens)
    assert np.isfinite(np.asarray(logits)).all() and np.isfinite(np.asarray(mtp_logits)).all()
    assert np.asarray(logits).std(-1).min() > 0.1 and np.asarray(mtp_logits).std(-1).min() > 0.1
