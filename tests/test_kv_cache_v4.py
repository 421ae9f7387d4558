"""V4-Flash KV caches at deployment precision (spec §4.2): the MODEL1 entry layout, bytes per token of the
full config, and decoding with the quantized cache against the BF16 cache."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model import kv_codec
from deepinfer_jax.model.cache import cache_bytes, cache_shapes, init_cache
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.transformer import forward
from deepinfer_jax.model.v4_quant import fake_quant_kv_v4

REAL = ModelConfig.from_dict(json.loads((Path(__file__).parent / "fixtures" / "v4_flash_config.json").read_text()))
QUANT, BF16 = Numerics.reference(kv_quant=True), Numerics.reference(kv_quant=False)


def _entry_bytes(sds: dict) -> int:
    """Bytes of one entry (one [..., dim] row) of a storage dict of ShapeDtypeStructs."""
    return sum(s.shape[-1] * s.dtype.itemsize for s in jax.tree.leaves(sds))


@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (64, 16)])  # the real config; the tiny one
def test_codec_stores_exactly_the_fake_quant_values(head_dim, rope_dim):
    layout = kv_codec.v4_kv_layout(head_dim, rope_dim)
    x = (jax.random.normal(jax.random.key(1), (3, 5, head_dim), jnp.float32)
         * jnp.logspace(-3, 2, head_dim)).astype(jnp.bfloat16)
    stored = kv_codec.encode(layout, x, True, jnp.bfloat16)
    want = fake_quant_kv_v4(x, rope_dim)
    assert np.array_equal(np.asarray(kv_codec.decode(layout, stored, jnp.bfloat16)).view(np.uint16),
                          np.asarray(want).view(np.uint16))
    assert stored["values"].dtype == jnp.float8_e4m3fn and stored["rope"].dtype == jnp.bfloat16
    # the RoPE dims are not quantized at all
    assert np.array_equal(np.asarray(stored["rope"]).view(np.uint16), np.asarray(x[..., -rope_dim:]).view(np.uint16))


def test_model1_entry_layout_hand_case():
    """One real-size entry: 7 blocks of 64 non-RoPE dims with amax 448 * 2^k (k = -3..3) -> E8M0 scales
    2^k exactly, stored 1:1 in FP8; the 8th scale byte is the layout's pad (1.0); 584 bytes in all."""
    layout = kv_codec.v4_kv_layout(512, 64)
    nope = np.concatenate([np.linspace(-1, 1, 64) * 448 * 2.0 ** k for k in range(-3, 4)])
    rope = np.linspace(-3, 3, 64)
    x = jnp.asarray(np.concatenate([nope, rope])[None], jnp.bfloat16)
    stored = kv_codec.encode(layout, x, True, jnp.bfloat16)
    assert np.asarray(stored["scale"].astype(jnp.float32)).tolist() == [[2.0 ** k for k in range(-3, 4)] + [1.0]]
    assert _entry_bytes(kv_codec.stored_shapes(layout, (1,), 512, True, jnp.bfloat16)) == 448 + 128 + 8 == 584
    assert _entry_bytes(kv_codec.stored_shapes(kv_codec.INDEX_K, (1,), 128, True, jnp.bfloat16)) == 64 + 4


def test_bytes_per_token_full_config():
    """Spec §4.2: 21 CSA layers x (584 B per 4 tokens + 68 B FP4 index-K per 4 tokens) + 20 HCA layers x
    584 B per 128 tokens = 3,423 + 91.25 = 3,514.25 B/token (the spec rounds to 3,514); BF16 storage
    21 x (1024 + 256) / 4 + 20 x 1024 / 128 = 6,880 B/token. The SWA rings are constant in the length."""
    n1, n2 = 4096, 8192  # whole entries of every ratio, the indexed ones in whole multiples of 256

    def per_token(numerics):
        return (cache_bytes(REAL, 1, n2, numerics) - cache_bytes(REAL, 1, n1, numerics)) / (n2 - n1)

    assert per_token(QUANT) == 3514.25
    assert per_token(BF16) == 6880
    ring = sum(_entry_bytes(w["kv"]) * w["pos"].shape[1] for w in cache_shapes(REAL, 1, n1, QUANT)["window"])
    assert ring == 43 * 128 * 584  # the 44th ring of §4.2 is the MTP layer's (test_mtp.py)


def test_tiny_cache_device_bytes_match_the_plan(tiny_v4):
    """The allocated tiny cache grows by the bytes the layout gives at tiny dims: 48 non-RoPE dims (one
    FP8 block, its scale padded to 8 bytes) + 16 BF16 RoPE dims = 88 B per KV entry, 16 + 1 B per FP4
    index-K entry; CSA layers 2, 4, 6 (ratio 4), HCA layers 3, 5 (ratio 128)."""
    cfg, _, _ = tiny_v4
    per_token = 3 * (88 + 17) / 4 + 2 * 88 / 128

    def device_bytes(max_len):
        return sum(x.nbytes for x in jax.tree.leaves(init_cache(cfg, 2, max_len, QUANT)))

    n1, n2 = 1024, 2048   # the CSA layers' indexed entries fill whole multiples of 256 (INDEX_ENTRY_ALIGN)
    assert device_bytes(n1) == cache_bytes(cfg, 2, n1, QUANT)
    assert (device_bytes(n2) - device_bytes(n1)) / (2 * (n2 - n1)) == per_token


CHUNK = 16


@pytest.fixture(scope="module")
def decode_runs(tiny_v4):
    """Greedy decoding of one 140-token prompt (prefill in chunks of 16, then 12 steps) with each cache,
    each run fed its own greedy tokens. A decode step is a chunk with one real row and padding rows
    (position -1), so each numerics compiles one program. -> {name: (logits [140 + 12, V], final cache)}."""
    cfg, params, _ = tiny_v4
    prompt = np.random.default_rng(3).integers(3, cfg.vocab_size, size=140).astype(np.int32)
    out = {}
    for name, numerics in (("quant", QUANT), ("bf16", BF16)):
        step = jax.jit(lambda p, c, tok, pos, n=numerics: forward(p, cfg, c, tok, pos, None, n))
        cache = init_cache(cfg, 1, 160, numerics)
        logits = []

        def run(tokens, start):
            nonlocal cache
            pos = np.full(CHUNK, -1, np.int32)
            pos[:len(tokens)] = np.arange(start, start + len(tokens))
            tok = np.pad(np.asarray(tokens, np.int32), (0, CHUNK - len(tokens)))
            lg, cache = step(params, cache, jnp.asarray(tok[None]), jnp.asarray(pos[None]))
            logits.append(np.asarray(lg[0])[:len(tokens)])
            return int(logits[-1][-1].argmax())

        for s in range(0, len(prompt), CHUNK):
            nxt = run(prompt[s:s + CHUNK], s)
        for k in range(12):
            nxt = run([nxt], len(prompt) + k)
        out[name] = (np.concatenate(logits), cache)
    return out


def test_quantized_cache_decodes_like_the_bf16_cache(decode_runs):
    """Bound: zero. The reference fake-quantizes the window KV, the compressed KV and the index-K at the
    very sites the cache stores them, so the BF16 cache holds exactly the values the FP8/FP4 cache decodes
    to, and prefill plus 12 greedy steps give bitwise-equal logits (hence the same tokens)."""
    q, b = decode_runs["quant"][0], decode_runs["bf16"][0]
    assert q.shape == b.shape == (152, 256)
    assert np.array_equal(q.view(np.uint32), b.view(np.uint32))


def test_the_quantized_cache_really_is_fp8_fp4(decode_runs, tiny_v4):
    """The equality above is not two BF16 caches: every KV leaf is stored as FP8 / packed FP4 bytes and
    decodes to the BF16 cache's values (ring slots, compressed entries of both ratios, index-K)."""
    cfg, _, _ = tiny_v4
    cq, cb = decode_runs["quant"][1], decode_runs["bf16"][1]
    lay = kv_codec.layouts(cfg)
    pairs = [(lay.window, cq["window"][i]["kv"], cb["window"][i]["kv"]) for i in range(cfg.num_hidden_layers)]
    for name, src in cq["sources"].items():
        pairs.append((lay.compressed, src["kv"], cb["sources"][name]["kv"]))
        if "index_k" in src:
            pairs.append((lay.index_k, src["index_k"], cb["sources"][name]["index_k"]))
    assert len(pairs) == 7 + 5 + 3  # 7 rings, 5 compressed caches, 3 index-K caches
    for layout, stored, plain in pairs:
        assert stored["values"].dtype in (jnp.float8_e4m3fn, jnp.uint8)
        got = np.asarray(kv_codec.decode(layout, stored, jnp.bfloat16)).view(np.uint16)
        assert np.array_equal(got, np.asarray(plain["values"]).view(np.uint16))
    # the caches hold data: HCA entry 0 (tokens 0..127) and the CSA entries were written
    assert np.abs(np.asarray(cb["sources"]["layer_3"]["kv"]["values"][0, 0], np.float32)).max() > 0
