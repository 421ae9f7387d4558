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
