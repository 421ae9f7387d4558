"""Stored-format codecs: the spec's real-byte fixtures (§5.4), E8M0 extremes and NaN propagation, the
encoders' scale rule and round trips, and numpy == jnp decoders bitwise (exhaustive over byte codes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.checkpoint import formats
from deepinfer_jax.model import linear

E4M3, E8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu


def _e8m0(*b) -> np.ndarray:
    return np.array(b, np.uint8).view(E8M0)


# layers.0.attn.wkv.weight row 0 of V4.1 shard 3 and its block scale byte (spec §5.4)
WKV_ROW = bytes.fromhex("d871f2797069f0e5")
WKV_WANT = [-0.00390625, 0.03515625, -0.0390625, 0.0703125, 0.03125, 0.017578125, -0.03125, -0.0126953125]
# layers.0.ffn.experts.0.w1.weight row 0 and its scale byte (spec §5.4)
W1_ROW = bytes.fromhex("a0a8ec4aadaf42aa")
W1_WANT = [0, -0.0078125, 0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625, -0.0234375, -0.0078125,
           -0.046875, -0.0078125, 0.0078125, 0.015625, -0.0078125, -0.0078125]


def test_fp8_fixture_from_the_real_checkpoint():
    w = np.frombuffer(WKV_ROW, np.uint8).reshape(1, 8).view(E4M3)
    scale = _e8m0(0x73).reshape(1, 1)
    assert formats.dequant_fp8_block(w, scale, 32)[0].tolist() == WKV_WANT
    assert np.asarray(formats.dequant_fp8_block_jnp(jnp.asarray(w), jnp.asarray(scale), 32))[0].tolist() == WKV_WANT
    assert np.asarray(linear.dequant_fp8(jnp.asarray(w), jnp.asarray(scale)))[0].tolist() == WKV_WANT
    # raw uint8 bytes decode the same as the typed view
    assert formats.dequant_fp8_block(np.frombuffer(WKV_ROW, np.uint8).reshape(1, 8), scale, 32)[0].tolist() == WKV_WANT


def test_fp4_fixture_from_the_real_checkpoint():
    w = np.frombuffer(W1_ROW, np.uint8).reshape(1, 8)
    scale = _e8m0(0x78).reshape(1, 1)
    assert formats.dequant_fp4(w, scale)[0].tolist() == W1_WANT
    assert np.asarray(formats.dequant_fp4_jnp(jnp.asarray(w), jnp.asarray(scale)))[0].tolist() == W1_WANT
    assert np.asarray(linear.dequant_fp4(jnp.asarray(w), jnp.asarray(scale)))[0].tolist() == W1_WANT
    # nibble order: byte 0xa0 holds element 0 (low nibble 0x0 -> 0) and element 1 (high nibble 0xa -> -1)
    assert formats.unpack_fp4(np.array([0xa0], np.uint8)).tolist() == [0.0, -1.0]


def test_e8m0_extremes_and_nan():
    got = formats.e8m0_to_f32(_e8m0(0, 1, 126, 127, 128, 254, 255))
    assert got[:-1].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert np.isnan(got[-1])  # 0xFF is NaN and must propagate, not clamp to 2^128 or 2^127
    assert np.asarray(formats.e8m0_to_f32_jnp(jnp.asarray(_e8m0(127, 255))))[0] == 1.0
    assert np.isnan(np.asarray(formats.e8m0_to_f32_jnp(jnp.asarray(np.array([255], np.uint8)))))[0]


def test_nan_scale_poisons_exactly_its_block():
    w = np.ones((40, 70), E4M3)
    scale = np.full((2, 3), 127, np.uint8)
    scale[1, 2] = 255
    for out in (formats.dequant_fp8_block(w, scale.view(E8M0), 32),
                np.asarray(formats.dequant_fp8_block_jnp(jnp.asarray(w), jnp.asarray(scale.view(E8M0)), 32))):
        nan = np.isnan(out)
        assert nan[32:, 64:].all() and nan.sum() == 8 * 6  # the partial edge block [32:40, 64:70]
        assert (out[~nan] == 1.0).all()
    w4 = np.full((2, 32), 0x22, np.uint8)  # 64 values of 1.0 per row
    s4 = np.array([[127, 255], [127, 127]], np.uint8).view(E8M0)
    for out in (formats.dequant_fp4(w4, s4), np.asarray(formats.dequant_fp4_jnp(jnp.asarray(w4), jnp.asarray(s4)))):
        assert np.isnan(out[0, 32:]).all() and not np.isnan(out[0, :32]).any() and not np.isnan(out[1]).any()


def _assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns (so signed zeros count); NaNs only need to sit at the same places."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_numpy_and_jnp_fp8_decoders_agree_bitwise_on_every_code():
    # every e4m3 byte (incl. NaN 0x7F/0xFF, -0) against scale bytes that keep results normal fp32: XLA
    # flushes subnormal results to zero (numpy does not), and a real checkpoint's scales never get there
    codes = np.arange(256, dtype=np.uint8)
    scale_bytes = np.array([10, 64, 100, 115, 120, 127, 140, 200, 254, 255], np.uint8)
    w = np.tile(codes, (len(scale_bytes) * 4, 1)).view(E4M3)  # [40, 256]: 4-row blocks, one scale byte each
    scale = np.repeat(scale_bytes[:, None], 64, axis=1).view(E8M0)  # [10, 64]
    with np.errstate(over="ignore"):  # 448 * 2^127 is inf in fp32, on both sides
        want = formats.dequant_fp8_block(w, scale, 4)
    got = np.asarray(jax.jit(formats.dequant_fp8_block_jnp, static_argnums=2)(jnp.asarray(w), jnp.asarray(scale), 4))
    _assert_same_bits(got, want)
    # stacked leading dims (FP8 experts after convert.py, shared across helpers): same as row by row
    stacked = np.stack([w[:20], w[20:]]), np.stack([scale[:5], scale[5:]])
    got3 = np.asarray(formats.dequant_fp8_block_jnp(jnp.asarray(stacked[0]), jnp.asarray(stacked[1]), 4))
    _assert_same_bits(got3.reshape(40, 256), want)


def test_numpy_and_jnp_fp4_decoders_agree_bitwise_on_stacked_experts():
    rng = np.random.default_rng(0)
    # 3 experts x 4 rows x 128 bytes: every byte value 6 times; scale bytes from 2 up keep results normal fp32
    w = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), 6)).reshape(3, 4, 128)
    scale = rng.integers(2, 256, size=(3, 4, 8)).astype(np.uint8).view(E8M0)
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in fp32, on both sides
        want = formats.dequant_fp4(w, scale)
    assert want.shape == (3, 4, 256)
    got = np.asarray(jax.jit(formats.dequant_fp4_jnp)(jnp.asarray(w), jnp.asarray(scale)))
    _assert_same_bits(got, want)
    _assert_same_bits(np.asarray(linear.dequant_fp4(jnp.asarray(w), jnp.asarray(scale))), want)
    assert np.isnan(want).any()  # scale byte 255 occurs, so NaN placement is checked too
    for e in range(3):  # the stacked decode is the per-expert decode
        with np.errstate(over="ignore"):
            _assert_same_bits(formats.dequant_fp4(w[e], scale[e]), want[e])


def test_decoders_reject_mismatched_scale_shapes():
    with pytest.raises(ValueError, match=r"FP8 weight \[70, 96\] with 32x32 blocks needs scale \[3, 3\], got \[2, 3\]"):
        formats.dequant_fp8_block(np.zeros((70, 96), E4M3), np.zeros((2, 3), E8M0), 32)
    with pytest.raises(ValueError, match=r"packed FP4 weight \[4, 16\] needs scale \[4, 1\], got \[4, 2\]"):
        formats.dequant_fp4_jnp(jnp.zeros((4, 16), jnp.uint8), jnp.zeros((4, 2), jnp.float8_e8m0fnu))


def test_pow2_ceil_is_exact_at_and_around_powers_of_two():
    x = np.array([1.0, 1.0000001, 0.9999999, 2.0**-20, 3.0, 448.0, 2.0**-126], np.float32)
    assert formats.pow2_ceil(x).tolist() == [1.0, 2.0, 1.0, 2.0**-20, 4.0, 512.0, 2.0**-126]


def test_fp8_block_quantizer_scale_rule_and_round_trip():
    rng = np.random.default_rng(0)
    # 70 x 96 with 32x32 blocks: partial edge blocks in both dims, and column blocks 1e4 apart in magnitude
    w = rng.standard_normal((70, 96)).astype(np.float32) * np.repeat(np.float32([1e-3, 1.0, 10.0]), 32)
    q, s = formats.quantize_fp8_block(w, 32)
    assert q.dtype == E4M3 and s.dtype == E8M0 and q.shape == (70, 96) and s.shape == (3, 3)
    sf = formats.e8m0_to_f32(s)
    for i in range(3):
        for j in range(3):
            amax = np.abs(w[32 * i:32 * i + 32, 32 * j:32 * j + 32]).max()
            assert amax / sf[i, j] <= 448 < 2 * amax / sf[i, j]  # the smallest power of two that fits amax
    back = formats.dequant_fp8_block(q, s, 32)
    # e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 relative in the normal range, and at
    # most half the subnormal step (2^-10 of the block scale) below it
    s_full = np.repeat(np.repeat(sf, 32, 0), 32, 1)[:70, :96]
    assert (np.abs(back - w) <= np.abs(w) * 2**-4 + s_full * 2**-10).all()
    assert np.abs(back - w).max() > 0  # the bound is exercised, not met by an identity
    # an all-zero block takes the floored amax (1e-4 -> scale 2^-22) and decodes to zeros
    q0, s0 = formats.quantize_fp8_block(np.zeros((32, 32), np.float32), 32)
    assert formats.e8m0_to_f32(s0)[0, 0] == 2.0**-22 and not np.asarray(q0, np.float32).any()


def test_fp4_quantizer_grid_round_trip_and_packing():
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, 6], np.float32)
    w = np.tile(grid, (3, 2)) * np.array([[1.0], [0.25], [8.0]], np.float32)  # amax 6 * 2^k -> scale 2^k
    q, s = formats.quantize_fp4(w)
    assert q.dtype == np.uint8 and q.shape == (3, 16) and s.shape == (3, 1)
    assert formats.e8m0_to_f32(s)[:, 0].tolist() == [1.0, 0.25, 8.0]
    assert np.array_equal(formats.dequant_fp4(q, s), w)
    # element 2k in the low nibble: (0, .5) -> 0x10, (1, 1.5) -> 0x32, (-.5, -1) -> 0xa9
    assert q[0, 0] == 0x10 and q[0, 1] == 0x32 and q[0, 4] == 0xA9


def test_fp4_quantizer_error_bound_on_random_stacked_weights():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 8, 64)).astype(np.float32)
    q, s = formats.quantize_fp4(w)
    assert q.shape == (2, 8, 32) and s.shape == (2, 8, 2)
    back = formats.dequant_fp4(q, s)
    sf = np.repeat(formats.e8m0_to_f32(s), 32, axis=-1)
    # E2M1 has 1 mantissa bit: half a grid step is <= |x|/4 at or above 1 (in units of the scale) and
    # 0.25 below it; the scale keeps |x/s| <= 6, so nothing is clipped
    assert (np.abs(back - w) <= np.maximum(np.abs(w) / 4, 0.25 * sf)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        formats.quantize_fp4(np.zeros((2, 48), np.float32))
