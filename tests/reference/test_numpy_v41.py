"""Properties of the float64 numpy reference that can fail: spec constants, decoders, invariants, causality."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from . import numpy_v41 as ref

ROOT = Path(__file__).resolve().parents[2]
REAL_CONFIG = json.loads((ROOT / "tests" / "fixtures" / "v41_flash_config.json").read_text())


def _tiny_root() -> dict:
    spec = importlib.util.spec_from_file_location("tiny_configs", ROOT / "checkpoints" / "tiny_configs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return copy.deepcopy(mod.TINY_V41_ROOT)


def _small_config(vocab: int = 512, compressed_vocab: int = 200) -> dict:
    """The tiny V4.1 layer plan with a small vocabulary (the real 129,280 only costs time here)."""
    root = _tiny_root()
    tc = root["text_config"]
    tc["vocab_size"] = vocab
    tc["engram_compressed_vocab_size"] = compressed_vocab
    primes = ref.engram_primes(ref.parse_config(root))
    tc["engram_num_embeddings"] = [int(primes[layer].sum()) for layer in tc["engram_layer_ids"]]
    return root


@pytest.fixture(scope="module")
def small():
    config = _small_config()
    weights = ref.random_reference_weights(config, seed=0)
    token_map = np.random.default_rng(1).integers(0, 200, size=512)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 512, size=24)]
    return config, weights, token_map, ids


# ------------------------------------------------------------------------------------------------ mHC


def test_sinkhorn_columns_sum_to_one_and_rows_converge():
    logits = np.random.default_rng(0).standard_normal((500, 4, 4))
    c = ref.sinkhorn(logits, iters=20, hc_eps=1e-6)
    # Ends on a column normalisation: each column sum is s / (s + 1e-6) with s ~ 1, so off by ~1e-6.
    np.testing.assert_allclose(c.sum(axis=-2), 1.0, atol=5e-6)
    # Rows converge geometrically; for O(1) logits 20 rounds leave them within ~1e-4 (measured 1.3e-4 max).
    np.testing.assert_allclose(c.sum(axis=-1), 1.0, atol=1e-3)
    one_round = ref.sinkhorn(logits, iters=1, hc_eps=1e-6)
    assert np.abs(one_round.sum(axis=-1) - 1.0).max() > 1e-2  # the iterations are what balances the rows
    assert (c > 0).all()


def test_mhc_mixes_use_one_rms_over_all_streams_and_stream_major_columns():
    hc, d = 4, 8
    rng = np.random.default_rng(3)
    fn = np.zeros(((2 + hc) * hc, hc * d))
    fn[0, :d] = rng.standard_normal(d)  # pre[0] reads stream 0 only (columns stream * D + j)
    base, scale = np.zeros(24), np.ones(3)
    x = rng.standard_normal((hc, d))
    pre, post, c = ref.mhc_mixes(x, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)
    m0 = np.log((pre[0] - 1e-6) / (1 - (pre[0] - 1e-6)))  # invert the sigmoid
    np.testing.assert_allclose(m0, fn[0, :d] @ x[0] / np.sqrt(np.mean(x * x)), rtol=1e-9)
    np.testing.assert_allclose(pre[1:], 0.5 + 1e-6)  # zero rows of fn: sigmoid(0) + hc_eps
    np.testing.assert_allclose(post, 1.0)  # 2 * sigmoid(0)
    np.testing.assert_allclose(c, 0.25, rtol=1e-5)  # uniform logits stay uniform
    # Scaling another stream changes pre[0] only through the joint RMS statistic.
    x2 = x.copy()
    x2[2] *= 10.0
    pre2, _, _ = ref.mhc_mixes(x2, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)
    assert abs(pre2[0] - 0.5) < abs(pre[0] - 0.5)


def test_pre_and_post_apply():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4, 5))
    np.testing.assert_allclose(ref.pre_apply(x, np.tile([0.0, 0, 1, 0], (3, 1))), x[:, 2])
    y = rng.standard_normal((3, 5))
    c = np.zeros((3, 4, 4))
    c[:, 1, 3] = 1.0  # stream 1 feeds output stream 3
    post = np.tile([0.0, 2.0, 0.0, 0.0], (3, 1))
    out = ref.post_apply(y, x, post, c)
    np.testing.assert_allclose(out[:, 3], x[:, 1])
    np.testing.assert_allclose(out[:, 1], 2.0 * y)
    np.testing.assert_allclose(out[:, 0], 0.0)


# ------------------------------------------------------------------------------------------------ RoPE


def test_rope_preserves_norms_inverts_and_depends_on_relative_position():
    rng = np.random.default_rng(5)
    freqs = ref.rope_freqs(16, 0, 10000.0, 160000.0, 16.0, 256, 32, 1)
    x = rng.standard_normal((6, 3, 40))
    pos = np.array([0, 1, 7, 100, 4095, 65537])
    y = ref.apply_rope(x, pos, freqs)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_array_equal(y[..., :24], x[..., :24])  # only the last 16 dims rotate
    np.testing.assert_allclose(ref.apply_rope(y, pos, freqs, inverse=True), x, atol=1e-12)
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity
    q, k = rng.standard_normal(40), rng.standard_normal(40)

    def dot(m, n):
        return ref.apply_rope(q[None], np.array([m]), freqs)[0] @ ref.apply_rope(k[None], np.array([n]), freqs)[0]

    np.testing.assert_allclose(dot(10, 3), dot(107, 100), rtol=1e-10)
    assert abs(dot(10, 3) - dot(10, 4)) > 1e-6


def test_rope_rotates_adjacent_pairs():
    freqs = np.array([0.5, 0.25])
    x = np.zeros((1, 6))
    x[0, 2] = 1.0  # the real part of the first rotated pair (dims 2, 3)
    y = ref.apply_rope(x, np.array([1]), freqs)
    np.testing.assert_allclose(y[0], [0, 0, math.cos(0.5), math.sin(0.5), 0, 0], atol=1e-15)


def test_yarn_frequencies_of_the_real_config():
    cfg = ref.parse_config(REAL_CONFIG)
    i = np.arange(32)
    compressed = ref.layer_rope_freqs(cfg, 2)
    plain_160k = 160000.0 ** (-2.0 * i / 64)
    np.testing.assert_allclose(compressed[:16], plain_160k[:16], rtol=1e-14)  # low = 15: ramp 0 up to pair 15
    np.testing.assert_allclose(compressed[25:], plain_160k[25:] / 16, rtol=1e-14)  # high = 25
    ramp = (i[16:25] - 15) / 10
    np.testing.assert_allclose(compressed[16:25], plain_160k[16:25] * (1 - ramp + ramp / 16), rtol=1e-14)
    np.testing.assert_array_equal(ref.layer_rope_freqs(cfg, 1), compressed)
    np.testing.assert_allclose(ref.layer_rope_freqs(cfg, 0), 10000.0 ** (-2.0 * i / 64), rtol=1e-14)


# ------------------------------------------------------------------------------------------------ layer plan


def test_layer_plan_of_the_real_config_matches_the_spec_table():
    plans = ref.layer_plans(REAL_CONFIG)
    assert len(plans) == 40
    mode = {p.layer_id: p.mode for p in plans}
    assert [k for k, v in mode.items() if v == ref.SWA] == [0, 1]
    assert [k for k, v in mode.items() if v == ref.FULL] == [2, 8, 14, 20]
    assert [k for k, v in mode.items() if v == ref.REINDEX] == [24, 28, 32, 36]
    assert plans[7].kv_source == 2 and plans[7].index_source == 2
    assert plans[19].kv_source == 14 and plans[19].index_source == 14
    assert plans[27].kv_source == 20 and plans[27].index_source == 24
    assert plans[39].kv_source == 20 and plans[39].index_source == 36
    assert [p.layer_id for p in plans if p.is_candidate_source] == [20]
    assert [p.layer_id for p in plans if p.uses_candidate_pool] == [24, 28, 32, 36]
    assert [p.layer_id for p in plans if p.engram_before] == [1, 14]


def test_layer_plan_rejects_a_ratio_mismatch():
    bad = copy.deepcopy(REAL_CONFIG)
    bad["text_config"]["kv_source_layer_ids"] = [2, 8, 14]  # ratio-1 layer 20 would read a ratio-2 source
    with pytest.raises(ValueError, match="layer 20"):
        ref.layer_plans(bad)


# ------------------------------------------------------------------------------------------------ Engram

SPEC_PRIMES = {
    1: [[16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
        [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
        [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463]],
    14: [[16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
         [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
         [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]],
}
SPEC_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


def test_engram_primes_and_multipliers_of_the_real_config():
    cfg = ref.parse_config(REAL_CONFIG)
    layouts = ref.engram_layouts(cfg)
    for n_rows, (layer, (primes, mult)) in zip(REAL_CONFIG["text_config"]["engram_num_embeddings"], layouts.items()):
        np.testing.assert_array_equal(primes, SPEC_PRIMES[layer])
        np.testing.assert_array_equal(mult, SPEC_MULTIPLIERS[layer])
        assert int(primes.sum()) == n_rows
        offsets = ref.engram_offsets(primes)
        assert offsets[0] == 0 and offsets[9] == sum(SPEC_PRIMES[layer][0]) + SPEC_PRIMES[layer][1][0]


def test_engram_hash_matches_a_big_integer_evaluation_and_stays_local():
    cfg = ref.parse_config(REAL_CONFIG)
    primes, mult = ref.engram_layouts(cfg)[14]
    offsets = ref.engram_offsets(primes)
    comp = np.random.default_rng(6).integers(0, 99092, size=12)
    pad = 5
    rows = ref.engram_hash_rows(comp, primes, mult, pad)
    assert rows.shape == (12, 24)
    for t in (0, 1, 2, 3, 11):  # Python integers: no overflow, no numpy in the way
        toks = [int(comp[t - s]) if t - s >= 0 else pad for s in range(4)]
        rolling = toks[0] * int(mult[0])
        for s in range(1, 4):
            rolling ^= toks[s] * int(mult[s])
            for h in range(8):
                c = (s - 1) * 8 + h
                assert rows[t, c] == rolling % int(primes[s - 1, h]) + int(offsets[c])
    lo, hi = offsets, offsets + primes.reshape(-1)
    assert ((rows >= lo) & (rows < hi)).all()
    # Position t reads tokens t-3..t only; an n-gram column reads t-n+1..t only.
    changed = comp.copy()
    changed[4] = (changed[4] + 1) % 99092
    rows2 = ref.engram_hash_rows(changed, primes, mult, pad)
    np.testing.assert_array_equal(rows2[:4], rows[:4])
    np.testing.assert_array_equal(rows2[8:], rows[8:])
    np.testing.assert_array_equal(rows2[6, :8], rows[6, :8])  # 2-gram of t=6 covers 5..6
    assert (rows2[6, 16:] != rows[6, 16:]).any()  # 4-gram of t=6 covers 3..6
    # A dead (-1) token pads itself and every older slot (sticky).
    dead = comp.copy()
    dead[5] = -1
    # So position 6 hashes like the first token of a fresh sequence.
    np.testing.assert_array_equal(ref.engram_hash_rows(dead, primes, mult, pad)[6],
                                  ref.engram_hash_rows(comp[6:7], primes, mult, pad)[0])
    assert (ref.engram_hash_rows(dead, primes, mult, pad)[6] != rows[6]).any()


def test_engram_inject_gates_each_copy_separately():
    rng = np.random.default_rng(7)
    t_len, hc, d, n_cols, dh = 3, 4, 16, 6, 8
    x = rng.standard_normal((t_len, hc, d))
    table = rng.standard_normal((50, dh))
    rows = rng.integers(0, 50, size=(t_len, n_cols))
    wkv = rng.standard_normal(((hc + 1) * d, n_cols * dh)) / 10
    qw, kw = rng.standard_normal((hc, d)), rng.standard_normal((hc, d))
    out = ref.engram_inject(x, rows, table, wkv, qw, kw, 1e-20)
    val = (table[rows].reshape(t_len, -1) @ wkv.T)[:, hc * d:]
    gate = (out - x) / val[:, None, :]
    assert np.allclose(gate, gate[..., :1]) and ((gate > 0) & (gate < 1)).all()  # one sigmoid gate per copy
    x2 = x.copy()
    x2[:, 1] *= -3.0
    out2 = ref.engram_inject(x2, rows, table, wkv, qw, kw, 1e-20)
    np.testing.assert_allclose(out2[:, [0, 2, 3]], out[:, [0, 2, 3]], rtol=1e-13)
    assert not np.allclose(out2[:, 1] - x2[:, 1], out[:, 1] - x[:, 1])


# ------------------------------------------------------------------------------------------------ decoders


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def _fixture_checkpoint(tmp_path: Path, wkv_scale_shape=(1, 1)) -> Path:
    rng = np.random.default_rng(8)
    block_w = rng.integers(0, 0x7F, size=(40, 64), dtype=np.uint8)  # positive e4m3 codes, no NaN
    engram_w = rng.integers(0, 0x7F, size=(2, 64), dtype=np.uint8)
    shard1 = {
        "layers.0.attn.wkv.weight": ("F8_E4M3", (1, 8), bytes.fromhex("d871f2797069f0e5")),
        "layers.0.attn.wkv.scale": ("F8_E8M0", wkv_scale_shape, bytes([0x73]) * math.prod(wkv_scale_shape)),
        "norm.weight": ("BF16", (3,), np.array([1.5, -2.0, 0.00390625], ml_dtypes.bfloat16).tobytes()),
        "blocky.weight": ("F8_E4M3", (40, 64), block_w.tobytes()),
        "blocky.scale": ("F8_E8M0", (2, 2), bytes([127, 128, 126, 130])),
    }
    shard2 = {
        "layers.0.ffn.experts.0.w1.weight": ("I8", (1, 8), bytes.fromhex("a0a8ec4aadaf42aa")),
        "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", (1, 1), bytes([0x78])),
        "layers.0.attn.attn_sink": ("F32", (2,), np.array([0.25, -7.0], np.float32).tobytes()),
        "layers.1.engram.embed.weight": ("F8_E4M3", (2, 64), engram_w.tobytes()),
        "layers.1.engram.embed.scale": ("F8_E8M0", (2, 2), bytes([127, 129, 125, 127])),
    }
    _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", shard1)
    _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", shard2)
    weight_map = {n: "model-00001-of-00002.safetensors" for n in shard1}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in shard2})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": [32, 32]}}))
    return tmp_path


def test_decoders_reproduce_the_spec_real_byte_fixtures(tmp_path):
    w = ref.load_reference_weights(_fixture_checkpoint(tmp_path))
    np.testing.assert_array_equal(w["layers.0.attn.wkv.weight"][0], [
        -0.00390625, 0.03515625, -0.0390625, 0.0703125, 0.03125, 0.017578125, -0.03125, -0.0126953125])
    np.testing.assert_array_equal(w["layers.0.ffn.experts.0.w1.weight"][0], [
        0, -0.0078125, 0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625, -0.0234375, -0.0078125,
        -0.046875, -0.0078125, 0.0078125, 0.015625, -0.0078125, -0.0078125])
    assert w["layers.0.ffn.experts.0.w1.weight"].shape == (1, 16)
    np.testing.assert_array_equal(w["norm.weight"], [1.5, -2.0, 0.00390625])
    np.testing.assert_array_equal(w["layers.0.attn.attn_sink"], [0.25, -7.0])
    assert not any(name.endswith(".scale") for name in w)  # scales are folded into their weights
    assert all(v.dtype == np.float64 for v in w.values())


def test_fp8_block_and_engram_row_scales_land_on_the_right_elements(tmp_path):
    w = ref.load_reference_weights(_fixture_checkpoint(tmp_path))
    rng = np.random.default_rng(8)
    block_codes = rng.integers(0, 0x7F, size=(40, 64), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(float)
    engram_codes = rng.integers(0, 0x7F, size=(2, 64), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(float)
    # 32x32 tiles: rows 0-31 x cols 0-31 -> 2^0, cols 32-63 -> 2^1; rows 32-39 -> 2^-1 and 2^3.
    expect = block_codes * np.block([[np.full((32, 32), 1.0), np.full((32, 32), 2.0)],
                                     [np.full((8, 32), 0.5), np.full((8, 32), 8.0)]])
    np.testing.assert_array_equal(w["blocky.weight"], expect)
    # Engram: one scale per 32 consecutive columns of each row.
    expect_e = engram_codes * np.array([[1.0] * 32 + [4.0] * 32, [0.25] * 32 + [1.0] * 32])
    np.testing.assert_array_equal(w["layers.1.engram.embed.weight"], expect_e)


def test_loader_names_the_tensor_with_a_bad_scale_shape(tmp_path):
    with pytest.raises(ValueError, match="layers.0.attn.wkv.weight"):
        ref.load_reference_weights(_fixture_checkpoint(tmp_path, wkv_scale_shape=(1, 2)))


def test_fp4_table_agrees_with_ml_dtypes():
    np.testing.assert_array_equal(
        ref.FP4_E2M1_TABLE, np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64))


# ------------------------------------------------------------------------------------------------ quantizers


def test_fp8_fake_quant_scale_grid_and_idempotence():
    x = np.random.default_rng(9).standard_normal((50, 64)) * np.logspace(-3, 3, 50)[:, None]
    q = ref.fake_quant_fp8(x)
    blocks_x, blocks_q = x.reshape(50, 2, 32), q.reshape(50, 2, 32)
    amax = np.abs(blocks_x).max(-1)
    scale = 2.0 ** np.ceil(np.log2(amax / 448))
    ratio = amax / scale
    assert ((ratio > 224) & (ratio <= 448)).all()  # the smallest power of two that fits
    on_grid = blocks_q / scale[..., None]
    np.testing.assert_array_equal(on_grid.astype(ml_dtypes.float8_e4m3fn).astype(float), on_grid)
    # E4M3 normal numbers carry 3 mantissa bits: relative rounding error <= 2^-4 (subnormals are absolute).
    big = np.abs(blocks_x) >= 2.0**-6 * scale[..., None]
    assert (np.abs(blocks_q - blocks_x)[big] <= 2.0**-4 * np.abs(blocks_x)[big] + 1e-300).all()
    np.testing.assert_array_equal(ref.fake_quant_fp8(q), q)
    # Hand-checked block: amax 300 -> scale 2^0, so 2^-9 (the smallest E4M3 subnormal) survives and 300
    # rounds to 288; a scale of 2^1 would flush 2^-9 to zero. An all-zero block stays zero (amax floor).
    block = np.zeros((2, 32))
    block[0, :3] = [300.0, 2.0**-9, -0.3]
    np.testing.assert_array_equal(ref.fake_quant_fp8(block)[0, :3], [288.0, 2.0**-9, -0.3125])
    np.testing.assert_array_equal(ref.fake_quant_fp8(block)[1], 0.0)


def test_fp4_fake_quants():
    x = np.random.default_rng(10).standard_normal((20, 64))
    q = ref.fake_quant_fp4_pow2(x)
    scale = 2.0 ** np.ceil(np.log2(np.abs(x.reshape(20, 2, 32)).max(-1) / 6))
    grid = (q.reshape(20, 2, 32) / scale[..., None]).ravel()
    assert set(np.abs(grid)) <= {0, .5, 1, 1.5, 2, 3, 4, 6}
    np.testing.assert_array_equal(ref.fake_quant_fp4_pow2(q), q)
    q16 = ref.fake_quant_fp4_e4m3(x)
    amax16 = np.abs(x.reshape(20, 4, 16)).max(-1)
    s16 = (amax16 / 6).astype(ml_dtypes.float8_e4m3fn).astype(float)  # an E4M3 value, not a power of two
    grid16 = q16.reshape(20, 4, 16) / s16[..., None]
    assert set(np.abs(np.round(grid16, 12)).ravel()) <= {0, .5, 1, 1.5, 2, 3, 4, 6}
    assert not np.allclose(np.log2(s16), np.round(np.log2(s16)))
    # amax 5: scale e4m3(5/6) = 0.8125 (not 0.8333), so 5 clamps to 6 * 0.8125, and 1 (1.23 on the grid)
    # rounds to 1 * 0.8125.
    e4m3_block = np.zeros((1, 16))
    e4m3_block[0, :2] = [5.0, 1.0]
    np.testing.assert_array_equal(ref.fake_quant_fp4_e4m3(e4m3_block)[0, :2], [4.875, 0.8125])
    # Round-to-nearest-even on the E2M1 grid: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4 (scale 1 blocks).
    ties = np.array([[6.0, 0.25, 0.75, 2.5, 5.0, -5.0] + [0.0] * 26])
    np.testing.assert_array_equal(ref.fake_quant_fp4_pow2(ties)[0, :6], [6, 0, 1, 2, 4, -4])


# ------------------------------------------------------------------------------------------------ selection


def test_select_topk_orders_breaks_ties_low_and_pads():
    inf = np.inf
    scores = np.array([
        [1.0, 5.0, 5.0, 2.0, 5.0, -inf],  # three-way tie at 5: indices 1, 2 win over 4
        [-inf, -inf, 3.0, -inf, -inf, -inf],  # one reachable position
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    ])
    np.testing.assert_array_equal(ref.select_topk(scores, 2), [[1, 2], [2, -1], [4, 5]])
    np.testing.assert_array_equal(ref.select_topk(scores, 4), [[1, 2, 3, 4], [2, -1, -1, -1], [2, 3, 4, 5]])
    np.testing.assert_array_equal(ref.select_topk(scores, 8)[1], [2, -1, -1, -1, -1, -1, -1, -1])


def test_index_scores_visibility_and_candidate_pool():
    rng = np.random.default_rng(11)
    t_len, s_len = 12, 12
    iq, k, w = rng.standard_normal((t_len, 2, 8)), rng.standard_normal((s_len, 8)), rng.standard_normal((t_len, 2))
    scores = ref.index_scores(iq, w, k, np.arange(t_len), ratio=1)
    assert np.isfinite(scores[5, :6]).all() and np.isneginf(scores[5, 6:]).all()
    expect = sum(w[5, h] * np.maximum(iq[5, h] @ k[3], 0) for h in range(2))
    np.testing.assert_allclose(scores[5, 3], expect, rtol=1e-13)
    r2 = ref.index_scores(iq, w, k[:6], np.arange(t_len), ratio=2)
    assert np.isfinite(r2[5, :3]).all() and np.isneginf(r2[5, 3:]).all()  # entry j visible iff j < (p+1)//2
    assert np.isneginf(r2[0]).all()

    s = np.full((1, 10), -np.inf)
    s[0, :9] = [9.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0, 0.0, -1.0]  # query at position 8 sees 0..8
    mask = ref.candidate_mask(s, np.array([8]), ratio=1, block_size=2, topk_blocks=2)
    # blocks: [9,0] -> 9, [0,8] -> 8, ..., [-1, -inf] holds position 8 (newest) -> pinned
    np.testing.assert_array_equal(mask[0], [1, 1, 0, 0, 0, 0, 0, 0, 1, 1])
    mask3 = ref.candidate_mask(s, np.array([8]), ratio=1, block_size=2, topk_blocks=3)
    np.testing.assert_array_equal(mask3[0], [1, 1, 1, 1, 0, 0, 0, 0, 1, 1])
    few = ref.candidate_mask(np.array([[9.0, 0.0, -np.inf, -np.inf]]), np.array([1]), ratio=1, block_size=2,
                             topk_blocks=3)
    np.testing.assert_array_equal(few[0], [1, 1, 0, 0])  # unreachable blocks are never kept


def test_sparse_sink_attention_matches_dense_softmax():
    rng = np.random.default_rng(12)
    q, kv = rng.standard_normal((3, 2, 8)), rng.standard_normal((5, 8))
    idx = np.array([[0, 1, -1], [2, 3, 4], [4, -1, -1]])
    sink = np.array([-np.inf, 0.7])
    o = ref.sparse_sink_attention(q, kv, idx, sink, 8**-0.5)
    for t in range(3):
        rows = kv[idx[t][idx[t] >= 0]]
        for h in range(2):
            z = rows @ q[t, h] * 8**-0.5
            p = np.exp(z) / (np.exp(z).sum() + np.exp(sink[h]))
            np.testing.assert_allclose(o[t, h], p @ rows, rtol=1e-12)


def test_compress_pairs_softmax_per_channel():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((5, 6))
    wkv, ones = rng.standard_normal((4, 6)), np.ones(4)
    same_gate = ref.compress_pairs(x, wkv, np.zeros((4, 6)), ones, 1e-20)
    assert same_gate.shape == (2, 4)  # the odd trailing token waits
    mean_pair = (x[0:2] @ wkv.T).mean(axis=0)
    np.testing.assert_allclose(same_gate[0], mean_pair / np.sqrt(np.mean(mean_pair**2)), rtol=1e-12)
    wgate = rng.standard_normal((4, 6)) * 1e4  # a decisive gate picks one token per channel
    sharp = ref.compress_pairs(x, wkv, wgate, ones, 1e-20)
    k, s = x[2:4] @ wkv.T, x[2:4] @ wgate.T
    pick = np.where(s[0] > s[1], k[0], k[1])
    np.testing.assert_allclose(sharp[1], pick / np.sqrt(np.mean(pick**2)), rtol=1e-12)


# ------------------------------------------------------------------------------------------------ MoE


def test_routing_weights_sum_to_scaling_factor_and_bias_only_selects():
    rng = np.random.default_rng(14)
    x, gate_w = rng.standard_normal((40, 16)), rng.standard_normal((8, 16)) / 4
    idx, w = ref.route(x, gate_w, np.zeros(8), top_k=2, routed_scaling_factor=1.5, norm_topk_prob=True)
    np.testing.assert_allclose(w.sum(axis=-1), 1.5, rtol=1e-12)
    scores = np.sqrt(np.log1p(np.exp(x @ gate_w.T)))
    np.testing.assert_array_equal(idx, np.argsort(-scores, axis=-1, kind="stable")[:, :2])
    bias = np.zeros(8)
    bias[5] = 100.0  # forces expert 5 into every selection ...
    idx_b, w_b = ref.route(x, gate_w, bias, top_k=2, routed_scaling_factor=1.5, norm_topk_prob=True)
    assert (idx_b == 5).any(axis=-1).all()
    chosen = np.take_along_axis(scores, idx_b, axis=-1)  # ... but weights come from the unbiased scores
    np.testing.assert_allclose(w_b, 1.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-12)


def test_swiglu_clamps():
    rng = np.random.default_rng(15)
    w1, w3, w2 = rng.standard_normal((4, 6)), rng.standard_normal((4, 6)), np.eye(6, 4)
    x = rng.standard_normal((3, 6)) * 1e4  # both projections far beyond the limit of 10
    y = ref.swiglu_expert(x, w1, w2, w3, limit=10.0)
    g, u = x @ w1.T, x @ w3.T
    h = np.where(g > 10, 10 / (1 + np.exp(-10.0)), 0.0) * np.sign(u) * 10  # silu(min(g, 10)) * clamp(u)
    np.testing.assert_allclose(y[:, :4], h, atol=1e-9)
    np.testing.assert_allclose(ref.swiglu_expert(x, w1, w2, w3, 10.0, np.full(3, 0.5)), 0.5 * y, rtol=1e-12)


def test_moe_layer_routing_weights(small):
    config, weights, _, _ = small
    cfg = ref.parse_config(config)
    x = np.random.default_rng(16).standard_normal((10, cfg.hidden_size))
    y, idx, w = ref.moe(x, weights, "layers.3", cfg)
    np.testing.assert_allclose(w.sum(-1), cfg.routed_scaling_factor, rtol=1e-12)
    assert y.shape == x.shape and len(set(idx.ravel().tolist())) > 1


# ------------------------------------------------------------------------------------------------ forward


def test_forward_is_causal(small):
    config, weights, token_map, ids = small
    full = ref.reference_forward(config, weights, ids, token_map)
    assert full["logits"].shape == (24, 512) and len(full["hidden"]) == 12
    assert np.isfinite(full["logits"]).all()
    scale = np.abs(full["logits"]).max()
    # Same float64 ops on a shorter sequence; only BLAS summation order may differ (~1e-15 relative).
    for t in (0, 5, 10, 17):
        prefix = ref.reference_forward(config, weights, ids[: t + 1], token_map)
        np.testing.assert_allclose(prefix["logits"], full["logits"][: t + 1], atol=1e-10 * scale)
        np.testing.assert_allclose(prefix["hidden"][-1], full["hidden"][-1][: t + 1], atol=1e-10 * scale)
        for layer, topk in prefix["topk"].items():
            np.testing.assert_array_equal(topk, full["topk"][layer][: t + 1])
    t = 11
    changed = ids[: t + 1] + [int(i) for i in (np.asarray(ids[t + 1:]) + 7) % 512]
    other = ref.reference_forward(config, weights, changed, token_map)
    np.testing.assert_allclose(other["logits"][: t + 1], full["logits"][: t + 1], atol=1e-10 * scale)
    assert np.abs(other["logits"][t + 1:] - full["logits"][t + 1:]).max(axis=-1).min() > 1e-6


def test_forward_selection_bookkeeping(small):
    config, weights, token_map, ids = small
    out = ref.reference_forward(config, weights, ids, token_map)
    plans = ref.layer_plans(config)
    pool = out["candidate_mask"][6]
    assert pool.shape == (24, 24) and not pool[-1].all() and pool[-1].sum() == 3 * 2  # 3 blocks of 2
    for plan in plans:
        if plan.ratio == 0:
            assert plan.layer_id not in out["topk"]
            continue
        topk = out["topk"][plan.layer_id]
        assert topk.shape == (24, 4)
        if plan.mode == ref.REUSE:
            assert topk is out["topk"][plan.index_source]
        for t in range(24):
            valid = topk[t][topk[t] >= 0]
            n_visible = (t + 1) // plan.ratio
            assert len(valid) == min(4, n_visible)  # no candidate pool restriction reaches below 4 entries
            assert (np.diff(valid) > 0).all() and (valid < n_visible).all()
            assert (topk[t][len(valid):] == -1).all()
            if plan.uses_candidate_pool:
                assert pool[t, valid].all()
    assert set(out["engram_rows"]) == {1, 4}


def test_fake_quant_forward_is_causal_and_perturbs(small):
    config, weights, token_map, ids = small
    exact = ref.reference_forward(config, weights, ids[:16], token_map, return_hidden=False)
    quant = ref.reference_forward(config, weights, ids[:16], token_map, fake_quant=True, return_hidden=False)
    assert "hidden" not in quant
    assert not np.allclose(quant["logits"], exact["logits"])
    # Random weights amplify quantization noise (~40% relative at the logits after 12 layers, measured);
    # this only checks the quantized path stays a perturbation, not a different function.
    corr = np.corrcoef(quant["logits"].ravel(), exact["logits"].ravel())[0, 1]
    assert corr > 0.5
    prefix = ref.reference_forward(config, weights, ids[:9], token_map, fake_quant=True, return_hidden=False)
    np.testing.assert_allclose(prefix["logits"], quant["logits"][:9], atol=1e-10 * np.abs(quant["logits"]).max())
