"""The grouped GEMM's E4M3 operand form for FP4 experts (``fp4_operands="e4m3"``, fp8_operands.py) and
FP8 weights (``fp8_operands="e4m3"``): the bit move replayed against ml_dtypes for every byte, the
interpreter's form against the PTX replay, the exact re-expression of FP8-quantized rows, and the kernel
in the Mosaic GPU interpreter against the float64 oracle, bitwise batch-invariant, and lowering for
Hopper, for both weight formats."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_gemm import GroupedMatmulConfig, WeightFormat
from pallas_kernels.grouped_gemm.fp8_operands import (E4m3Rows, e4m3_rows, emulate_fp4_to_e4m3,
                                                      fp4_bytes_to_e4m3_jnp)
from pallas_kernels.interpret import gpu_interpreter, races_found

from test_grouped_gemm import _bits, _oracle, _weights


def _e2m1(codes):
    return np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _e4m3(byte_words):
    return np.asarray(byte_words, np.uint32).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def test_ptx_bit_move_gives_each_nibble_times_2_pow_minus_6_for_every_byte():
    """All 256 bytes in every position of a word: the low-nibble word holds each byte's element 2j, the
    high-nibble word element 2j+1, each the E2M1 value times 2^-6 (signed zeros included)."""
    byte = np.arange(256, dtype=np.uint32)
    words = byte | (np.roll(byte, 1) << 8) | (np.roll(byte, 2) << 16) | (np.roll(byte, 3) << 24)
    lo, hi = emulate_fp4_to_e4m3(words)
    packed = words.view(np.uint8).reshape(-1, 4)
    want_lo, want_hi = _e2m1(packed & 15) * 2.0 ** -6, _e2m1(packed >> 4) * 2.0 ** -6
    got_lo, got_hi = _e4m3(lo).reshape(-1, 4), _e4m3(hi).reshape(-1, 4)
    np.testing.assert_array_equal(got_lo, want_lo)
    np.testing.assert_array_equal(got_hi, want_hi)
    assert np.array_equal(np.signbit(got_lo), np.signbit(want_lo))
    assert np.array_equal(np.signbit(got_hi), np.signbit(want_hi))


def test_interpreter_bit_move_is_the_ptx_one_in_the_kernel_k_order():
    """[rows, 16] bytes -> [rows, 32] E4M3: columns 0-15 the low nibbles, 16-31 the high ones (element
    2j + p at column 16p + j, ``kernel.fp4_k_permutation``), bytes equal to the PTX replay's."""
    from pallas_kernels.grouped_gemm.kernel import fp4_k_permutation

    q = np.random.default_rng(0).integers(0, 256, (8, 32)).astype(np.uint8)     # two 16-byte blocks a row
    got = np.asarray(fp4_bytes_to_e4m3_jnp(jnp.asarray(q)))
    lo, hi = emulate_fp4_to_e4m3(q.reshape(8, 2, 4, 4).view(np.uint32).reshape(8, 2, 4))
    want = np.concatenate([lo.view(np.uint8).reshape(8, 2, 16), hi.view(np.uint8).reshape(8, 2, 16)], axis=-1)
    assert np.array_equal(got.view(np.uint8), want.reshape(8, 64))
    elements = np.stack([_e2m1(q & 15), _e2m1(q >> 4)], -1).reshape(8, 64)        # natural K order
    perm = np.asarray(fp4_k_permutation(64))
    np.testing.assert_array_equal(got.astype(np.float64), elements[:, perm] * 2.0 ** -6)


@pytest.mark.parametrize("block", [32, 128])
def test_e4m3_rows_reexpress_fp8_quantized_rows_exactly(block):
    from deepinfer_jax.model.numerics import fake_quant_fp8

    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 256)) * np.repeat(2.0 ** rng.integers(-20, 20, (6, 256 // block)), block, 1)
    x[2, 64:96] = 0.0                                  # an all-zero block
    xq = fake_quant_fp8(jnp.asarray(x, jnp.float32), block).astype(jnp.bfloat16)
    rows = e4m3_rows(xq)
    assert rows.values.dtype == jnp.float8_e4m3fn and rows.scale.shape == (6, 8)
    back = np.asarray(rows.values, np.float64) * np.repeat(np.asarray(rows.scale, np.float64), 32, 1)
    np.testing.assert_array_equal(back, np.asarray(xq, np.float64))
    s = np.asarray(rows.scale)
    assert np.all(np.log2(s) == np.round(np.log2(s)))    # powers of two
    # not FP8 values (a bf16 with more than 4 significant bits): rounded, so the exactness check can fail
    y = jnp.asarray([[1.0 + 2.0 ** -6] + [0.0] * 31], jnp.bfloat16)
    r = e4m3_rows(y)
    assert float(r.values[0, 0].astype(jnp.float32) * r.scale[0, 0]) != float(y[0, 0])


def test_e4m3_rows_refuse_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        e4m3_rows(jnp.zeros((2, 48), jnp.bfloat16))


def test_config_refuses_an_unknown_operand_form():
    with pytest.raises(ValueError, match="fp4_operands"):
        GroupedMatmulConfig(fp4_operands="fp8")
    with pytest.raises(ValueError, match="fp8_operands"):
        GroupedMatmulConfig(fp8_operands="fp4")


def test_each_operand_field_applies_to_its_own_weight_format():
    from pallas_kernels.grouped_gemm.config import uses_e4m3_rows

    fp4_only, fp8_only = GroupedMatmulConfig(fp4_operands="e4m3"), GroupedMatmulConfig(fp8_operands="e4m3")
    assert uses_e4m3_rows(fp4_only, WeightFormat.FP4) and not uses_e4m3_rows(fp4_only, WeightFormat.FP8)
    assert uses_e4m3_rows(fp8_only, WeightFormat.FP8) and not uses_e4m3_rows(fp8_only, WeightFormat.FP4)
    assert not uses_e4m3_rows(GroupedMatmulConfig(fp4_operands="e4m3", fp8_operands="e4m3"), WeightFormat.BF16)


# ---- the kernel in the Mosaic GPU interpreter -----------------------------------------------------------

# Staged A (the interpreter's wgmma reads shared memory), 3 K steps through 2 stages (slot reuse).
_E4M3_CFG = GroupedMatmulConfig(block_m=16, block_n=128, block_k=64, stages=2, a_from_registers=False,
                                fp4_operands="e4m3", fp8_operands="e4m3")
_QUANT = [WeightFormat.FP4, WeightFormat.FP8]


def _fp8_rows(rng, m, k):
    """bf16 rows that are E4M3 values times a power of two per 32 columns, the magnitudes spread over
    2^-8..2^8 between blocks (as the model's quantized expert inputs)."""
    from deepinfer_jax.model.numerics import fake_quant_fp8

    x = rng.standard_normal((m, k)) * np.repeat(2.0 ** rng.integers(-8, 9, (m, k // 32)), 32, 1)
    return fake_quant_fp8(jnp.asarray(x, jnp.float32), 32).astype(jnp.bfloat16)


@pytest.mark.parametrize("fmt", _QUANT, ids=lambda f: f.value)
def test_e4m3_kernel_in_gpu_interpreter_matches_the_float64_oracle(fmt):
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    rng = np.random.default_rng(7)
    g, n, k = 3, 128, 192
    w, s = _weights(rng, fmt, g, n, k)
    x = _fp8_rows(rng, 13, k)
    gid = jnp.asarray([2, 0, 2, -1, 1, 2, 2, 0, 3, 2, 2, 1, 2], jnp.int32)
    with gpu_interpreter(detect_races=True):
        got = np.asarray(grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=_E4M3_CFG))
    assert not races_found()
    want = _oracle(x, w, gid, s, fmt)
    # Exact products; the interpreter sums each 32-column block and the scaled blocks in float32:
    # a few float32 ulps of the largest partial sum (K=192).
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.all(got[[3, 8]] == 0)                      # ids -1 and G give zero rows


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
@pytest.mark.parametrize("fmt", _QUANT, ids=lambda f: f.value)
def test_e4m3_kernel_row_bits_do_not_depend_on_the_batch_or_the_launch(fmt):
    """A row alone and among others (sharing its tile) gives the same bits; so do the persistent launch,
    4 consumer warpgroups, tile-major weights and the overlapped form (two block accumulators)."""
    from pallas_kernels.grouped_gemm.config import tile_major_weights
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    rng = np.random.default_rng(8)
    g, n, k = 3, 256, 128
    w, s = _weights(rng, fmt, g, n, k)
    x = _fp8_rows(rng, 11, k)
    gid = jnp.asarray([1, 1, 0, 1, 2, 1, 1, 1, 1, 1, 0], jnp.int32)
    variants = (dict(persistent=True), dict(consumers=4, block_n=256), dict(weights_tile_major=True),
                dict(e4m3_overlap=True), dict(e4m3_overlap=True, persistent=True))
    with gpu_interpreter():
        alone = grouped_matmul_pallas(x[6:7], w, gid[6:7], s, out_dtype=jnp.float32, config=_E4M3_CFG)
        among = grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=_E4M3_CFG)
        others = []
        for extra in variants:
            cfg = dataclasses.replace(_E4M3_CFG, **extra)
            w_c = tile_major_weights(w, cfg.block_n, cfg.block_k) if cfg.weights_tile_major else w
            others.append(grouped_matmul_pallas(x, w_c, gid, s, out_dtype=jnp.float32, config=cfg))
    assert np.array_equal(_bits(among[6]), _bits(alone[0]))
    for extra, y in zip(variants, others):
        assert np.array_equal(_bits(y), _bits(among)), extra


def test_tiles_api_takes_e4m3_rows_only_with_an_e4m3_config():
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_tiles, tile_rows

    rng = np.random.default_rng(9)
    w, s = _weights(rng, WeightFormat.FP4, 2, 128, 64)
    x = _fp8_rows(rng, 5, 64)
    gid = jnp.asarray([0, 1, 1, 0, 1], jnp.int32)
    plan, rows = tile_rows(x, gid, num_groups=2, block_m=16, fp4=True, e4m3=True)
    assert isinstance(rows, E4m3Rows)
    bf16_cfg = dataclasses.replace(_E4M3_CFG, fp4_operands="bf16")
    with pytest.raises(ValueError, match="E4m3Rows"):
        grouped_matmul_tiles(plan, rows, w, s, config=bf16_cfg)
    _, plain = tile_rows(x, gid, num_groups=2, block_m=16, fp4=True)
    with pytest.raises(ValueError, match="bf16 rows"):
        grouped_matmul_tiles(plan, plain, w, s, config=_E4M3_CFG)


@pytest.mark.parametrize("extra", [dict(block_m=8, block_n=256, block_k=128, stages=8, consumers=4, persistent=True),
                                   dict(block_m=8, block_n=256, block_k=128, stages=8, consumers=4, persistent=True,
                                        e4m3_overlap=True),
                                   dict(block_m=64, block_n=256, block_k=128, stages=4, consumers=2)],
                         ids=["decode", "decode-overlapped", "chunk"])
@pytest.mark.parametrize("fmt", _QUANT, ids=lambda f: f.value)
def test_e4m3_kernel_lowers_for_hopper_with_a_in_registers(extra, fmt):
    """The GPU form (E4M3 A in registers, WGMMA_8BIT; FP4's inline PTX) passes Mosaic GPU's lowering for
    CUDA."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    g, n, k, m = 4, 256, 256, 40
    w, s = ((jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8))
            if fmt is WeightFormat.FP4 else
            (jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((g, n // 32, k // 32), jnp.uint8)))
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), w, jax.ShapeDtypeStruct((m,), jnp.int32), s)
    from pallas_kernels.grouped_gemm.config import fit_stages

    # (FP8 weight tiles are twice FP4's bytes: the ring is as deep as shared memory allows)
    cfg = fit_stages(GroupedMatmulConfig(fp4_operands="e4m3", fp8_operands="e4m3", **extra), fmt, jnp.float32)
    lowered = jax.jit(lambda *a: grouped_matmul_pallas(*a, config=cfg, out_dtype=jnp.float32)).trace(*args).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text


def test_tuned_config_keeps_the_e4m3_form_off_the_spilling_tiles():
    """Beyond the decode phase the E4M3 form takes tiles of <= 32 rows (64- and 128-row tiles spill in
    ptxas and lost on the H100); decode tiles are the bf16 form's, with the blocks overlapped (faster on
    the H200, same bits) only there; other formats ignore the field."""
    from pallas_kernels.grouped_gemm.config import E4M3_MAX_BLOCK_M, tile_phase, tuned_config

    g, n, k = 384, 2304, 5120
    for m in (384, 1536, 3072, 6144, 12288, 49152, 196608):
        bf16 = tuned_config(m, g, n, k, WeightFormat.FP4, jnp.float32)
        e4m3 = tuned_config(m, g, n, k, WeightFormat.FP4, jnp.float32, base=GroupedMatmulConfig(fp4_operands="e4m3"))
        assert e4m3.fp4_operands == "e4m3" and e4m3.block_m <= E4M3_MAX_BLOCK_M, m
        assert not bf16.e4m3_overlap, m
        if tile_phase(m, g, WeightFormat.FP4) == "decode":
            assert e4m3.e4m3_overlap, m
            assert dataclasses.replace(e4m3, fp4_operands="bf16", e4m3_overlap=False) == bf16, m
        else:
            assert not e4m3.e4m3_overlap, m                   # spills at the 32-row tile: unmeasured
            assert bf16.block_m > E4M3_MAX_BLOCK_M, m         # the check above is not vacuous
    fp8 = tuned_config(12288, g, n, k, WeightFormat.FP8, jnp.float32, base=GroupedMatmulConfig(fp4_operands="e4m3"))
    assert fp8.block_m == tuned_config(12288, g, n, k, WeightFormat.FP8, jnp.float32).block_m
