"""Activation fake-quantization blocks (spec §2.9: 1x32 for V4.1; §3.1: 1x128 for V4-Flash), from the config."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model import linear
from deepinfer_jax.model.cache import init_cache
from deepinfer_jax.model.linear import act_quant, quant_linear
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp8
from deepinfer_jax.model.transformer import forward
from reference import numpy_v41 as ref

FIXTURES = Path(__file__).parent / "fixtures"
V4 = json.loads((FIXTURES / "v4_flash_config.json").read_text())
V41 = json.loads((FIXTURES / "v41_flash_config.json").read_text())
FQ_ONLY = Numerics("float32", True, False)  # fp32 activations with the quantizers: isolates the quantizer


def test_block_follows_the_weight_block_of_the_config():
    assert ModelConfig.from_dict(V4).act_quant_block == 128
    assert ModelConfig.from_dict(V41).act_quant_block == 32
    other = {**V4, "quantization_config": {**V4["quantization_config"], "weight_block_size": [64, 64]}}
    assert ModelConfig.from_dict(other).act_quant_block == 64


def test_hand_case_128_vs_32():
    """Row of 256: 448, then 127 x 0.013 (block 0 of 128), then 128 x 0.013.
    Block of 128 with amax 448: scale 2^ceil(log2(448/448)) = 1; 0.013 is E4M3-subnormal there (step 2^-9):
    0.013 / 2^-9 = 6.66 -> 7 -> 0.013671875. A block holding only 0.013: scale 2^ceil(log2(0.013/448))
    = 2^-15; 0.013 * 2^15 = 425.98 lies between the E4M3 neighbours 416 and 448 -> 416 -> 0.0126953125.
    So with 128-blocks the first 127 small values round coarsely, with 32-blocks only the first 31 do."""
    x = np.full(256, 0.013, np.float32)
    x[0] = 448.0
    coarse, fine = 0.013671875, 0.0126953125
    want128 = np.array([448.0] + [coarse] * 127 + [fine] * 128, np.float32)
    want32 = np.array([448.0] + [coarse] * 31 + [fine] * 224, np.float32)
    got128 = np.asarray(act_quant(jnp.asarray(x[None]), FQ_ONLY, 128))[0]
    got32 = np.asarray(act_quant(jnp.asarray(x[None]), FQ_ONLY, 32))[0]
    assert np.array_equal(got128, want128) and np.array_equal(got32, want32)
    assert np.array_equal(np.asarray(act_quant(jnp.asarray(x), Numerics.exact(), 128)), x)  # quantizers off


def test_matches_the_numpy_quantizer_bitwise():
    """Random rows over six decades of magnitude vs the float64 numpy reference quantizer at block 128."""
    r = np.random.default_rng(0)
    x = (r.standard_normal((6, 512)) * np.exp(r.uniform(-8, 6, (6, 512)))).astype(np.float32)
    want = ref.fake_quant_fp8(x.astype(np.float64), block=128)
    got = np.asarray(act_quant(jnp.asarray(x), FQ_ONLY, 128), np.float64)
    assert np.array_equal(got, want)
    assert not np.array_equal(want, ref.fake_quant_fp8(x.astype(np.float64), block=32))  # the block matters


def test_quant_linear_uses_the_given_block():
    """K = 256 with 32-blocks of magnitude 1, 2^-4, 2^-8, 2^-12 (x2) and weights scaled inversely, so every
    product matters: a 128-block quantizes the small blocks coarsely, a 32-block does not. Against float64
    numpy on the 128-block activations the only error is fp32 accumulation, at most K * 2^-24 = 1.5e-5 of
    sum |x_q||w| (measured 5e-8); the 32-block result is 4e-4 .. 2e-3 away, so the bound tells them apart."""
    r = np.random.default_rng(1)
    s = np.repeat(2.0 ** (-4 * (np.arange(8) % 4)), 32)
    x = (r.standard_normal((4, 256)) * s).astype(np.float32)
    w = (r.standard_normal((48, 256)) / s / 16).astype(np.float32)
    got = np.asarray(quant_linear(jnp.asarray(x), {"weight": jnp.asarray(w)}, FQ_ONLY, act_block=128), np.float64)
    xq = ref.fake_quant_fp8(x.astype(np.float64), block=128)
    want = xq @ w.T.astype(np.float64)
    other = ref.fake_quant_fp8(x.astype(np.float64), block=32) @ w.T.astype(np.float64)
    norm = np.abs(xq) @ np.abs(w.T.astype(np.float64))
    bound = 256 * 2.0**-24
    assert (np.abs(got - want) / norm).max() < bound < (np.abs(other - want) / norm).max()


def _traced_act_blocks(monkeypatch, cfg, params):
    """{(K, block)} of every activation quantization in one traced forward (jax.eval_shape: no compile).
    ``linear.act_quant`` is the one funnel of activation quantization (quant_linear, both expert paths);
    the KV quantizers call ``numerics.fake_quant_fp8`` under their own name and are not counted."""
    seen = set()

    def spy(x, block=32):
        seen.add((x.shape[-1], block))
        return fake_quant_fp8(x, block)

    monkeypatch.setattr(linear, "fake_quant_fp8", spy)
    numerics = Numerics.reference(kv_quant=False)  # the KV storage format does not touch these sites
    tok = jnp.zeros((1, 4), jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None]
    rows = None
    if cfg.engram_layer_ids:
        rows = jnp.zeros((1, 4, len(cfg.engram_layer_ids), cfg.engram_columns), jnp.int32)
    jax.eval_shape(lambda p, c: forward(p, cfg, c, tok, pos, rows, numerics), params, init_cache(cfg, 1, 16, numerics))
    return seen


def test_every_site_of_the_v4_forward_uses_the_config_block(monkeypatch, tiny_v4):
    """Tiny V4-Flash (weight blocks 128): every GEMM input is shorter than 128 (K = 64 = hidden_size; 32 =
    q_lora_rank = o_groups x o_lora_rank = moe_intermediate_size), so each row is one block of K
    (numerics.fit_block); with 32-blocks (V4.1's) the 64-wide rows would be two blocks."""
    cfg, params, _ = tiny_v4
    seen = _traced_act_blocks(monkeypatch, cfg, params)
    assert {k for k, _ in seen} == {cfg.hidden_size, cfg.q_lora_rank, cfg.o_groups * cfg.o_lora_rank,
                                    cfg.moe_intermediate_size}
    assert all(block == k for k, block in seen), sorted(seen)


def test_every_site_of_the_v41_forward_uses_32(monkeypatch, tiny_params, tiny_cfg):
    seen = _traced_act_blocks(monkeypatch, tiny_cfg, tiny_params)
    assert {block for _, block in seen} == {32} and len({k for k, _ in seen}) >= 3, sorted(seen)


def test_a_row_longer_than_a_block_must_divide():
    with pytest.raises(ValueError, match="neither a multiple"):
        act_quant(jnp.ones((1, 192)), FQ_ONLY, 128)


@pytest.mark.parametrize("block", [32, 16, 128, 24, 1])
def test_block_amax_is_the_reduce_bit_for_bit(block):
    """block_amax (the quantizers' per-block max |x|, a halving tree of elementwise maxima) gives a max
    reduce's bits: signed zeros, infinities, NaN, subnormals; 24 takes the reduce itself (not a power
    of two)."""
    from deepinfer_jax.model.numerics import block_amax

    r = np.random.default_rng(block)
    x = (r.standard_normal((6, 5, block)) * 10.0 ** r.integers(-40, 38, (6, 5, block))).astype(np.float32)
    x[0, 0] = -0.0
    x[1, 1, 0] = -np.inf
    x[2, 2, -1] = np.nan
    x[3, 3] = np.float32(1e-45)                        # subnormals only
    got = np.asarray(jax.jit(block_amax)(jnp.asarray(x)))
    want = np.asarray(jnp.max(jnp.abs(jnp.asarray(x)), axis=-1, keepdims=True))
    assert got.shape == want.shape == (6, 5, 1)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _grid_cases(limit: float) -> np.ndarray:
    """float32 values over [-limit, limit]: random magnitudes over every binade the format reaches, the
    format's grid points, the midpoints between them (ties) and their float32 neighbours, signed zeros."""
    rng = np.random.default_rng(0)
    mags = np.exp2(rng.uniform(-14, np.log2(limit), 200_000)).astype(np.float32)
    grid = np.unique(np.abs(mags.astype(DTYPE_OF[limit]).astype(np.float32)))
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    x = np.concatenate([mags, grid, mids, near, [0.0, limit]]).astype(np.float32)
    x = x[np.abs(x) <= limit]
    return np.concatenate([x, -x])


DTYPE_OF = {448.0: ml_dtypes.float8_e4m3fn, 6.0: ml_dtypes.float4_e2m1fn}


@pytest.mark.parametrize("limit,fn", [(448.0, "round_to_e4m3"), (6.0, "round_to_e2m1")])
def test_rounding_to_the_grid_is_the_cast_pair(limit, fn):
    """The quantizers' rounding (written so XLA:GPU cannot drop it as a no-op convert pair) is, bit for
    bit, a cast to the narrow type and back (ml_dtypes, an independent implementation), ties and the
    subnormal steps included."""
    from deepinfer_jax.model import numerics

    x = _grid_cases(limit)
    want = x.astype(DTYPE_OF[limit]).astype(np.float32)
    got = np.asarray(jax.jit(getattr(numerics, fn))(jnp.asarray(x)))
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, list(zip(x[bad[:5]], got[bad[:5]], want[bad[:5]]))


def _eqns(jaxpr):
    """Every equation of a jaxpr, sub-jaxprs (pjit, custom_jvp) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


@pytest.mark.parametrize("fn", ["fake_quant_fp8", "fake_quant_fp4_pow2", "fake_quant_fp4_e4m3"])
def test_quantizers_make_no_bare_narrow_cast_pair(fn):
    """No narrow value made inside a fake-quantizer is cast straight back: XLA:GPU (default excess
    precision) deletes such a pair as a no-op, and the GPU program then skips the rounding. The E4M3
    rounding casts, then passes the codes through an identity XLA does not fold (a select on their
    uint8 bits) before casting back; the deviceless H200 compile keeps its fp8 convert under the
    default options (session 28), and benchmarks/quant_rounding_gpu.py checks the bits on a GPU."""
    from deepinfer_jax.model import numerics

    closed = jax.make_jaxpr(getattr(numerics, fn))(jnp.ones((2, 64), jnp.float32))
    narrow = ("float8", "float4")
    made_by_cast = set()
    for eqn in _eqns(closed.jaxpr):
        if eqn.primitive.name != "convert_element_type":
            continue
        src, dst = eqn.invars[0], eqn.outvars[0]
        if any(t in str(dst.aval.dtype) for t in narrow):
            made_by_cast.add(dst)
        elif any(t in str(src.aval.dtype) for t in narrow):
            assert src not in made_by_cast, f"{fn}: a narrow cast is cast straight back:\n{closed}"


def test_round_to_bf16_is_the_cast_pair():
    """mHC's weight split rounds with ``round_to_bf16``: bitwise ml_dtypes' bf16 cast and back, from fp32
    subnormals to the largest finite values, ties included."""
    from deepinfer_jax.model.numerics import round_to_bf16

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-149, 126, 200_000))).astype(np.float32)
    # halfway between two bf16 values: the upper 16 bits of a finite float, then 0x8000
    ties = (rng.integers(1, 0x7F80, 1000).astype(np.uint32) << 16 | np.uint32(0x8000)).view(np.float32)
    x = np.concatenate([x, ties, -ties, [0.0, -0.0, 1e-45, -1e-45]]).astype(np.float32)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = np.asarray(jax.jit(round_to_bf16)(jnp.asarray(x)))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("block", [32, 64])
def test_the_epilogue_quantizer_is_the_model_quantizer_bit_for_bit(block):
    """``pallas_kernels.grouped_gemm.act_quant`` (the SwiGLU epilogue's quantizer, in ops Mosaic GPU
    lowers: scales from exponent bits, x times 1/s, a cast to E4M3 and back through float16) gives the
    bits of the model's ``fake_quant_fp8`` on bf16 rows: blocks of zeros (amax under the 1e-4 floor),
    bf16 subnormals, E4M3 ties and subnormal steps, amax exactly 448 x 2^k (no rounding up of the
    scale) and just above it, magnitudes from 2^-120 to 2^120."""
    from pallas_kernels.grouped_gemm.act_quant import fake_quant_blocks, pow2_scale
    from deepinfer_jax.model.numerics import fp8_scale

    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((256, 4 * block)) * np.exp2(rng.uniform(-120, 120, (256, 1)))).astype(np.float32)
    rows[0] = 0.0
    rows[1, :block] = 2e-5                                     # under the floor: s = 2^-22
    rows[2] = 1e-39                                            # bf16 subnormals
    rows[3, 0] = 448.0 * 2.0**-30                              # amax exactly 448 x 2^k
    rows[4, 0] = np.nextafter(np.float32(448.0 * 2.0**10), np.float32(np.inf))
    grid = _grid_cases(448.0)                                  # every E4M3 value and the ties between them
    rows = np.concatenate([rows, grid[: grid.size // (4 * block) * 4 * block].reshape(-1, 4 * block)])
    x = jnp.asarray(rows).astype(jnp.bfloat16)
    want = np.asarray(fake_quant_fp8(x, block)).view(np.uint16)
    got = np.asarray(jax.jit(fake_quant_blocks, static_argnums=1)(x.astype(jnp.float32), block)).view(np.uint16)
    bad = np.argwhere(got != want)
    assert bad.size == 0, [(tuple(i), rows[tuple(i)]) for i in bad[:5]]
    amax = np.abs(rows).max(axis=1)
    s, inv = (np.asarray(v) for v in pow2_scale(jnp.asarray(amax)))
    assert np.array_equal(s, np.asarray(fp8_scale(jnp.asarray(amax)))) and np.array_equal(s * inv, np.ones_like(s))
    with pytest.raises(ValueError, match="quantizer blocks"):
        fake_quant_blocks(jnp.ones((64, 96), jnp.float32), 64)
