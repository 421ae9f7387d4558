"""sparse_sink_attention: reference vs a float64 numpy oracle, the XLA path and the Mosaic GPU kernel
(run on the CPU by the Mosaic GPU interpreter) vs the reference, bitwise batch invariance of the XLA
path and of the kernel, sinks, -1 entries, duplicates and the all-invalid row."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.attention import (SparseAttentionConfig, kernel_unsupported_reason,
                                      sparse_sink_attention_reference, sparse_sink_attention_xla)
from pallas_kernels.attention.config import seesaw_smem_bytes, smem_bytes
from pallas_kernels.interpret import gpu_interpreter, races_found


def _oracle(q, kv, idx, sink, scale):
    """float64 numpy, one query at a time, straight from the definition."""
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv, np.float64)
    idx = np.asarray(idx)
    sink = np.asarray(sink, np.float64)
    b, t, h, d = q.shape
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for ti in range(t):
            rows = kv[bi, idx[bi, ti][idx[bi, ti] >= 0]]          # duplicates stay
            z = q[bi, ti] @ rows.T * scale                         # [H, k]
            m = np.maximum(z.max(axis=1), sink) if rows.shape[0] else sink
            e = np.exp(z - m[:, None])
            out[bi, ti] = e @ rows / (e.sum(axis=1) + np.exp(sink - m))[:, None]
    return out


def _inputs(rng, b, t, h, d, s, k, *, invalid_frac=0.2):
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.bfloat16)
    idx = rng.integers(0, s, (b, t, k)).astype(np.int32)
    idx[rng.random((b, t, k)) < invalid_frac] = -1
    sink = jnp.asarray(rng.standard_normal(h) * 2, jnp.float32)
    return q, kv, idx, sink


def _bits(x):
    return np.asarray(x).view(np.uint16 if x.dtype == jnp.bfloat16 else np.uint32)


# The XLA path and the kernel round p to bf16 for the p.kv product and round the output to bf16:
# each is a relative error of at most 2^-9, and |o| <= max|kv| (a convex combination shrunk by the
# sink), so 4 bf16 half-ulps of max|kv| bound them; the float32 reference is far tighter than that.
def _fast_tol(kv):
    return 4 * 2.0 ** -9 * float(jnp.max(jnp.abs(kv.astype(jnp.float32))))


def test_reference_matches_float64_oracle_with_sinks_duplicates_and_skips():
    rng = np.random.default_rng(0)
    q, kv, idx, sink = _inputs(rng, 2, 3, 4, 64, 37, 20)
    idx[0, 1, :] = -1                     # no valid entry -> 0
    idx[1, 2, :6] = idx[1, 2, 6]          # one entry listed 7 times
    got = sparse_sink_attention_reference(q, kv, jnp.asarray(idx), sink, 64 ** -0.5)
    want = _oracle(q, kv, idx, sink, 64 ** -0.5)
    # float32 HIGHEST einsums over D=64 and K=20: ~1e-6 relative; 1e-5 leaves room and still catches a
    # missing sink (changes the output by >1e-2) or a dropped duplicate.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[0, 1]) == 0)


def test_sink_only_enlarges_the_denominator():
    rng = np.random.default_rng(1)
    q, kv, idx, sink = _inputs(rng, 1, 1, 4, 64, 16, 8, invalid_frac=0.0)
    lo = sparse_sink_attention_reference(q, kv, jnp.asarray(idx), jnp.full((4,), -1e4), 0.125)
    hi = sparse_sink_attention_reference(q, kv, jnp.asarray(idx), jnp.full((4,), 1e4), 0.125)
    plain = _oracle(q, kv, idx, np.full((4,), -np.inf), 0.125)   # ordinary softmax attention
    np.testing.assert_allclose(np.asarray(lo), plain, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(hi) == 0)   # e^(z - 1e4) underflows: all weight on the sink


def test_xla_matches_reference():
    rng = np.random.default_rng(2)
    q, kv, idx, sink = _inputs(rng, 2, 3, 4, 64, 50, 40)
    idx[1, 0, :] = -1
    got = sparse_sink_attention_xla(q, kv, jnp.asarray(idx), sink, 64 ** -0.5)
    assert got.dtype == jnp.bfloat16
    want = sparse_sink_attention_reference(q, kv, jnp.asarray(idx), sink, 64 ** -0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=_fast_tol(kv), rtol=0)
    assert np.all(np.asarray(got[1, 0], np.float32) == 0)


def test_skipped_entries_equal_removed_entries():
    rng = np.random.default_rng(3)
    q, kv, idx, sink = _inputs(rng, 1, 1, 4, 64, 30, 24, invalid_frac=0.5)
    compact = idx[0, 0][idx[0, 0] >= 0][None, None]
    a = sparse_sink_attention_reference(q, kv, jnp.asarray(idx), sink, 0.125)
    c = sparse_sink_attention_reference(q, kv, jnp.asarray(compact), sink, 0.125)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_xla_path_is_bitwise_batch_invariant(batch):
    """The probe query's output is the same bits alone, at any slot, among any neighbours."""
    rng = np.random.default_rng(4)
    h, d, s, k, t = 4, 64, 40, 24, 2
    probe_q, probe_kv, probe_idx, sink = _inputs(rng, 1, t, h, d, s, k)
    alone = sparse_sink_attention_xla(probe_q, probe_kv, jnp.asarray(probe_idx), sink, 0.125)
    for slot in sorted({0, batch - 1, batch // 2}):
        q, kv, idx, _ = _inputs(rng, batch, t, h, d, s, k)
        q = q.at[slot].set(probe_q[0])
        kv = kv.at[slot].set(probe_kv[0])
        idx[slot] = probe_idx[0]
        got = sparse_sink_attention_xla(q, kv, jnp.asarray(idx), sink, 0.125)
        assert np.array_equal(_bits(got[slot]), _bits(alone[0])), f"batch {batch}, slot {slot}"


def test_config_validation_and_shape_limits():
    with pytest.raises(ValueError, match="split_rows"):
        SparseAttentionConfig(split_rows=100)
    with pytest.raises(ValueError, match="row_issue"):
        SparseAttentionConfig(row_issue="lanes")
    with pytest.raises(ValueError, match="pv_cols"):
        SparseAttentionConfig(pv_cols=96)
    cfg = SparseAttentionConfig(split_rows=640)
    assert cfg.num_splits(640) == 1 and cfg.num_splits(641) == 2
    assert kernel_unsupported_reason(64, 512, cfg) is None
    assert "multiple of 128" in kernel_unsupported_reason(4, 64, cfg)
    # V4.1 decode fits in shared memory with room for the barriers.
    assert smem_bytes(512, 640) < 227 * 1024
    with pytest.raises(ValueError, match="schedule"):
        SparseAttentionConfig(schedule="pingpong")
    with pytest.raises(ValueError, match="pairs"):
        SparseAttentionConfig(split_rows=320, schedule="seesaw")     # 5 blocks
    seesaw = SparseAttentionConfig(split_rows=640, schedule="seesaw")
    assert kernel_unsupported_reason(64, 512, seesaw) is None
    assert "halves" in kernel_unsupported_reason(64, 512, seesaw, fp4=True)
    assert "profiler" in kernel_unsupported_reason(64, 512, SparseAttentionConfig(
        640, schedule="seesaw", profile_dir="/tmp", profile_ranges=64))
    # q, two 64-row blocks in wgmma tiles and two p tiles: 208 KB at D = 512, plus the indices
    assert seesaw_smem_bytes(512, 640) == 64 * 1024 + 128 * 1024 + 16 * 1024 + 1024 + 640 * 4


# ---- the Mosaic GPU kernel, run by the Mosaic GPU interpreter on the CPU -------------------------

def _interpret():
    """plgpu kernels run in the Mosaic GPU interpreter (with its race detector) inside this context."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    return gpu_interpreter(detect_races=True)


@pytest.mark.parametrize("split_rows,row_issue", [(128, "warpgroup"), (64, "warpgroup"), (64, "warps")])
def test_kernel_in_gpu_interpreter_matches_reference(split_rows, row_issue):
    """split 128: one split (sink in the kernel); 64: two splits + merge; row_issue: who issues the
    row copies (the barrier counts differ per mode, so a wrong count hangs or races here)."""
    _check_kernel_in_interpreter(SparseAttentionConfig(split_rows=split_rows, row_issue=row_issue), 5, 100)


def _check_kernel_in_interpreter(cfg, seed, k):
    """The kernel under ``cfg`` in the interpreter against the float64 oracle and the XLA path, on
    4 heads (run padded to 64), K = k entries (padded to the split) with skips, a whole 64-row block of
    them, duplicates and a query with no valid entry."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas

    rng = np.random.default_rng(seed)
    b, t, h, d, s = 2, 2, 4, 128, 90
    q, kv, idx, sink = _inputs(rng, b, t, h, d, s, k)
    idx[0, 1, :] = -1                              # no valid entry -> 0
    idx[1, 0, :64] = -1                            # a whole 64-row block of skips
    idx[1, 1, :10] = idx[1, 1, 10]                 # duplicates
    with _interpret():
        got = jax.block_until_ready(sparse_sink_attention_pallas(q, kv, jnp.asarray(idx), sink, d ** -0.5, cfg))
    assert not races_found()
    assert got.shape == (b, t, h, d) and got.dtype == jnp.bfloat16
    want = _oracle(q, kv, idx, sink, d ** -0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=_fast_tol(kv), rtol=0)
    assert np.all(np.asarray(got[0, 1], np.float32) == 0)
    xla = sparse_sink_attention_xla(q, kv, jnp.asarray(idx), sink, d ** -0.5)
    # Same roundings as the XLA path, different summation order: a couple of output ulps apart.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32),
                               atol=_fast_tol(kv) / 2, rtol=0)


def _probe_third_of_three(rng, k, h=4, d=128, s=70):
    """A one-query case (q, kv, idx, sink) and a batch of three random queries whose third is that
    query (its q, cache and indices; the sink is the batch's)."""
    probe = _inputs(rng, 1, 1, h, d, s, k)
    q, kv, idx, sink = _inputs(rng, 3, 1, h, d, s, k)
    idx[2] = probe[2][0]
    return probe, (q.at[2].set(probe[0][0]), kv.at[2].set(probe[1][0]), idx, sink)


def test_kernel_in_gpu_interpreter_is_batch_invariant():
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas

    probe, (q, kv, idx, sink) = _probe_third_of_three(np.random.default_rng(6), 64)
    cfg = SparseAttentionConfig(split_rows=64)
    with _interpret():
        alone = sparse_sink_attention_pallas(probe[0], probe[1], jnp.asarray(probe[2]), sink, 0.1, cfg)
        among = sparse_sink_attention_pallas(q, kv, jnp.asarray(idx), sink, 0.1, cfg)
    assert np.array_equal(_bits(among[2]), _bits(alone[0]))


def test_split_trimmed_to_the_index_rows_changes_no_bits():
    """A split longer than the index list runs only the blocks the list fills (``kernel._trimmed``):
    K = 100 under split 320 runs 2 blocks, and gives bitwise what the same list padded with -1 to 320
    entries (5 blocks, no trim) gives: rows of -1 add exactly nothing. Two splits are never trimmed."""
    from pallas_kernels.attention.kernel import _trimmed, sparse_sink_attention_pallas

    assert _trimmed(SparseAttentionConfig(320), 100).split_rows == 128
    assert _trimmed(SparseAttentionConfig(640), 640).split_rows == 640
    assert _trimmed(SparseAttentionConfig(320), 640).split_rows == 320          # two splits: as configured
    rng = np.random.default_rng(8)
    q, kv, idx, sink = _inputs(rng, 1, 2, 4, 128, 90, 100)
    idx[0, 1, :64] = -1                                                         # a whole block of skips too
    padded = np.concatenate([idx, np.full((1, 2, 220), -1, np.int32)], axis=-1)
    cfg = SparseAttentionConfig(split_rows=320)
    with _interpret():
        short, full = (sparse_sink_attention_pallas(q, kv, jnp.asarray(i), sink, 0.1, cfg) for i in (idx, padded))
    assert not races_found()
    assert np.array_equal(_bits(short), _bits(full))


def test_kernel_pv_column_split_changes_no_bits():
    """pv_cols only cuts the p.kv output columns into narrower wgmmas: no sum changes, so the same bits."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas

    rng = np.random.default_rng(7)
    q, kv, idx, sink = _inputs(rng, 1, 2, 4, 128, 70, 64)
    with _interpret():
        outs = [sparse_sink_attention_pallas(q, kv, jnp.asarray(idx), sink, 0.1,
                                             SparseAttentionConfig(split_rows=64, pv_cols=c)) for c in (64, 32)]
    assert not races_found()
    assert np.array_equal(_bits(outs[0]), _bits(outs[1]))


# The seesaw schedule's consumers in the interpreter: rows gathered by XLA and copied by TMA
# ("seesaw_gathered"; the cp.async form is inline code, which the interpreter cannot run: its check is
# benchmarks/attention_gpu.py, which compares the two forms bit for bit on a GPU).
@pytest.mark.parametrize("split_rows,k", [(128, 100), (256, 250), (128, 200)])
def test_seesaw_kernel_in_gpu_interpreter_matches_reference(split_rows, k):
    """(128, 100): one pair, the sink in the kernel; (256, 250): two pairs, so the hand-offs and every
    slot's free/ready barriers go round twice; (128, 200): two splits and the merge. The tolerance
    against the XLA path is the halves kernel's: the seesaw rounds p of a pair's first block at that
    block's own max for consumer 0's half, then rescales, a couple of output ulps either way."""
    _check_kernel_in_interpreter(SparseAttentionConfig(split_rows=split_rows, schedule="seesaw_gathered"), 9, k)


def test_seesaw_kernel_in_gpu_interpreter_is_batch_invariant_and_trims_to_pairs():
    """A query alone and third in a batch of three give the same bits; and a split longer than the
    index list runs whole pairs only (K = 100 under split 640: one pair), the same bits as the list
    padded with -1 to 640 entries (five pairs)."""
    from pallas_kernels.attention.kernel import _trimmed, sparse_sink_attention_pallas

    assert _trimmed(SparseAttentionConfig(640, schedule="seesaw"), 100).split_rows == 128
    assert _trimmed(SparseAttentionConfig(640, schedule="seesaw"), 130).split_rows == 256
    probe, (q, kv, idx, sink) = _probe_third_of_three(np.random.default_rng(10), 100)
    padded = np.concatenate([probe[2], np.full((1, 1, 540), -1, np.int32)], axis=-1)
    cfg = SparseAttentionConfig(split_rows=640, schedule="seesaw_gathered")
    with _interpret():
        alone = sparse_sink_attention_pallas(probe[0], probe[1], jnp.asarray(probe[2]), sink, 0.1, cfg)
        among = sparse_sink_attention_pallas(q, kv, jnp.asarray(idx), sink, 0.1, cfg)
        full = sparse_sink_attention_pallas(probe[0], probe[1], jnp.asarray(padded), sink, 0.1, cfg)
    assert not races_found()
    assert np.array_equal(_bits(among[2]), _bits(alone[0]))
    assert np.array_equal(_bits(full), _bits(alone))


@pytest.mark.parametrize("cfg", [SparseAttentionConfig(640), SparseAttentionConfig(320),
                                 SparseAttentionConfig(320, producer_warpgroups=2),
                                 SparseAttentionConfig(320, pv_cols=256, pv_in_place=True),
                                 SparseAttentionConfig(320, row_issue="warps"),
                                 SparseAttentionConfig(320, row_issue="cp_async"),
                                 SparseAttentionConfig(640, schedule="seesaw"),
                                 SparseAttentionConfig(256, schedule="seesaw", pv_cols=256, pv_in_place=True),
                                 SparseAttentionConfig(640, schedule="seesaw_gathered")])
def test_kernel_lowers_for_cuda_at_the_v41_decode_shape(cfg):
    """Cross-lowers the kernel for CUDA on this CPU machine: Mosaic GPU's Python lowering checks the
    layout, tiling, swizzle and TMA rules that the interpreter ignores (a wrong tile or copy fails here)."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas

    args = (jax.ShapeDtypeStruct((64, 1, 64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((64, 8320, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 1, 640), jnp.int32), jax.ShapeDtypeStruct((64,), jnp.float32))
    fn = jax.jit(lambda q, kv, idx, sink: sparse_sink_attention_pallas(q, kv, idx, sink, 512 ** -0.5, cfg))
    module = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    assert "mosaic_gpu" in module


def test_dispatcher_uses_the_registry():
    from pallas_kernels.attention import sparse_sink_attention
    from pallas_kernels.registry import KernelUnavailableError

    rng = np.random.default_rng(9)
    q, kv, idx, sink = _inputs(rng, 1, 2, 4, 64, 20, 12)
    idx = jnp.asarray(idx)
    auto = sparse_sink_attention(q, kv, idx, sink, 0.125)            # CPU: the XLA path
    assert np.array_equal(_bits(auto), _bits(sparse_sink_attention_xla(q, kv, idx, sink, 0.125)))
    ref = sparse_sink_attention(q, kv, idx, sink, 0.125, impl="reference")
    assert ref.dtype == jnp.float32
    with pytest.raises(KernelUnavailableError, match="pallas_mosaic_gpu"):
        sparse_sink_attention(q, kv, idx, sink, 0.125, impl="pallas_mosaic_gpu")


# ---- the FP4 two-source variant (compressed rows as the V4.1 cache stores them) --------------------

def _fp4_inputs(rng, b, t, h, d, sw, n, kw, kc):
    from deepinfer_jax.model import kv_codec

    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    win = jnp.asarray(rng.standard_normal((b, sw, d)), jnp.bfloat16)
    comp = kv_codec.encode(kv_codec.COMPRESSED, jnp.asarray(rng.standard_normal((b, n, d)) * 3, jnp.float32), True,
                           jnp.bfloat16)
    widx = rng.integers(0, sw, (b, t, kw)).astype(np.int32)
    cidx = rng.integers(0, n, (b, t, kc)).astype(np.int32)
    sink = jnp.asarray(rng.standard_normal(h) * 2, jnp.float32)
    return q, win, widx, comp, cidx, sink


def _fp4_oracle(q, win, widx, comp, cidx, sink, scale):
    """The definition: decode the cache with kv_codec (the model's own decoder), concatenate, float64 oracle."""
    from deepinfer_jax.model import kv_codec

    kv = jnp.concatenate([win, kv_codec.decode(kv_codec.COMPRESSED, comp, jnp.float32).astype(jnp.bfloat16)], 1)
    idx = np.concatenate([widx, np.where(cidx >= 0, cidx + win.shape[1], -1)], axis=-1)
    return _oracle(q, kv, idx, sink, scale), kv


def test_fp4_xla_and_reference_match_the_decoded_cache():
    from pallas_kernels.attention import sparse_sink_attention_fp4_reference, sparse_sink_attention_fp4_xla

    rng = np.random.default_rng(11)
    q, win, widx, comp, cidx, sink = _fp4_inputs(rng, 2, 3, 4, 64, 20, 40, 12, 30)
    widx[0, 1, :] = -1
    cidx[0, 1, :] = -1                      # nothing to attend: 0
    cidx[1, 2, :5] = cidx[1, 2, 5]          # duplicates count twice
    cidx[1, 0, ::3] = -1
    want, kv = _fp4_oracle(q, win, widx, comp, cidx, sink, 0.125)
    args = (q, win, jnp.asarray(widx), comp["values"], comp["scale"], jnp.asarray(cidx), sink, 0.125)
    ref = np.asarray(sparse_sink_attention_fp4_reference(*args))
    np.testing.assert_allclose(ref, want, rtol=0, atol=1e-5)   # float32 vs float64 of the same rows
    got = sparse_sink_attention_fp4_xla(*args)
    assert got.shape == q.shape and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=_fast_tol(kv))
    assert np.all(np.asarray(got[0, 1], np.float32) == 0)


def test_fp4_xla_path_is_bitwise_batch_invariant():
    from pallas_kernels.attention import sparse_sink_attention_fp4_xla

    rng = np.random.default_rng(12)
    q, win, widx, comp, cidx, sink = _fp4_inputs(rng, 5, 1, 4, 64, 16, 24, 16, 20)
    f = jax.jit(lambda *a: sparse_sink_attention_fp4_xla(*a, sink, 0.1))
    full = f(q, win, jnp.asarray(widx), comp["values"], comp["scale"], jnp.asarray(cidx))
    alone = f(q[3:4], win[3:4], jnp.asarray(widx[3:4]), comp["values"][3:4], comp["scale"][3:4],
              jnp.asarray(cidx[3:4]))
    assert np.array_equal(_bits(full[3]), _bits(alone[0]))


def test_fp4_shape_limits_and_errors():
    from pallas_kernels.attention.kernel import sparse_sink_attention_fp4_pallas

    assert kernel_unsupported_reason(64, 512, SparseAttentionConfig(320), fp4=True) is None
    assert "multiple of 128" in kernel_unsupported_reason(64, 128, SparseAttentionConfig(320), fp4=True)
    assert "one producer" in kernel_unsupported_reason(64, 512, SparseAttentionConfig(320, producer_warpgroups=2),
                                                       fp4=True)
    assert smem_bytes(512, 320, fp4=True) - smem_bytes(512, 320) == 64 * 256 + 64 * 32
    rng = np.random.default_rng(13)
    q, win, widx, comp, cidx, sink = _fp4_inputs(rng, 1, 1, 4, 256, 8, 8, 4, 4)
    with pytest.raises(ValueError, match="comp_scale_bng"):
        sparse_sink_attention_fp4_pallas(q, win, jnp.asarray(widx), comp["values"],
                                         comp["scale"].astype(jnp.float32), jnp.asarray(cidx), sink, 0.1)
    with pytest.raises(ValueError, match="comp_idx_btk"):
        sparse_sink_attention_fp4_pallas(q, win, jnp.asarray(widx), comp["values"], comp["scale"],
                                         jnp.asarray(cidx[0]), sink, 0.1)


def test_fp4_bits_decoder_gives_the_arith_values_for_every_byte_and_scale():
    """The FP4 variant's two row decoders ("bits": float16 bit placement with the 2^14 moved into the
    scale; "arith": the float polynomial), written with the kernel's own helpers, over every packed byte
    and every E4M3 scale byte (subnormals, the largest, NaN): the same bf16 values, bit for bit. The
    kernel itself runs only on a GPU (the interpreter hangs on it), so this is the CPU check of the
    arithmetic that its fp4_dequant switch changes."""
    from pallas_kernels.grouped_gemm.kernel import _f16_bits_to_f32, _fp4_bytes_to_f16_bits, _fp4_nibble_to_f32

    q8 = jnp.arange(256, dtype=jnp.int32)[None, :]                                    # [1, byte]
    sc = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
    sc = sc.astype(jnp.float16).astype(jnp.float32)[:, None]                          # [scale, 1]
    arith = jnp.concatenate([_fp4_nibble_to_f32(q8 & 15), _fp4_nibble_to_f32(q8 >> 4)], axis=1) * sc
    bits = _f16_bits_to_f32(jnp.concatenate(_fp4_bytes_to_f16_bits(q8), axis=1)) * (sc * 16384.0)
    a16, b16 = (np.asarray(v.astype(jnp.bfloat16)).view(np.uint16) for v in (arith, bits))
    nan = np.isnan(np.asarray(arith))
    assert nan.sum() == 2 * 2 * 256 and np.array_equal(nan, np.isnan(np.asarray(bits)))  # the two NaN scales
    assert np.array_equal(a16[~nan], b16[~nan])
    assert np.asarray(arith)[~nan].max() == 6 * 448 and np.asarray(arith)[~nan].min() == -6 * 448   # a real range


def test_fp4_packed_decoder_replayed_in_numpy_gives_the_arith_values_for_every_e4m3_scale():
    """The "packed" row decoder (the grouped GEMM's inline PTX fed the row's E4M3 scale as a bf16 pair,
    ``fp4_packed.dequant_scaled``), replayed op for op in numpy: every packed byte in either half of the
    input register times every non-negative finite E4M3 scale byte (zero, subnormals, 448) -> the
    "arith" values' bf16 bits, signed zeros included. (Cache scales come from an amax, so never
    negative; the GPU alone runs the PTX, the lowering test below checks its assembly.)"""
    from pallas_kernels.grouped_gemm import fp4_packed
    from pallas_kernels.grouped_gemm.kernel import _fp4_nibble_to_f32

    scale_bytes = np.arange(0x7F, dtype=np.uint8)               # 0x00..0x7E: +0, subnormals, normals to 448
    sc = jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes), jnp.float8_e4m3fn).astype(jnp.float32)
    s_bits = np.asarray(sc.astype(jnp.bfloat16)).view(np.uint16)[:, None]          # exact: 4 significant bits
    byte0 = np.arange(256)[None, :]
    byte1 = np.roll(np.arange(256), 77)[None, :]
    lo, hi = fp4_packed.emulate_scaled(byte0, byte1, s_bits)
    for word, shift in ((lo, 0), (hi, 4)):
        for half, byte in enumerate((byte0, byte1)):
            want = (_fp4_nibble_to_f32((jnp.asarray(byte) >> shift) & 15) * sc[:, None]).astype(jnp.bfloat16)
            assert np.array_equal((word >> (16 * half)) & 0xFFFF, np.asarray(want).view(np.uint16))
    assert float(sc.max()) == 448 and float(sc[1]) == 2.0 ** -9    # the whole range was covered


@pytest.mark.parametrize("cfg", [SparseAttentionConfig(320), SparseAttentionConfig(640),
                                 SparseAttentionConfig(320, no_auto_barriers=True),
                                 SparseAttentionConfig(320, row_issue="warps"),
                                 SparseAttentionConfig(320, row_issue="cp_async"),
                                 SparseAttentionConfig(320, fp4_dequant="arith"),
                                 SparseAttentionConfig(320, fp4_dequant="bits")])
def test_fp4_kernel_lowers_for_cuda_at_the_v41_decode_shape(cfg):
    """Cross-lowers the FP4 variant for CUDA (Mosaic's layout, tiling and copy-size rules). Its numerics
    are checked on the H200 (`benchmarks/attention_gpu.py --sections fp4`): the Mosaic GPU interpreter
    hangs on this kernel (pallas_kernels/attention/README.md: once the scratch list has 8 buffers)."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_fp4_pallas

    args = (jax.ShapeDtypeStruct((64, 1, 64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((64, 128, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 1, 128), jnp.int32), jax.ShapeDtypeStruct((64, 8192, 256), jnp.uint8),
            jax.ShapeDtypeStruct((64, 8192, 32), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((64, 1, 512), jnp.int32),
            jax.ShapeDtypeStruct((64,), jnp.float32))
    fn = jax.jit(lambda *a: sparse_sink_attention_fp4_pallas(*a, 512 ** -0.5, cfg))
    assert "mosaic_gpu" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()


def test_fp4_dispatcher_and_column_order():
    from pallas_kernels.attention import sparse_sink_attention_fp4, sparse_sink_attention_fp4_xla
    from pallas_kernels.attention.kernel import fp4_column_order

    order = np.asarray(fp4_column_order(32))
    assert order.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                              16, 18, 20, 22, 24, 26, 28, 30, 17, 19, 21, 23, 25, 27, 29, 31]
    from pallas_kernels.grouped_gemm.kernel import from_fp4_k_order, to_fp4_k_order

    a = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 64)), jnp.bfloat16)
    order64 = np.asarray(fp4_column_order(64))
    assert np.array_equal(_bits(to_fp4_k_order(a, 16)), _bits(a[..., order64]))       # the transpose form
    assert np.array_equal(_bits(from_fp4_k_order(a, 16)), _bits(a[..., np.argsort(order64)]))
    rng = np.random.default_rng(14)
    q, win, widx, comp, cidx, sink = _fp4_inputs(rng, 1, 2, 4, 64, 10, 12, 6, 8)
    args = (q, win, jnp.asarray(widx), comp["values"], comp["scale"], jnp.asarray(cidx), sink, 0.125)
    assert np.array_equal(_bits(sparse_sink_attention_fp4(*args)), _bits(sparse_sink_attention_fp4_xla(*args)))
    assert sparse_sink_attention_fp4(*args, impl="reference").dtype == jnp.float32


@pytest.mark.parametrize("swizzle", [32, 64, 128])
def test_swizzled_offset_is_the_cutlass_swizzle_of_the_tiled_layout(swizzle):
    """``cp_async.swizzled_offset`` (where ``gather_rows(..., swizzle=)`` puts a row's 16-byte pieces) against
    an independent form: Mosaic's tiled layout (8-row tiles ``swizzle`` bytes wide, tile-row-major) with
    CUTLASS's Swizzle<B, 4, 3> on each tile's byte offsets (bits [7, 7 + B) XORed into [4, 4 + B)), and
    a bijection onto the buffer's pieces. The GPU check is benchmarks/attention_swizzle_probe.py."""
    from pallas_kernels.attention.cp_async import swizzled_offset

    row_bytes, rows = 1024, 24
    b_bits = {32: 1, 64: 2, 128: 3}[swizzle]
    mask = ((1 << b_bits) - 1) << 4
    seen = set()
    for r in range(rows):
        for piece in range(row_bytes // 16):
            col_byte = piece * 16
            tile = (r // 8) * (row_bytes // swizzle) + col_byte // swizzle
            o = (r % 8) * swizzle + col_byte % swizzle            # unswizzled, within the 8 x swizzle tile
            want = tile * 8 * swizzle + (o ^ ((o >> 3) & mask))
            got = swizzled_offset(r, piece, row_bytes=row_bytes, swizzle=swizzle)
            assert got == want, (r, piece)
            seen.add(got)
    assert sorted(seen) == list(range(0, rows * row_bytes, 16))


def test_swizzle_probe_kernel_lowers_for_cuda():
    """benchmarks/attention_swizzle_probe.py's kernel (cp.async rows into swizzled tiles beside the
    TMA-landed form) cross-lowers for CUDA at both swizzles: the CPU's check of code only a GPU runs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import attention_swizzle_probe as probe

    for swizzle in (64, 128):
        fn = jax.jit(probe.build(swizzle))
        args = (jax.ShapeDtypeStruct((4096, probe.D), jnp.bfloat16), jax.ShapeDtypeStruct((probe.ROWS,), jnp.int32))
        assert "mosaic_gpu" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
