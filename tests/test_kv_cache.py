"""KV caches at deployment precision: codecs vs the fake-quantizers, bytes per token, model equality."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model import kv_codec
from deepinfer_jax.model.cache import cache_bytes, cache_shapes
from deepinfer_jax.model.numerics import (Numerics, fake_quant_fp4_e4m3, fake_quant_fp4_pow2, fake_quant_fp8)
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "v41_flash_config.json"


@pytest.mark.parametrize("kind,fq", [(kv_codec.WINDOW, fake_quant_fp8), (kv_codec.COMPRESSED, fake_quant_fp4_e4m3),
                                     (kv_codec.INDEX_K, fake_quant_fp4_pow2)])
def test_codec_decodes_to_the_fake_quant_values_bitwise(kind, fq):
    x = jax.random.normal(jax.random.key(0), (3, 5, 128), jnp.float32) * jnp.logspace(-3, 2, 128)
    stored = kv_codec.encode(kind, x, True, jnp.bfloat16)
    got = kv_codec.decode(kind, stored, jnp.float32)
    want = fq(x)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    # exact in bf16 too: a bf16 cache of fake-quantized values holds the same numbers
    assert np.array_equal(np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(want))


def test_fp4_packing_hand_case():
    # one block of 16 values with amax 6 -> scale e4m3(1.0) = 1; codes per the E2M1 table, low nibble first
    x = jnp.array([[0, .5, 1, 1.5, 2, 3, 4, 6, -0.25, -.5, -1, -1.5, -2, -3, -4, -6]], jnp.float32)
    stored = kv_codec.encode(kv_codec.COMPRESSED, x, True, jnp.bfloat16)
    assert stored["scale"].astype(jnp.float32).tolist() == [[1.0]]
    # -0.25 rounds to -0 (tie to even), code 8
    assert np.asarray(stored["values"]).tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]


def test_bytes_per_token_full_config():
    cfg = ModelConfig.from_json(FIXTURE)
    q = Numerics.reference(kv_quant=True)
    b = Numerics.reference(kv_quant=False)
    n1, n2 = 4096, 8192  # per-token growth = difference / 4096 tokens (window rings are constant)
    per_tok_q = (cache_bytes(cfg, 1, n2, q) - cache_bytes(cfg, 1, n1, q)) / (n2 - n1)
    per_tok_b = (cache_bytes(cfg, 1, n2, b) - cache_bytes(cfg, 1, n1, b)) / (n2 - n1)
    assert per_tok_q == 890  # spec §4.1: 2.5 entries/token x (288 + 68) B
    assert per_tok_b == 3200  # 2.5 x (1024 + 256) B in BF16
    # the SWA ring: 528 B per slot at deployment precision, 128 slots, 40 layers
    ring = sum(np.prod(s.shape) * s.dtype.itemsize
               for w in cache_shapes(cfg, 1, n1, q)["window"] for s in jax.tree.leaves(w["kv"]))
    assert ring == 40 * 128 * 528


def test_quantized_cache_leaves_results_unchanged(tiny_params, tiny_cfg, tiny_token_map):
    """Bitwise on CPU, and on GPU with --xla_allow_excess_precision=false (XLA's default keeps some bf16
    intermediates in fp32 depending on fusion, which is not a property of the cache format)."""
    from test_model_consistency import _prompts, run_chunks

    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    q = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, Numerics.reference(kv_quant=True))
    b = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, Numerics.reference(kv_quant=False))
    assert np.array_equal(q.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("kv_quant", [True, False])
def test_tiny_cache_device_bytes_match_the_plan(tiny_cfg, kv_quant):
    """The allocated cache (the arrays' real nbytes, not the shape plan) grows by the planned bytes per
    token, derived here from the tiny config and the formats alone (spec §4.1 at tiny dims)."""
    from deepinfer_jax.model.cache import init_cache

    cfg = tiny_cfg
    num = Numerics.reference(kv_quant=kv_quant)
    d, di = cfg.head_dim, cfg.index_head_dim                       # 64, 32
    if kv_quant:   # FP4 values + E4M3 per 16 (compressed); FP4 + E8M0 per 32 (index-K); FP8 + E8M0 per 32 (ring)
        per_entry, per_slot = (d // 2 + d // 16) + (di // 2 + di // 32), d + d // 32
    else:
        per_entry, per_slot = 2 * (d + di), 2 * d
    entries_per_token = sum(1 / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)   # 1/2 + 1/2 + 1 = 2
    assert entries_per_token == 2 and per_entry == (53 if kv_quant else 192)

    def device_bytes(max_len):
        return sum(x.nbytes for x in jax.tree.leaves(init_cache(cfg, 2, max_len, num)))

    # lengths whose entries fill whole INDEX_ENTRY_ALIGN (256) multiples at ratios 1 and 2
    n1, n2 = 512, 1024
    b1, b2 = device_bytes(n1), device_bytes(n2)
    assert b1 == cache_bytes(cfg, 2, n1, num) and b2 == cache_bytes(cfg, 2, n2, num)
    assert (b2 - b1) / (2 * (n2 - n1)) == entries_per_token * per_entry          # 106 / 384 B per token
    assert device_bytes(n1 - 100) == b1 and device_bytes(n1 + 1) > b1    # indexed entries come in 256s
    # the constant part: 12 rings of 8 slots (values + scales + int32 position) + the fp32 pending pairs
    ratio2 = sum(cfg.compress_ratios[s] == 2 for s in cfg.kv_source_layer_ids)
    fixed = cfg.num_hidden_layers * cfg.sliding_window * (per_slot + 4) + ratio2 * 2 * d * 4
    assert b1 == 2 * (fixed + entries_per_token * per_entry * n1)
