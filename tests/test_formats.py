"""Stored-format decoders: the spec's real-byte fixtures (§5.4), NaN scales, round-trips, numpy == jnp."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer_jax.checkpoint import formats
from deepinfer_jax.model import linear


def test_fp8_fixture_from_the_real_checkpoint():
    # layers.0.attn.wkv.weight row 0 of V4.1 shard 3, block scale byte 0x73 (spec §5.4)
    w = np.frombuffer(bytes.fromhex("d871f2797069f0e5"), np.uint8).reshape(1, 8).view(ml_dtypes.float8_e4m3fn)
    scale = np.array([[0x73]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    got = formats.dequant_fp8_block(w, scale, 32)[0]
    assert got.tolist() == [-0.00390625, 0.03515625, -0.0390625, 0.0703125, 0.03125, 0.017578125, -0.03125,
                            -0.0126953125]
    assert np.asarray(linear.dequant_fp8(jnp.asarray(w), jnp.asarray(scale)))[0].tolist() == got.tolist()


def test_fp4_fixture_from_the_real_checkpoint():
    # layers.0.ffn.experts.0.w1.weight row 0, scale byte 0x78 (spec §5.4)
    w = np.frombuffer(bytes.fromhex("a0a8ec4aadaf42aa"), np.uint8).reshape(1, 8)
    scale = np.array([[0x78]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    want = [0, -0.0078125, 0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625, -0.0234375, -0.0078125,
            -0.046875, -0.0078125, 0.0078125, 0.015625, -0.0078125, -0.0078125]
    assert formats.dequant_fp4(w, scale)[0].tolist() == want
    assert np.asarray(linear.dequant_fp4(jnp.asarray(w), jnp.asarray(scale)))[0].tolist() == want


def test_e8m0_extremes():
    b = np.array([0, 1, 126, 127, 128, 254, 255], np.uint8)
    got = formats.e8m0_to_f32(b)
    assert got[:-1].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert np.isnan(got[-1])  # 0xFF is NaN and must propagate, not clamp
    w = np.ones((1, 32), ml_dtypes.float8_e4m3fn)
    assert np.isnan(formats.dequant_fp8_block(w, np.array([[255]], np.uint8).view(ml_dtypes.float8_e8m0fnu), 32)).all()


def test_fp8_block_round_trip_and_scale_layout():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 96)).astype(np.float32) * np.array([1e-3] * 48 + [10.0] * 48)
    q, s = formats.quantize_fp8_block(w, 32)
    assert q.shape == (70, 96) and s.shape == (3, 3)
    back = formats.dequant_fp8_block(q, s, 32)
    # e4m3 has 3 mantissa bits: error <= 2^-4 relative in the normal range, and at most half the
    # subnormal step (2^-10 of the block scale) below it
    s_full = np.repeat(np.repeat(formats.e8m0_to_f32(s), 32, 0), 32, 1)[:70, :96]
    assert (np.abs(back - w) <= np.abs(w) * 2**-4 + s_full * 2**-10).all()
    assert np.array_equal(np.asarray(linear.dequant_fp8(jnp.asarray(q), jnp.asarray(s))), back)


def test_fp4_round_trip_exact_on_grid_values():
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, 6], np.float32)
    w = np.tile(grid, (3, 2)) * np.array([[1.0], [0.25], [8.0]], np.float32)
    q, s = formats.quantize_fp4(w)
    assert q.shape == (3, 16) and s.shape == (3, 1)
    assert np.array_equal(formats.dequant_fp4(q, s), w)
    assert np.array_equal(np.asarray(linear.dequant_fp4(jnp.asarray(q), jnp.asarray(s))), w)
    # the packing: element 2k in the low nibble
    assert q[0, 0] == (0x1 << 4) | 0x0 and q[0, 1] == (0x3 << 4) | 0x2
