"""grouped_matmul: the reference vs a float64 numpy oracle, the XLA path vs the reference, the Mosaic
GPU kernel (run on the CPU by the Mosaic GPU interpreter) vs the reference, the kernel lowering for
Hopper, the tile plan, input checks, and bitwise batch invariance of the XLA path with a negative
control that fails the same check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_gemm import (GroupedMatmulConfig, WeightFormat, check_inputs, grouped_matmul,
                                         grouped_matmul_reference, grouped_matmul_xla)
from pallas_kernels.grouped_gemm.config import kernel_unsupported_reason, smem_bytes
from pallas_kernels.grouped_gemm.plan import bucketed_tiles, make_tile_plan, max_tiles
from pallas_kernels.grouped_gemm.reference import unpack_fp4
from pallas_kernels.interpret import gpu_interpreter, races_found

# The checkpoint's E2M1 code table, written out independently of the package's.
_FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _weights(rng, fmt: WeightFormat, g: int, n: int, k: int):
    """Random weights of a format; scales near 2^0 so outputs stay O(10) in bf16."""
    if fmt is WeightFormat.BF16:
        return jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16), None
    if fmt is WeightFormat.FP8:
        w = jnp.asarray(rng.standard_normal((g, n, k)) * 4, jnp.float8_e4m3fn)
        return w, jnp.asarray(rng.integers(124, 130, (g, n // 32, k // 32)), jnp.uint8)
    w = jnp.asarray(rng.integers(0, 256, (g, n, k // 2)), jnp.uint8)
    return w, jnp.asarray(rng.integers(124, 130, (g, n, k // 32)), jnp.uint8)


def _oracle(x, w, gid, s, fmt: WeightFormat):
    """float64 numpy, straight from the format definitions, one row at a time."""
    x = np.asarray(x, np.float64)
    gid = np.asarray(gid)
    g = w.shape[0]
    if fmt is WeightFormat.BF16:
        wd = np.asarray(w.astype(jnp.float32), np.float64)
    elif fmt is WeightFormat.FP8:
        sc = 2.0 ** (np.asarray(s, np.float64) - 127)
        wd = np.asarray(w.astype(jnp.float32), np.float64) * np.kron(sc, np.ones((1, 32, 32)))
    else:
        b = np.asarray(w)
        vals = np.empty(b.shape[:-1] + (b.shape[-1] * 2,))
        vals[..., 0::2] = _FP4[b & 15]
        vals[..., 1::2] = _FP4[b >> 4]
        wd = vals * np.repeat(2.0 ** (np.asarray(s, np.float64) - 127), 32, axis=-1)
    out = np.zeros((x.shape[0], wd.shape[1]))
    for i, e in enumerate(gid):
        if 0 <= e < g:
            out[i] = wd[e] @ x[i]
    return out


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


ALL_FORMATS = [WeightFormat.BF16, WeightFormat.FP8, WeightFormat.FP4]


# ---- reference and XLA path ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_reference_matches_float64_oracle(fmt):
    rng = np.random.default_rng(1)
    g, n, k, m = 4, 64, 128, 23
    w, s = _weights(rng, fmt, g, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = jnp.asarray(rng.integers(-2, g + 2, m), jnp.int32)     # includes out-of-range ids
    got = np.asarray(grouped_matmul_reference(x, w, gid, s))
    want = _oracle(x, w, gid, s, fmt)
    # float32 HIGHEST over K=128 exact products: a few f32 ulps of the largest partial sum.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    bad = (np.asarray(gid) < 0) | (np.asarray(gid) >= g)
    assert bad.any() and np.all(got[bad] == 0)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_xla_path_matches_reference(fmt):
    rng = np.random.default_rng(2)
    g, n, k, m = 5, 64, 256, 37
    w, s = _weights(rng, fmt, g, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = jnp.asarray(rng.integers(-1, g + 1, m), jnp.int32)     # unsorted, with dropped rows
    want = np.asarray(grouped_matmul_reference(x, w, gid, s))
    got32 = np.asarray(grouped_matmul_xla(x, w, gid, s, out_dtype=jnp.float32))
    # Same exact bf16 operands (the dequantized values fit bf16), float32 sums in another order.
    np.testing.assert_allclose(got32, want, rtol=0, atol=1e-5 * np.abs(want).max())
    got16 = np.asarray(grouped_matmul_xla(x, w, gid, s).astype(jnp.float32))
    # bf16 output: one rounding, half an ulp = 2^-9 relative.
    np.testing.assert_allclose(got16, want, rtol=2 ** -8, atol=1e-5 * np.abs(want).max())


def test_xla_path_handles_empty_and_single_expert_inputs():
    rng = np.random.default_rng(3)
    w, _ = _weights(rng, WeightFormat.BF16, 1, 32, 64)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    y = grouped_matmul_xla(x, w, jnp.zeros((3,), jnp.int32), out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x, np.float64) @ np.asarray(w[0], np.float64).T,
                               rtol=1e-5, atol=1e-4)
    assert grouped_matmul_xla(x[:0], w, jnp.zeros((0,), jnp.int32)).shape == (0, 32)


# ---- bitwise batch invariance (XLA path) and the negative control ------------------------------------

_INV_G, _INV_N, _INV_K, _PROBE_G = 6, 64, 512, 4


def _invariance_cases(rng, probe_x):
    """(name, x, group ids, probe position): the probe row among other rows and group sizes."""
    cases = []
    for m in (2, 3, 5, 8, 33, 64):
        x = jnp.asarray(rng.standard_normal((m, _INV_K)), jnp.bfloat16)
        gid = rng.integers(0, _INV_G, m)
        p = m // 2
        gid[p] = _PROBE_G
        cases.append((f"M={m}", x.at[p].set(probe_x), jnp.asarray(gid, jnp.int32), p))
    x = jnp.asarray(rng.standard_normal((64, _INV_K)), jnp.bfloat16)
    cases.append(("uniform", x.at[_PROBE_G].set(probe_x), jnp.arange(64, dtype=jnp.int32) % _INV_G, _PROBE_G))
    cases.append(("all in one expert", x.at[41].set(probe_x), jnp.full((64,), _PROBE_G, jnp.int32), 41))
    uneven = np.concatenate([np.full(40, _PROBE_G), rng.integers(0, 2, 24)])
    cases.append(("uneven", x.at[7].set(probe_x), jnp.asarray(uneven, jnp.int32), 7))
    return cases


def _variant_rows(fn, rng, probe_x, only=None):
    """Names of the cases in which the probe row's bits differ from the probe computed alone."""
    alone = _bits(fn(probe_x[None], jnp.asarray([_PROBE_G], jnp.int32))[0])
    return [name for name, x, gid, p in _invariance_cases(rng, probe_x)
            if (only is None or name in only) and not np.array_equal(_bits(fn(x, gid)[p]), alone)]


@pytest.mark.parametrize("fmt,out_dtype", [(WeightFormat.BF16, jnp.float32), (WeightFormat.FP4, jnp.bfloat16)],
                         ids=["bf16-f32out", "fp4-bf16out"])
def test_xla_path_is_bitwise_batch_invariant(fmt, out_dtype):
    rng = np.random.default_rng(4)
    w, s = _weights(rng, fmt, _INV_G, _INV_N, _INV_K)
    probe_x = jnp.asarray(rng.standard_normal(_INV_K), jnp.bfloat16)
    fn = jax.jit(lambda x, gid: grouped_matmul_xla(x, w, gid, s, out_dtype=out_dtype))
    assert _variant_rows(fn, rng, probe_x) == []


def test_negative_control_plain_dot_fails_the_same_check():
    """A plain float32 XLA dot of the rows against the probe's expert is not invariant on CPU (M=1 takes
    a matrix-vector path with another summation order), so the check above can fail. (The bf16 dot with
    float32 accumulation was variant the same way up to jax 0.12.0.1 and is invariant at these shapes
    on 0.12.1, so the control is the float32 one, variant on both.)"""
    rng = np.random.default_rng(4)
    w, _ = _weights(rng, WeightFormat.BF16, _INV_G, _INV_N, _INV_K)
    probe_x = jnp.asarray(rng.standard_normal(_INV_K), jnp.bfloat16)
    w32 = w[_PROBE_G].astype(jnp.float32)
    fn = jax.jit(lambda x, gid: jnp.einsum("mk,nk->mn", x.astype(jnp.float32), w32))
    assert len(_variant_rows(fn, rng, probe_x)) == 9     # every case differs from M=1


def test_xla_path_is_invariant_with_another_tile_size():
    """FP8, and a tile size that does not divide the group sizes (fewer cases: compile time)."""
    rng = np.random.default_rng(5)
    w, s = _weights(rng, WeightFormat.FP8, _INV_G, _INV_N, _INV_K)
    probe_x = jnp.asarray(rng.standard_normal(_INV_K), jnp.bfloat16)
    cfg = GroupedMatmulConfig(xla_block_m=3)
    fn = jax.jit(lambda x, gid: grouped_matmul_xla(x, w, gid, s, out_dtype=jnp.float32, config=cfg))
    assert _variant_rows(fn, rng, probe_x, only=("M=5", "M=33", "all in one expert", "uneven")) == []


# ---- tile plan -------------------------------------------------------------------------------------------

def test_tile_groups_is_searchsorted_right():
    """A tile's group is the number of groups ending at or before it (one fused reduction), as
    jnp.searchsorted(side="right") says; -1 past the used tiles. Empty groups (repeated ends) included."""
    from pallas_kernels.grouped_gemm.plan import _tile_groups

    r = np.random.default_rng(0)
    for _ in range(30):
        tile_end = jnp.cumsum(jnp.asarray(r.integers(0, 4, r.integers(1, 50)), jnp.int32))
        t = int(tile_end[-1]) + int(r.integers(0, 5))
        ids = jnp.arange(t)
        want = jnp.where(ids < tile_end[-1], jnp.searchsorted(tile_end, ids, side="right"), -1)
        np.testing.assert_array_equal(np.asarray(_tile_groups(tile_end, t)), np.asarray(want))


@pytest.mark.parametrize("m,g,bm", [(1, 384, 8), (7, 3, 4), (384, 384, 8), (384, 384, 16), (1024, 384, 8),
                                    (300, 5, 64)])
def test_plan_by_compares_is_the_sorted_plan(m, g, bm):
    """Small M builds the plan from compares (no sort or scatter); every field equals the sort-and-scatter
    plan's, for skewed and invalid group ids and a grid larger than max_tiles."""
    from pallas_kernels.grouped_gemm import plan as plan_mod

    assert m <= plan_mod.COMPARE_PLAN_ROWS
    rng = np.random.default_rng(m * 7 + bm)
    cases = [rng.integers(-2, g + 2, m), np.full(m, g - 1), rng.integers(0, min(g, 4), m),
             rng.choice(rng.integers(0, g, 6), m)]
    for gid in cases:
        gid = jnp.asarray(gid, jnp.int32)
        valid = (gid >= 0) & (gid < g)
        key = jnp.where(valid, gid, g)
        for t in (max_tiles(m, g, bm), max_tiles(m, g, bm) + 3):
            got = plan_mod._plan_by_compares(key, valid, g, bm, t)
            want = plan_mod._plan_by_sort(key, valid, g, bm, t)
            for name in ("row_src", "tile_group", "dest_m", "valid_m", "sorted_pos", "sorted_m"):
                np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                              err_msg=f"{name}, m={m} g={g} bm={bm} tiles={t}")


@pytest.mark.parametrize("m,g,bm", [(1, 384, 64), (7, 3, 4), (100, 5, 8), (33, 40, 16), (64, 1, 64)])
def test_plan_places_every_row_once_in_a_tile_of_its_group(m, g, bm):
    rng = np.random.default_rng(m + g)
    for trial in range(3):
        gid = rng.integers(-1, g + 1, m) if trial else np.full(m, g - 1)
        plan = make_tile_plan(jnp.asarray(gid, jnp.int32), g, bm)
        row_src, tile_group = np.asarray(plan.row_src), np.asarray(plan.tile_group)
        dest, valid = np.asarray(plan.dest_m), np.asarray(plan.valid_m)
        assert tile_group.shape == (max_tiles(m, g, bm),)
        np.testing.assert_array_equal(valid, (gid >= 0) & (gid < g))
        for r in np.flatnonzero(valid):
            assert row_src[dest[r]] == r
            assert tile_group[dest[r] // bm] == gid[r]          # the row sits in a tile of its own group
        placed = row_src[row_src < m]
        assert sorted(placed) == sorted(np.flatnonzero(valid))  # each valid row exactly once
        # the compaction order (untile_rows): valid rows first, by padded row, each at its own index
        sorted_pos, sorted_m = np.asarray(plan.sorted_pos), np.asarray(plan.sorted_m)
        n_valid = int(valid.sum())
        assert sorted(sorted_m) == list(range(m))
        assert np.array_equal(sorted_pos[:n_valid], np.sort(dest[valid]))
        assert np.all(sorted_m[valid] < n_valid)
        assert np.array_equal(sorted_pos[sorted_m[valid]], dest[valid])
        used = tile_group >= 0
        assert not np.any(used[np.argmin(used):]) or used.all()  # used tiles come first
        # A tile's rows are contiguous in the caller's order within the group (stable sort).
        for t in np.flatnonzero(used):
            rows = row_src[t * bm:(t + 1) * bm]
            rows = rows[rows < m]
            assert np.all(np.diff(rows) > 0)


def test_max_tiles_is_a_tight_bound():
    # The worst split: min(G, M) groups, all but one holding a single row.
    m, g, bm = 50, 7, 8
    gid = np.concatenate([np.arange(g - 1), np.full(m - g + 1, g - 1)])
    tiles = (np.bincount(gid, minlength=g) + bm - 1) // bm
    assert tiles.sum() == max_tiles(m, g, bm)
    rng = np.random.default_rng(0)
    for _ in range(200):
        m, g, bm = int(rng.integers(1, 300)), int(rng.integers(1, 50)), int(rng.choice([1, 8, 64]))
        counts = np.bincount(rng.integers(0, g, m), minlength=g)
        assert ((counts + bm - 1) // bm).sum() <= max_tiles(m, g, bm)
    assert bucketed_tiles(3, 384, 64) == 8 and bucketed_tiles(300, 384, 32) == 512 and bucketed_tiles(0, 4, 8) == 0


def test_fp4_kernel_column_order_is_low_nibbles_then_high_nibbles():
    from pallas_kernels.grouped_gemm.kernel import fp4_k_permutation

    rng = np.random.default_rng(6)
    packed = jnp.asarray(rng.integers(0, 256, (3, 32)), jnp.uint8)        # K = 64
    vals = np.asarray(unpack_fp4(packed))
    permuted = vals[:, np.asarray(fp4_k_permutation(64))]
    b = np.asarray(packed)
    for blk in range(2):
        cols = slice(blk * 16, (blk + 1) * 16)
        np.testing.assert_array_equal(permuted[:, blk * 32: blk * 32 + 16], _FP4[b[:, cols] & 15])
        np.testing.assert_array_equal(permuted[:, blk * 32 + 16: blk * 32 + 32], _FP4[b[:, cols] >> 4])


# ---- config and input checks ------------------------------------------------------------------------------

def test_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="block_m"):
        GroupedMatmulConfig(block_m=12)
    with pytest.raises(ValueError, match="block_n"):
        GroupedMatmulConfig(block_n=64)
    with pytest.raises(ValueError, match="block_k"):
        GroupedMatmulConfig(block_k=96)
    with pytest.raises(ValueError, match="stages"):
        GroupedMatmulConfig(stages=1)
    cfg = GroupedMatmulConfig()
    assert kernel_unsupported_reason(2304, 5120, WeightFormat.FP4, cfg) is None
    assert "block_n" in kernel_unsupported_reason(2300, 5120, WeightFormat.FP4, cfg)
    assert "block_k" in kernel_unsupported_reason(2304, 5100, WeightFormat.FP4, cfg)
    assert "32-byte swizzle" in kernel_unsupported_reason(2304, 5120, WeightFormat.FP4, GroupedMatmulConfig(block_m=8))
    assert kernel_unsupported_reason(2304, 5120, WeightFormat.FP4, GroupedMatmulConfig(block_m=8), jnp.float32) is None
    big = GroupedMatmulConfig(block_m=256, block_n=256, block_k=256, stages=4)
    assert "shared memory" in kernel_unsupported_reason(2304, 5120, WeightFormat.BF16, big)
    assert smem_bytes(cfg, WeightFormat.FP4, jnp.bfloat16) < smem_bytes(cfg, WeightFormat.BF16, jnp.bfloat16)


def test_input_checks_name_the_offending_array():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    gid = jnp.zeros((4,), jnp.int32)
    w16 = jnp.zeros((2, 32, 64), jnp.bfloat16)
    assert check_inputs(x, w16, gid, None)[0] is WeightFormat.BF16
    with pytest.raises(ValueError, match="x_mk must be bfloat16"):
        check_inputs(x.astype(jnp.float32), w16, gid, None)
    with pytest.raises(ValueError, match="group_ids_m must be"):
        check_inputs(x, w16, gid[:3], None)
    with pytest.raises(ValueError, match="K=64 but w"):
        check_inputs(x, jnp.zeros((2, 32, 48), jnp.bfloat16), gid, None)
    with pytest.raises(ValueError, match="no w_scale"):
        check_inputs(x, w16.astype(jnp.float8_e4m3fn), gid, None)
    w4 = jnp.zeros((2, 32, 32), jnp.uint8)
    assert check_inputs(x, w4, gid, jnp.zeros((2, 32, 2), jnp.uint8))[0] is WeightFormat.FP4
    with pytest.raises(ValueError, match=r"w_scale for fp4 weights .* must be \(2, 32, 2\)"):
        check_inputs(x, w4, gid, jnp.zeros((2, 1, 2), jnp.uint8))
    w8 = jnp.zeros((2, 32, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"w_scale for fp8 weights .* must be \(2, 1, 2\)"):
        check_inputs(x, w8, gid, jnp.zeros((2, 32, 2), jnp.uint8))
    with pytest.raises(ValueError, match="w_scale must be E8M0"):
        check_inputs(x, w8, gid, jnp.zeros((2, 1, 2), jnp.float32))
    with pytest.raises(ValueError, match="must be uint8"):
        check_inputs(x, w16.astype(jnp.float32), gid, jnp.zeros((2, 1, 2), jnp.uint8))
    with pytest.raises(ValueError, match="K=64 but w"):     # the op checks before dispatching
        grouped_matmul(x, jnp.zeros((2, 32, 48), jnp.bfloat16), gid)


def test_tiled_api_checks_the_plan_and_the_weights():
    """grouped_matmul_tiles (the expert FFN's shared-plan path) refuses x rows that are not the plan's
    tiles at config.block_m, and weights whose K is not x's, before any kernel is built."""
    from pallas_kernels.grouped_gemm.kernel import fp4_k_permutation, grouped_matmul_tiles, retile, tile_rows

    rng = np.random.default_rng(3)
    w, s = _weights(rng, WeightFormat.FP4, 4, 128, 128)
    x = jnp.asarray(rng.standard_normal((6, 128)), jnp.bfloat16)
    gid = jnp.asarray([0, 3, 3, 1, 0, 2], jnp.int32)
    plan, x_pk = tile_rows(x, gid, num_groups=4, block_m=16, fp4=True)
    assert x_pk.shape == (4 * 16, 128)     # max_tiles(6, 4, 16) = 4 tiles of 16 rows
    with pytest.raises(ValueError, match="block_m=32 does not match"):
        grouped_matmul_tiles(plan, x_pk, w, s, config=GroupedMatmulConfig(block_m=32))
    with pytest.raises(ValueError, match="K=64 but w"):
        grouped_matmul_tiles(plan, x_pk[:, :64], w, s, config=GroupedMatmulConfig(block_m=16))
    # retile: tile-order rows [T*bm, K] -> the next GEMM's rows, bf16, FP4 K order
    h = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)
    assert np.array_equal(np.asarray(retile(h, fp4=False)), np.asarray(h.astype(jnp.bfloat16)))
    assert np.array_equal(np.asarray(retile(h, fp4=True)),
                          np.asarray(h.astype(jnp.bfloat16))[:, np.asarray(fp4_k_permutation(128))])


@pytest.mark.parametrize("dtype, cols", [(jnp.float8_e4m3fn, 64), (jnp.bfloat16, 96), (jnp.float32, 8),
                                         (jnp.uint8, 6), (jnp.bfloat16, 7)])
def test_take_rows_is_the_filling_take_bit_for_bit(dtype, cols):
    """plan.take_rows (32-bit words where a row is whole words, else the plain take) gives the bits of
    jnp.take(mode="fill", fill_value=0): in-range rows copied, out-of-range ones (the plan's padding
    index R, and beyond) zero, eager and jitted."""
    from pallas_kernels.grouped_gemm.plan import take_rows

    rng = np.random.default_rng(cols)
    bits = rng.integers(0, 256, (5, cols * np.dtype(dtype).itemsize), dtype=np.uint8)
    a = jnp.asarray(bits.view(dtype).reshape(5, cols))
    src = jnp.asarray([4, 0, 5, 2, 2, 9, 1, 5, 3], jnp.int32)
    want = np.asarray(jnp.take(a, src, axis=0, mode="fill", fill_value=0))
    for fn in (take_rows, jax.jit(take_rows)):
        got = np.asarray(fn(a, src))
        assert got.dtype == want.dtype and got.shape == (9, cols)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert not np.asarray(take_rows(a, src)).view(np.uint8)[[2, 5, 7]].any()


@pytest.mark.parametrize("e4m3", [False, True])
def test_tile_rows_from_token_rows_are_the_repeated_rows(e4m3):
    """tile_rows(x [M, K], group ids [M*k], rows_per_source=k) -- the MoE's form, quantized and permuted
    once a token -- builds the plan and padded rows of the repeated x [M*k, K], bit for bit."""
    from pallas_kernels.grouped_gemm.kernel import tile_rows

    rng = np.random.default_rng(11)
    m, k, g = 5, 3, 4
    x = jnp.asarray(rng.standard_normal((m, 64)) * 4, jnp.bfloat16)
    gid = jnp.asarray(rng.integers(-1, g, m * k), jnp.int32)          # (-1: a dropped row)
    plan, rows = tile_rows(x, gid, num_groups=g, block_m=8, fp4=True, e4m3=e4m3, rows_per_source=k)
    plan_rep, rows_rep = tile_rows(jnp.repeat(x, k, axis=0), gid, num_groups=g, block_m=8, fp4=True, e4m3=e4m3)
    for got, want in zip(jax.tree.leaves((plan, rows)), jax.tree.leaves((plan_rep, rows_rep))):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    with pytest.raises(ValueError, match="rows_per_source=2"):
        tile_rows(x, gid, num_groups=g, block_m=8, fp4=True, rows_per_source=2)


@pytest.mark.parametrize("rows, groups", [(6, 4), (200, 3)])
def test_untile_rows_and_the_transposed_unpermute_put_every_row_back(rows, groups):
    """untile_rows (y [P, N], the kernel's default output) and the y^T un-permute on both of its forms:
    few rows per padded row (6 rows in 4 tiles of 16: the gather reads y^T directly) and many (200 rows
    in 3 groups, ~1.2 padded rows each: the routed columns are compacted and transposed first); dropped
    rows (group -1 or >= G) come back as zeros."""
    from pallas_kernels.grouped_gemm.kernel import _TRANSPOSE_FIRST_PADDING, _unpermute, untile_rows

    rng = np.random.default_rng(rows)
    gid = rng.integers(-1, groups + 1, rows).astype(np.int32)
    plan = make_tile_plan(jnp.asarray(gid), groups, 16, max_tiles(rows, groups, 16))
    padded = plan.row_src.shape[0]
    assert (padded <= _TRANSPOSE_FIRST_PADDING * rows) == (rows == 200)   # each y^T form is taken once
    y_pn = rng.standard_normal((padded, 24)).astype(np.float32)
    src = np.asarray(plan.row_src)
    want = np.zeros((rows, 24), np.float32)
    for p_row, m in enumerate(src):
        if m < rows:
            want[m] = y_pn[p_row]
    got = np.asarray(jax.jit(untile_rows)(jnp.asarray(y_pn), plan))
    got_t = np.asarray(_unpermute(jnp.asarray(y_pn.T), plan, out_dtype=jnp.float32))
    assert np.array_equal(got, want) and np.array_equal(got_t, want)
    assert np.all(got[(gid < 0) | (gid >= groups)] == 0)


# ---- the Mosaic GPU kernel: GPU interpreter on the CPU, and lowering for Hopper ----------------------

def _interpret():
    """plgpu kernels run in the Mosaic GPU interpreter (with its race detector) inside this context."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    return gpu_interpreter(detect_races=True)


# The interpreter's wgmma reads its operands from shared memory only, so the quantized formats run
# with the dequantized A tile staged through shared memory (a_from_registers=False); the register-A
# variant that the GPU uses is covered by the lowering test below and by benchmarks/grouped_gemm_gpu.py.
# 3 K steps through 2 stages exercise the ring's slot reuse and barrier phases.
def _routed_problem(seed: int, fmt, g: int, n: int, k: int, m: int):
    """(w, s, x [m, k] bf16, group ids [m] with dropped rows -1 and G) for the interpreter tests."""
    rng = np.random.default_rng(seed)
    w, s = _weights(rng, fmt, g, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return w, s, x, jnp.asarray(rng.integers(-1, g + 1, m), jnp.int32)


_TINY_CFG = GroupedMatmulConfig(block_m=16, block_n=128, block_k=64, stages=2, a_from_registers=False)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_kernel_in_gpu_interpreter_matches_reference(fmt):
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    rng = np.random.default_rng(7)
    g, n, k, m = 3, 128, 192, 13
    w, s = _weights(rng, fmt, g, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = np.array([2, 0, 2, -1, 1, 2, 2, 0, 3, 2, 2, 1, 2], np.int32)   # unsorted, 7 rows in group 2
    with _interpret():
        got = jax.block_until_ready(grouped_matmul_pallas(x, w, jnp.asarray(gid), s, out_dtype=jnp.float32,
                                                          config=_TINY_CFG))
    assert not races_found()
    want = np.asarray(grouped_matmul_reference(x, w, jnp.asarray(gid), s))
    # Exact bf16 operands, float32 accumulation in 16-wide steps: f32 rounding of the sums only.
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.all(np.asarray(got)[[3, 8]] == 0)                          # ids -1 and G give zeros


def test_kernel_in_gpu_interpreter_row_alone_equals_row_in_batch():
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    rng = np.random.default_rng(8)
    g, n, k = 3, 128, 128
    w, s = _weights(rng, WeightFormat.FP4, g, n, k)
    x = jnp.asarray(rng.standard_normal((11, k)), jnp.bfloat16)
    gid = jnp.asarray([1, 1, 0, 1, 2, 1, 1, 1, 1, 1, 0], jnp.int32)      # the probe (row 6) shares a tile
    with _interpret():
        alone = grouped_matmul_pallas(x[6:7], w, gid[6:7], s, config=_TINY_CFG)
        among = grouped_matmul_pallas(x, w, gid, s, config=_TINY_CFG)
    assert np.array_equal(_bits(among[6]), _bits(alone[0]))


# ---- FP4 "bits" dequantization and the wgmma overlap: the same bf16 operands as before, so the same bits ----

def test_fp4_bit_placement_gives_the_arith_values_for_every_byte_and_scale():
    """Every byte (all 16 x 16 nibble pairs) times every E8M0 byte the "bits" mode covers (0..240):
    bit placement + float16 -> float32 + the 2^14-folded scale rounds to the same bf16 bits as the
    float polynomial times the plain scale; and the unscaled values are the E2M1 table, signed zeros too."""
    from pallas_kernels.grouped_gemm.kernel import (_e8m0_row_to_f32, _e8m0_row_to_f32_times_2_14, _f16_bits_to_f32,
                                                    _fp4_bytes_to_f16_bits, _fp4_nibble_to_f32)

    q = jnp.arange(256, dtype=jnp.int32)[None, :]
    b = jnp.arange(241, dtype=jnp.int32)[:, None].astype(jnp.uint8)
    halves = _fp4_bytes_to_f16_bits(q)
    for h, nib in zip(halves, (q & 15, q >> 4)):
        new = (_f16_bits_to_f32(h) * _e8m0_row_to_f32_times_2_14(b)).astype(jnp.bfloat16)
        old = (_fp4_nibble_to_f32(nib) * _e8m0_row_to_f32(b)).astype(jnp.bfloat16)
        assert np.array_equal(_bits(new), _bits(old))
        want = _FP4[np.asarray(nib)[0]]
        got = np.asarray(_f16_bits_to_f32(h))[0] * 2.0 ** 14
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_fp4_packed_ptx_replayed_in_numpy_gives_the_arith_values():
    """The "packed" decoder's PTX, replayed op for op in numpy, against the "arith" values: every byte in
    either position of the input register, every E8M0 byte in [3, 251] and 0. (The GPU alone runs the PTX;
    this checks its arithmetic, the lowering test below its assembly into the kernel.)"""
    from pallas_kernels.grouped_gemm import fp4_packed
    from pallas_kernels.grouped_gemm.kernel import _e8m0_row_to_f32, _fp4_nibble_to_f32

    byte0 = np.arange(256)[None, :]
    byte1 = np.roll(np.arange(256), 77)[None, :]
    b = np.concatenate([[0], np.arange(3, 252)])[:, None]
    lo, hi = fp4_packed.emulate(byte0, byte1, b)
    scale = _e8m0_row_to_f32(jnp.asarray(b, jnp.uint8))
    for word, shift in ((lo, 0), (hi, 4)):
        for half, byte in enumerate((byte0, byte1)):
            want = (_fp4_nibble_to_f32((jnp.asarray(byte) >> shift) & 15) * scale).astype(jnp.bfloat16)
            assert np.array_equal((word >> (16 * half)) & 0xFFFF, _bits(want))


def test_fp4_subnormal_ptx_replayed_in_numpy_gives_the_arith_values():
    """The "subnormal" decoder's PTX replayed in numpy: every byte in either position, every E8M0 byte it
    covers (0..128, the subnormal outputs of b = 1, 2 included) -> the E2M1 table value times 2^(b-127),
    exactly, signed zeros too (checked in numpy, which keeps float32 subnormals); and bitwise the
    "packed" decoder's words wherever both are exact (b = 0 and 3..128)."""
    from pallas_kernels.grouped_gemm import fp4_packed

    byte0 = np.arange(256)[None, :]
    byte1 = np.roll(np.arange(256), 77)[None, :]
    b = np.arange(0, fp4_packed.SUBNORMAL_MAX_SCALE_BYTE + 1)[:, None]
    lo, hi = fp4_packed.emulate_subnormal(byte0, byte1, b)
    scale = np.where(b == 0, 0.0, 2.0 ** (b - 127.0))
    for word, shift in ((lo, 0), (hi, 4)):
        for half, byte in enumerate((byte0, byte1)):
            want = (_FP4[(byte >> shift) & 15] * scale).astype(np.float32).view(np.uint32)
            assert not np.any(want & 0xFFFF)                 # every wanted value is a bf16
            assert np.array_equal((word >> (16 * half)) & 0xFFFF, want >> 16)
    both = (b[:, 0] == 0) | (b[:, 0] >= 3)
    old_lo, old_hi = fp4_packed.emulate(byte0, byte1, b)
    assert np.array_equal(lo[both], old_lo[both]) and np.array_equal(hi[both], old_hi[both])


def test_scales_fit_subnormal_reads_both_scale_dtypes():
    from pallas_kernels.grouped_gemm.fp4_packed import scales_fit_subnormal

    s = jnp.asarray([[120, 128], [3, 0]], jnp.uint8)
    assert scales_fit_subnormal(s)
    assert scales_fit_subnormal(jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu))
    assert not scales_fit_subnormal(s.at[0, 0].set(129))
    assert scales_fit_subnormal(jnp.zeros((0, 4), jnp.uint8))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_persistent_kernel_gives_the_one_cta_per_tile_bits_in_gpu_interpreter(fmt):
    """Two CTAs walking 16 (tile, column block) items with one TMA ring (3 K steps through 2 stages, so
    the ring wraps inside and across items; empty tiles and ids -1 / G at the tail) give the grid
    kernel's bits, which match the reference."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    g, n, k, m = 3, 256, 192, 29
    w, s, x, gid = _routed_problem(14, fmt, g, n, k, m)
    with _interpret():
        grid = grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=_TINY_CFG)
        pers = grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32,
                                     config=dataclasses.replace(_TINY_CFG, persistent=True))
    assert not races_found()
    assert np.array_equal(_bits(pers), _bits(grid))
    want = np.asarray(grouped_matmul_reference(x, w, gid, s))
    np.testing.assert_allclose(np.asarray(pers), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_consumer_registers_fit_the_launch_pool():
    """setmaxnreg can only share out what the CTA got at launch (threads x the most a thread may have,
    in units of 8): 2 consumers + 1 producer at 40 give the 232 that ran on the H200 (so do 2 + 2 at
    24, the attention kernel's), and 4 + 1 at 40 must ask less than the 112 that hung the kernel on an
    H100 and an H200: their sum was 62,464 of a 61,440 pool."""
    from pallas_kernels.mosaic import consumer_registers, launch_register_pool

    assert launch_register_pool(3) == 384 * 168 and launch_register_pool(5) == 640 * 96
    assert consumer_registers(2, 1, 40) == 232 and consumer_registers(2, 2, 24) == 232
    for consumers, producers, prod in ((2, 1, 40), (2, 2, 24), (4, 1, 40), (4, 1, 24), (3, 1, 40)):
        regs = consumer_registers(consumers, producers, prod)
        assert regs % 8 == 0 and 24 <= regs <= 256
        pool = launch_register_pool(consumers + producers)
        assert 128 * (consumers * regs + producers * prod) <= pool
        assert 128 * (consumers * (regs + 8) + producers * prod) > pool or regs == 256   # the most that fits
    assert 128 * (4 * 112 + 40) > launch_register_pool(5)
    with pytest.raises(ValueError, match="setmaxnreg"):
        consumer_registers(7, 1, 400)    # 14,336 registers left for 896 consumer threads


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_four_consumers_give_the_two_consumer_bits_in_gpu_interpreter(fmt):
    """``consumers=4`` (64 weight rows per consumer warpgroup) computes every weight row as the
    2-consumer kernel does: the same bits, in both launches and both output forms (rows from registers
    for float32, y^T through shared memory for bf16)."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    g, n, k, m = 3, 256, 128, 21
    w, s, x, gid = _routed_problem(17, fmt, g, n, k, m)
    two = dataclasses.replace(_TINY_CFG, block_n=256)
    with _interpret():
        for persistent, out_dtype in ((False, jnp.float32), (True, jnp.float32), (True, jnp.bfloat16)):
            base = dataclasses.replace(two, persistent=persistent)
            want = grouped_matmul_pallas(x, w, gid, s, out_dtype=out_dtype, config=base)
            got = grouped_matmul_pallas(x, w, gid, s, out_dtype=out_dtype,
                                        config=dataclasses.replace(base, consumers=4))
            assert np.array_equal(_bits(got), _bits(want)), (persistent, out_dtype)
    assert not races_found()
    with pytest.raises(ValueError, match="consumers"):
        GroupedMatmulConfig(block_n=128, consumers=4)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
def test_row_output_gives_the_transposed_outputs_bits_in_gpu_interpreter(fmt, persistent):
    """The kernel writing y [P, N] from registers (the default) gives the bits of the y^T form stored
    through shared memory, for both output dtypes and launches, through the op and the tiled API."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas, grouped_matmul_tiles, tile_rows

    g, n, k, m = 3, 256, 128, 21
    w, s, x, gid = _routed_problem(15, fmt, g, n, k, m)
    rows_cfg = dataclasses.replace(_TINY_CFG, persistent=persistent)
    t_cfg = dataclasses.replace(rows_cfg, out_rows=False)
    assert rows_cfg.out_rows
    plan, x_pk = tile_rows(x, gid, num_groups=g, block_m=16, fp4=fmt is WeightFormat.FP4)
    used = np.repeat(np.asarray(plan.tile_group) >= 0, 16)      # unused tiles are never written
    results = {}
    with _interpret():
        for out_dtype in (jnp.float32, jnp.bfloat16):
            by_rows = grouped_matmul_pallas(x, w, gid, s, out_dtype=out_dtype, config=rows_cfg)
            by_t = grouped_matmul_pallas(x, w, gid, s, out_dtype=out_dtype, config=t_cfg)
            assert by_rows.dtype == out_dtype and np.array_equal(_bits(by_rows), _bits(by_t))
            results[out_dtype] = by_rows
        tiles_rows = grouped_matmul_tiles(plan, x_pk, w, s, config=rows_cfg)   # float32 out
        tiles_t = grouped_matmul_tiles(plan, x_pk, w, s, config=t_cfg)
    assert not races_found()
    assert tiles_rows.shape == tiles_t.shape == (plan.row_src.shape[0], n)
    assert np.array_equal(_bits(tiles_rows)[used], _bits(tiles_t)[used])
    want = np.asarray(grouped_matmul_reference(x, w, gid, s))
    # as test_kernel_in_gpu_interpreter_matches_reference: f32 rounding of the 16-wide step sums only
    np.testing.assert_allclose(np.asarray(results[jnp.float32]), want, rtol=0, atol=1e-5 * np.abs(want).max())


def _fp4_weights_every_byte(rng, g, n, k):
    """FP4 weights holding every byte value, with scales mixing 2^-125, 2^-20, 2^20 and 2^113 into
    the usual range near 2^0."""
    w = rng.integers(0, 256, (g, n, k // 2))
    w.reshape(-1)[:256] = np.arange(256)
    s = rng.integers(120, 135, (g, n, k // 32))
    extreme = rng.random(s.shape) < 0.25
    s[extreme] = rng.choice([2, 107, 147, 240], int(extreme.sum()))
    return jnp.asarray(w, jnp.uint8), jnp.asarray(s, jnp.uint8)


_OLD_KERNEL = dict(fp4_dequant="arith", overlap_wgmma=False)


@pytest.mark.parametrize("fmt", [WeightFormat.FP4, WeightFormat.FP8], ids=lambda f: f.value)
def test_kernel_new_dequant_is_bitwise_the_old_one_in_gpu_interpreter(fmt):
    """The default kernel ("bits" FP4 decode, block c+1 dequantized under block c's wgmma) gives the
    bits of the earlier kernel ("arith", wait after every block), and matches the reference."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    rng = np.random.default_rng(9)
    g, n, k, m = 2, 128, 192, 11
    if fmt is WeightFormat.FP4:
        w, s = _fp4_weights_every_byte(rng, g, n, k)
    else:
        w, s = _weights(rng, fmt, g, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = jnp.asarray([1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1], jnp.int32)
    old_cfg = dataclasses.replace(_TINY_CFG, **_OLD_KERNEL)
    with _interpret():
        new = grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=_TINY_CFG)
        old = grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=old_cfg)
        new16 = grouped_matmul_pallas(x, w, gid, s, config=_TINY_CFG)
        old16 = grouped_matmul_pallas(x, w, gid, s, config=old_cfg)
    assert not races_found()
    assert np.array_equal(_bits(new), _bits(old)) and np.array_equal(_bits(new16), _bits(old16))
    want = np.asarray(grouped_matmul_reference(x, w, gid, s))
    # Scales differ by up to 2^238 between blocks of a row: each row's error is relative to its own size.
    assert np.all(np.abs(np.asarray(new) - want) <= 1e-5 * np.abs(want).max(axis=1, keepdims=True))


@pytest.mark.parametrize("fmt", [WeightFormat.FP8, WeightFormat.FP4], ids=lambda f: f.value)
def test_register_operand_kernel_lowers_for_hopper(fmt):
    """The GPU configuration (dequantized A in registers) passes Mosaic GPU's lowering for CUDA,
    which checks layouts, shared-memory size and wgmma operand rules, without a GPU."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    g, n, k, m = 4, 256, 256, 40
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    gid = jax.ShapeDtypeStruct((m,), jnp.int32)
    if fmt is WeightFormat.FP8:
        w = jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn)
        s = jax.ShapeDtypeStruct((g, n // 32, k // 32), jnp.uint8)
    else:
        w = jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8)
        s = jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8)
    for extra in ({}, _OLD_KERNEL, dict(fp4_dequant="bits", overlap_wgmma=False),
                  dict(fp4_dequant="arith", overlap_wgmma=True), dict(fp4_dequant="packed"),
                  dict(fp4_dequant="subnormal"), dict(persistent=True),
                  dict(persistent=True, fp4_dequant="subnormal", overlap_wgmma=False)):
        cfg = GroupedMatmulConfig(block_m=32, block_n=128, block_k=64, stages=3, **extra)
        # bf16 out: the y^T tile through shared memory and TMA; float32 out: y rows stored from
        # registers (Mosaic checks that each store fills whole 32-byte sectors)
        for out_dtype in (jnp.bfloat16, jnp.float32):
            lowered = jax.jit(lambda *a, cfg=cfg, o=out_dtype: grouped_matmul_pallas(*a, config=cfg, out_dtype=o)
                              ).trace(x, w, gid, s).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()
    # four consumer warpgroups (64 weight rows each, 112 registers a thread) at the decode tile
    for extra in (dict(fp4_dequant="subnormal", persistent=True), dict(fp4_dequant="packed", persistent=False)):
        cfg = GroupedMatmulConfig(block_m=8, block_n=256, block_k=128, stages=4, consumers=4, **extra)
        lowered = jax.jit(lambda *a, cfg=cfg: grouped_matmul_pallas(*a, config=cfg, out_dtype=jnp.float32)
                          ).trace(x, w, gid, s).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


# ---- tuned tile configs and kernel-layout scales ------------------------------------------------------

def test_tuned_config_fits_the_v41_expert_shapes_and_depends_on_shapes_only():
    from pallas_kernels.grouped_gemm.config import tuned_config

    for fmt in ALL_FORMATS:
        for m in (6, 64 * 6, 512 * 6, 1024 * 6, 2048 * 6, 4096 * 6, 32768 * 6):
            for n, k in ((2304, 5120), (5120, 2304)):       # w1/w3 and w2 of V4.1-Flash
                cfg = tuned_config(m, 384, n, k, fmt)
                assert kernel_unsupported_reason(n, k, fmt, cfg, jnp.float32) is None, (fmt, m, n, k, cfg)
                assert cfg == tuned_config(m, 384, n, k, fmt)
    # decode pads each expert's row or two to 8 below 2 rows per expert (B=64: 1), to 16 up to 12 rows
    # (B=512: 8), not 64; a 1024-2048-token prefill chunk (16-32 rows per expert) takes 64-row tiles;
    # long prefill gets full 128-row tiles
    for tokens, bm in ((1, 8), (64, 8), (127, 8), (128, 16), (512, 16)):
        assert tuned_config(tokens * 6, 384, 2304, 5120, WeightFormat.FP4).block_m == bm, tokens
    assert tuned_config(64 * 6, 384, 2304, 5120, WeightFormat.FP8).block_m == 16      # FP8: not swept
    for tokens in (1024, 2048):
        cfg = tuned_config(tokens * 6, 384, 2304, 5120, WeightFormat.FP4)
        assert (cfg.block_m, cfg.block_n, cfg.persistent) == (64, 256, True)
    assert tuned_config(32768 * 6, 384, 2304, 5120, WeightFormat.FP4).block_m == 128
    assert tuned_config(2048 * 6, 384, 2304, 5120, WeightFormat.FP8).block_m == 128   # FP8: not swept
    # FP4 decode and chunk tiles take 4 consumer warpgroups (sweep rounds 9-10 on the H200), on the
    # tile-major layout the engine holds too; FP4 long prefill and FP8 keep the base's 2
    tm = dataclasses.replace(GroupedMatmulConfig(), weights_tile_major=True, block_n=256, block_k=128)
    for tokens, base in ((64, None), (64, tm), (512, None), (512, tm), (2048, tm)):
        cfg = tuned_config(tokens * 6, 384, 2304, 5120, WeightFormat.FP4, base=base or GroupedMatmulConfig())
        assert cfg.consumers == 4, (tokens, base)
    assert tuned_config(32768 * 6, 384, 2304, 5120, WeightFormat.FP4).consumers == 2
    assert tuned_config(64 * 6, 384, 2304, 5120, WeightFormat.FP8).consumers == 2
    # nothing fits a 64-wide N: the base config comes back (and the kernel route reports why)
    base = GroupedMatmulConfig(xla_block_m=5)
    assert tuned_config(6, 8, 64, 128, WeightFormat.FP4, base=base) is base


@pytest.mark.parametrize("fmt,n", [(WeightFormat.FP4, 128), (WeightFormat.FP8, 128), (WeightFormat.FP8, 80)],
                         ids=["fp4", "fp8", "fp8-ragged-n"])
def test_kernel_scales_round_trip(fmt, n):
    from pallas_kernels.grouped_gemm.scales import checkpoint_scales, kernel_scales

    rng = np.random.default_rng(11)
    k = 96
    shape = (3, n, k // 32) if fmt is WeightFormat.FP4 else (3, -(-n // 32), k // 32)
    s = rng.integers(0, 256, shape).astype(np.uint8)
    s_kn = np.asarray(kernel_scales(jnp.asarray(s), fmt, n))
    assert s_kn.shape == (3, k // 32, n)
    rows = np.arange(n) if fmt is WeightFormat.FP4 else np.arange(n) // 32     # the scale row of weight row r
    assert np.array_equal(s_kn, np.swapaxes(s[:, rows], 1, 2))
    back = checkpoint_scales(jnp.asarray(s_kn), fmt)
    assert back.dtype == jnp.float8_e8m0fnu                         # the checkpoint's dtype
    assert np.array_equal(np.asarray(jax.lax.bitcast_convert_type(back, jnp.uint8)), s)


@pytest.mark.parametrize("fmt", [WeightFormat.FP4, WeightFormat.FP8], ids=lambda f: f.value)
def test_prepared_scales_give_the_same_bits_on_xla_and_in_gpu_interpreter(fmt):
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas
    from pallas_kernels.grouped_gemm.scales import kernel_scales

    rng = np.random.default_rng(12)
    g, n, k, m = 3, 128, 128, 9
    w, s = _weights(rng, fmt, g, n, k)
    s_kn = kernel_scales(s, fmt, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = jnp.asarray([2, 0, 1, 2, -1, 0, 2, 1, 1], jnp.int32)
    plain = grouped_matmul(x, w, gid, s, out_dtype=jnp.float32, impl="xla")
    prepared = grouped_matmul(x, w, gid, s_kn, out_dtype=jnp.float32, impl="xla", scales_prepared=True)
    assert np.array_equal(_bits(prepared), _bits(plain))
    with _interpret():
        k_plain = grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=_TINY_CFG)
        k_prep = grouped_matmul_pallas(x, w, gid, s_kn, out_dtype=jnp.float32, config=_TINY_CFG,
                                       scales_prepared=True)
    assert np.array_equal(_bits(k_prep), _bits(k_plain))
    with pytest.raises(ValueError, match=r"\[G, K/32, N\]"):
        grouped_matmul(x, w, gid, s, impl="xla", scales_prepared=True)       # checkpoint layout, wrong flag


def test_kernel_grid_of_exact_tiles_gives_the_bucketed_grids_bits():
    """Inside a caller's jit the wrapper sizes the grid to max_tiles instead of the power-of-two bucket;
    the extra tiles are empty, so every row's bits must be the same (run here piecewise, eagerly, in the
    interpreter: 3 exact tiles vs a bucket of 8)."""
    from pallas_kernels.grouped_gemm.kernel import _plan_and_gather, _run_kernel, untile_rows
    from pallas_kernels.grouped_gemm.scales import kernel_scales

    rng = np.random.default_rng(13)
    g, n, k, m = 3, 128, 128, 13
    w, s = _weights(rng, WeightFormat.FP4, g, n, k)
    s_kn = kernel_scales(s, WeightFormat.FP4, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = jnp.asarray(rng.integers(0, g, m), jnp.int32)
    exact, bucket = max_tiles(m, g, _TINY_CFG.block_m), bucketed_tiles(m, g, _TINY_CFG.block_m)
    assert exact < bucket
    outs = []
    with _interpret():
        for t in (exact, bucket):
            plan, x_pk = _plan_and_gather(x, gid, num_groups=g, block_m=_TINY_CFG.block_m, num_tiles=t, fp4=True)
            y = _run_kernel(plan.tile_group, x_pk, (w,), (s_kn,), fmt=WeightFormat.FP4, config=_TINY_CFG,
                            out_dtype=jnp.float32)
            outs.append(untile_rows(y, plan, jnp.float32))
    assert np.array_equal(_bits(outs[0]), _bits(outs[1]))
    want = np.asarray(grouped_matmul_reference(x, w, gid, s))
    np.testing.assert_allclose(np.asarray(outs[0]), want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_tile_major_weights_give_the_row_major_bits_in_gpu_interpreter(fmt):
    """``weights_tile_major``: the kernel reading each K step's weight tile as one contiguous run of
    ``tile_major_weights`` computes what it computes from the stored layout, bit for bit, in both
    launches; a w of the wrong layout for the config is refused with its shape named."""
    from pallas_kernels.grouped_gemm.config import tile_major_weights
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    g, n, k, m = 3, 256, 256, 21
    w, s, x, gid = _routed_problem(23, fmt, g, n, k, m)
    with _interpret():
        for persistent in (False, True):
            base = dataclasses.replace(_TINY_CFG, persistent=persistent)
            tiled_cfg = dataclasses.replace(base, weights_tile_major=True)
            w_t = tile_major_weights(w, tiled_cfg.block_n, tiled_cfg.block_k)
            assert w_t.ndim == 5 and w_t.shape[3] == tiled_cfg.block_n
            want = grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=base)
            got = grouped_matmul_pallas(x, w_t, gid, s, out_dtype=jnp.float32, config=tiled_cfg)
            assert np.array_equal(_bits(got), _bits(want)), persistent
            # a K step reading half of each layout tile (the model's prefill tiles on its decode layout)
            w_t2 = tile_major_weights(w, tiled_cfg.block_n, 2 * tiled_cfg.block_k)
            got = grouped_matmul_pallas(x, w_t2, gid, s, out_dtype=jnp.float32, config=tiled_cfg)
            assert np.array_equal(_bits(got), _bits(want)), (persistent, "half tiles")
    assert not races_found()
    with pytest.raises(ValueError, match="tile_major_weights"):
        grouped_matmul_pallas(x, w, gid, s, config=dataclasses.replace(_TINY_CFG, weights_tile_major=True))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_two_weights_in_one_launch_give_each_weights_own_bits_in_gpu_interpreter(fmt):
    """``grouped_matmul_tiles(..., more=...)`` (an expert FFN's w1 and w3 in one launch): y's first N
    columns are w's launch alone and the next N the second weight's, bit for bit, in both launches
    and in the tile-major layout (its K steps reading half of each layout tile too); a second weight of
    another shape is refused."""
    from pallas_kernels.grouped_gemm.config import tile_major_weights
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_tiles, tile_rows

    g, n, k, m = 3, 256, 256, 21
    w, s, x, gid = _routed_problem(29, fmt, g, n, k, m)
    w3, s3, _, _ = _routed_problem(31, fmt, g, n, k, m)
    plan, x_pk = tile_rows(x, gid, num_groups=g, block_m=16, fp4=fmt is WeightFormat.FP4)
    used = np.repeat(np.asarray(plan.tile_group) >= 0, 16)      # unused tiles are never written
    with _interpret():
        for persistent in (False, True):
            cfg = dataclasses.replace(_TINY_CFG, persistent=persistent)
            alone = [grouped_matmul_tiles(plan, x_pk, a, b, config=cfg) for a, b in ((w, s), (w3, s3))]
            both = grouped_matmul_tiles(plan, x_pk, w, s, config=cfg, more=((w3, s3),))
            assert both.shape == (plan.row_src.shape[0], 2 * n)
            for j, want in enumerate(alone):
                assert np.array_equal(_bits(both[:, j * n:(j + 1) * n])[used], _bits(want)[used]), (persistent, j)
            tm_cfg = dataclasses.replace(cfg, weights_tile_major=True)
            for tile_k in (tm_cfg.block_k, 2 * tm_cfg.block_k):
                w_t, w3_t = (tile_major_weights(a, tm_cfg.block_n, tile_k) for a in (w, w3))
                both_t = grouped_matmul_tiles(plan, x_pk, w_t, s, config=tm_cfg, more=((w3_t, s3),))
                assert np.array_equal(_bits(both_t)[used], _bits(both)[used]), (persistent, tile_k)
    assert not races_found()
    with pytest.raises(ValueError, match="shape and dtype"):
        grouped_matmul_tiles(plan, x_pk, w, s, config=_TINY_CFG, more=((w[:, :128], s),))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.value)
def test_swiglu_epilogue_gives_the_w13_launch_rows_through_the_swiglu_in_gpu_interpreter(fmt):
    """``swiglu_tiles`` (w1, w3 and the SwiGLU times the row weight in one launch): the rows of the
    one-launch w1/w3 kernel put through the model's SwiGLU in XLA, bit for bit in the interpreter (the
    same g and u, and the interpreter's exp is XLA's), with and without the clamp, in both launches and
    in the tile-major layout; padding rows (row weight 0) give 0; configs without 128 weight rows a
    consumer, the E4M3 operand form and a row weight of the wrong length are refused."""
    from pallas_kernels.grouped_gemm.config import tile_major_weights
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_tiles, swiglu_tiles, tile_rows

    g, n, k, m = 3, 256, 256, 21
    w, s, x, gid = _routed_problem(29, fmt, g, n, k, m)
    w3, s3, _, _ = _routed_problem(31, fmt, g, n, k, m)
    plan, x_pk = tile_rows(x, gid, num_groups=g, block_m=16, fp4=fmt is WeightFormat.FP4)
    used = np.repeat(np.asarray(plan.tile_group) >= 0, 16)      # unused tiles are never written
    routed = np.asarray(plan.row_src) < m
    row_w = jnp.asarray(np.where(routed, np.random.default_rng(3).uniform(0.1, 2, routed.shape), 0), jnp.float32)
    base = dataclasses.replace(_TINY_CFG, block_n=256)         # 128 weight rows a consumer: 64 of each weight
    with _interpret():
        for persistent in (False, True):
            cfg = dataclasses.replace(base, persistent=persistent)
            y13 = grouped_matmul_tiles(plan, x_pk, w, s, config=cfg, more=((w3, s3),))
            gate, up = y13[:, :n], y13[:, n:]
            for limit in (3.0, None):      # outputs are O(10): the clamp bites
                want = jax.nn.silu(gate if limit is None else jnp.minimum(gate, limit)) * (
                    up if limit is None else jnp.clip(up, -limit, limit)) * row_w[:, None]
                got = swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=limit, config=cfg)
                assert got.shape == (plan.row_src.shape[0], n)
                assert np.array_equal(_bits(got)[used], _bits(want)[used]), (persistent, limit)
                assert not np.any(np.asarray(got)[used & ~routed])
                assert np.abs(np.asarray(got)[used]).max() > 1.0
            clamped = swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=3.0, config=cfg)
            tm_cfg = dataclasses.replace(cfg, weights_tile_major=True)
            for tile_k in (tm_cfg.block_k, 2 * tm_cfg.block_k):    # K steps reading whole / half layout tiles
                w_t, w3_t = (tile_major_weights(a, tm_cfg.block_n, tile_k) for a in (w, w3))
                got_t = swiglu_tiles(plan, x_pk, w_t, s, w3_t, s3, row_w, limit=3.0, config=tm_cfg)
                assert np.array_equal(_bits(got_t)[used], _bits(clamped)[used]), (persistent, tile_k)
    assert not races_found()
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=3.0, config=_TINY_CFG)
    with pytest.raises(ValueError, match="row_weight_p"):
        swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w[:-1], limit=3.0, config=base)
    with pytest.raises(ValueError, match="out_rows"):
        swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=3.0, config=dataclasses.replace(base, out_rows=False))
    if fmt is WeightFormat.FP4:
        from pallas_kernels.grouped_gemm.kernel import swiglu_unsupported_reason

        assert "E4M3" in swiglu_unsupported_reason(dataclasses.replace(base, fp4_operands="e4m3"), fmt)


@pytest.mark.parametrize("fmt", [WeightFormat.FP8, WeightFormat.FP4], ids=lambda f: f.value)
def test_swiglu_epilogue_bf16_rows_are_the_quantizer_on_its_float32_rows_in_gpu_interpreter(fmt):
    """``swiglu_tiles(out_dtype=bfloat16, act_block=32)``: h through the model's activation quantizer
    (``fake_quant_fp8`` of the float32 epilogue's h cast to bf16), bit for bit, in both launches;
    without act_block the float32 rows cast to bf16; padding rows 0. Refused: act_block with float32
    out, 16-row tiles, a block that does not split a consumer's 64 columns; ``swiglu_config`` takes
    stages off a 128 x 256 x 64 tile with 8 (the engine's FP4 prefill tile: 7 left) for the staged rows,
    and gives None for what no stage count mends."""
    from deepinfer_jax.model.numerics import fake_quant_fp8
    from pallas_kernels.grouped_gemm.kernel import swiglu_config, swiglu_tiles, swiglu_unsupported_reason, tile_rows

    g, n, k, m = 3, 256, 256, 150
    w, s, x, gid = _routed_problem(47, fmt, g, n, k, m)
    w3, s3, _, _ = _routed_problem(53, fmt, g, n, k, m)
    plan, x_pk = tile_rows(x, gid, num_groups=g, block_m=64, fp4=fmt is WeightFormat.FP4)
    used = np.repeat(np.asarray(plan.tile_group) >= 0, 64)
    routed = np.asarray(plan.row_src) < m
    row_w = jnp.asarray(np.where(routed, np.random.default_rng(5).uniform(0.1, 2, routed.shape), 0), jnp.float32)
    base = dataclasses.replace(_TINY_CFG, block_m=64, block_n=256)
    with _interpret():
        for persistent in (False, True):
            cfg = dataclasses.replace(base, persistent=persistent)
            h32 = swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=3.0, config=cfg)
            hq = swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=3.0, config=cfg, out_dtype=jnp.bfloat16,
                              act_block=32)
            hb = swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=3.0, config=cfg, out_dtype=jnp.bfloat16)
            assert hq.dtype == hb.dtype == jnp.bfloat16 and hq.shape == h32.shape
            want_q = fake_quant_fp8(h32.astype(jnp.bfloat16), 32)
            assert np.array_equal(_bits(hq)[used], _bits(want_q)[used]), persistent
            assert np.array_equal(_bits(hb)[used], _bits(h32.astype(jnp.bfloat16))[used]), persistent
            assert not np.array_equal(_bits(hq)[used], _bits(hb)[used])       # the quantizer rounds
            assert not np.any(np.asarray(hq, np.float32)[used & ~routed])
    assert not races_found()
    with pytest.raises(ValueError, match="bfloat16"):
        swiglu_tiles(plan, x_pk, w, s, w3, s3, row_w, limit=3.0, config=base, act_block=32)
    assert "64-row" in swiglu_unsupported_reason(dataclasses.replace(base, block_m=16), fmt, jnp.bfloat16, 32)
    assert "granules" in swiglu_unsupported_reason(base, fmt, jnp.bfloat16, 48)
    prefill = GroupedMatmulConfig(block_m=128, block_n=256, block_k=64, stages=8, consumers=2)
    assert swiglu_unsupported_reason(prefill, fmt, jnp.float32) is None
    assert "shared memory" in swiglu_unsupported_reason(prefill, fmt, jnp.bfloat16, 32)
    fitted = swiglu_config(prefill, fmt, jnp.bfloat16, 32)     # the most stages that fit: 7 for FP4
    assert fitted == dataclasses.replace(prefill, stages=fitted.stages)
    assert fitted.stages == {"fp4": 7, "fp8": 5}[fmt.value]
    assert swiglu_unsupported_reason(fitted, fmt, jnp.bfloat16, 32) is None
    assert swiglu_config(dataclasses.replace(prefill, block_m=32), fmt, jnp.bfloat16, 32) is None


def test_swiglu_epilogue_row_is_batch_invariant_in_gpu_interpreter():
    """A probe row's h from ``swiglu_tiles`` has the same bits alone, among other rows of other experts,
    and among rows of its own expert (its tile and position in it change): bitwise, persistent launch."""
    from pallas_kernels.grouped_gemm.kernel import swiglu_tiles, tile_rows

    g, n, k = 3, 256, 256
    w, s, x, _ = _routed_problem(41, WeightFormat.FP4, g, n, k, 1)
    w3, s3, others, _ = _routed_problem(43, WeightFormat.FP4, g, n, k, 20)
    cfg = dataclasses.replace(_TINY_CFG, block_n=256, persistent=True)
    batches = {"alone": (x, [1]), "mixed": (jnp.concatenate([others[:9], x, others[9:]]), [0, 2] * 4 + [2, 1] + [0] * 11),
               "same expert": (jnp.concatenate([others, x]), [1] * 21)}
    got = {}
    with _interpret():
        for name, (xb, ids) in batches.items():
            gid = jnp.asarray(ids, jnp.int32)
            plan, x_pk = tile_rows(xb, gid, num_groups=g, block_m=16, fp4=True)
            probe = ids.index(1) if name == "alone" else (9 if name == "mixed" else 20)
            h = swiglu_tiles(plan, x_pk, w, s, w3, s3, jnp.ones(x_pk.shape[0], jnp.float32), limit=3.0, config=cfg)
            got[name] = _bits(h)[int(plan.dest_m[probe])]
    assert not races_found()
    assert np.abs(got["alone"].view(np.float32)).max() > 0.1
    for name in ("mixed", "same expert"):
        assert np.array_equal(got[name], got["alone"]), name


@pytest.mark.parametrize("fmt", [WeightFormat.FP8, WeightFormat.FP4], ids=lambda f: f.value)
def test_swiglu_epilogue_lowers_for_hopper(fmt):
    """``swiglu_tiles`` in the GPU configuration (dequantized A in registers, both launches, the FP4
    decoders the engine picks) passes Mosaic GPU's lowering for CUDA without a GPU: layouts, the
    float32 row stores' whole sectors, shared memory; and the bf16 rows through shared memory, with
    and without the quantizer (its transposed store, the token-major load, the block maxima)."""
    from pallas_kernels.grouped_gemm.kernel import swiglu_tiles, tile_rows

    g, n, k, m = 4, 256, 256, 40
    x, gid = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((m,), jnp.int32)
    if fmt is WeightFormat.FP8:
        w, s = jax.ShapeDtypeStruct((g, n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((g, n // 32, k // 32), jnp.uint8)
    else:
        w, s = jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8)
    for extra, out in ((dict(persistent=True, fp4_dequant="subnormal"), None),
                       (dict(persistent=False, fp4_dequant="packed"), None),
                       (dict(persistent=True, fp4_dequant="subnormal", block_m=64), (jnp.bfloat16, 32)),
                       (dict(persistent=False, fp4_dequant="packed", block_m=64), (jnp.bfloat16, None))):
        cfg = GroupedMatmulConfig(**{**dict(block_m=32, block_n=256, block_k=64, stages=3, consumers=2), **extra})
        out_kw = {} if out is None else dict(out_dtype=out[0], act_block=out[1])

        def run(x, w, gid, s, cfg=cfg, out_kw=out_kw):
            plan, x_pk = tile_rows(x, gid, num_groups=g, block_m=cfg.block_m, fp4=fmt is WeightFormat.FP4)
            return swiglu_tiles(plan, x_pk, w, s, w, s, jnp.ones(x_pk.shape[0]), limit=7.0, config=cfg, **out_kw)
        assert "mosaic_gpu" in jax.jit(run).trace(x, w, gid, s).lower(lowering_platforms=("cuda",)).as_text()


def test_pdl_configs_lower_with_the_grid_wait_and_others_without():
    """``pdl=True`` (``Numerics.kernel_pdl``): the grouped GEMM, attention and Sinkhorn kernels lower for
    CUDA with ``griddepcontrol.wait`` and the module marked as using PDL, which makes the runtime launch
    them so; the default configs carry neither."""
    from pallas_kernels.attention import SparseAttentionConfig
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas
    from pallas_kernels.sinkhorn import SinkhornConfig
    from pallas_kernels.sinkhorn.kernel import sinkhorn_rounds_pallas

    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    g, n, k, m = 4, 256, 256, 40
    gg_args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8),
               jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8))
    b, t, h, d, s, kk = 1, 2, 64, 512, 256, 128
    at_args = (jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16),
               jax.ShapeDtypeStruct((b, t, kk), jnp.int32), jax.ShapeDtypeStruct((h,), jnp.float32))
    sk_args = (jax.ShapeDtypeStruct((3, 5, 4, 4), jnp.float32),)
    for pdl in (False, True):
        kernels = {
            "grouped_gemm": (lambda *a: grouped_matmul_pallas(*a, out_dtype=jnp.float32, config=GroupedMatmulConfig(
                block_m=32, block_n=128, block_k=64, stages=3, pdl=pdl)), gg_args),
            "attention": (lambda *a: sparse_sink_attention_pallas(*a, 0.05, SparseAttentionConfig(pdl=pdl)), at_args),
            "sinkhorn": (lambda c: sinkhorn_rounds_pallas(c, rounds=3, eps=1e-6, config=SinkhornConfig(pdl=pdl)),
                         sk_args),
        }
        for name, (fn, args) in kernels.items():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text, name
            assert ("griddepcontrol.wait" in text) == pdl and ("uses_pdl" in text) == pdl, (name, pdl)
