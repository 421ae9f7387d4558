"""The index-score op (pallas_kernels/indexer): the XLA path and the Mosaic GPU kernel (run on the CPU by
the Mosaic GPU interpreter) against the float32 reference, the kernel's batch invariance and tile
skipping (bitwise), its CUDA lowering at V4.1's shapes, and the model's routing to it."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.indexer import IndexScoresConfig, index_scores, index_scores_reference, index_scores_xla
from pallas_kernels.interpret import gpu_interpreter, races_found


def _inputs(seed, b, t, h, s, d=128):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((b, t, h, d)), jnp.bfloat16)
    k = jnp.asarray(r.standard_normal((b, s, d)) * np.exp(r.uniform(-2, 2, (b, s, 1))), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((b, t, h)), jnp.float32)
    return q, k, w


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _kernel(*args, config=IndexScoresConfig(block_s=128, stages=2), detect_races=False):
    from pallas_kernels.indexer.kernel import index_scores_pallas

    with gpu_interpreter(detect_races=detect_races):
        return jax.block_until_ready(index_scores_pallas(*args, config=config))


# The products of bf16 inputs are exact in fp32 on every path, so the paths differ only in fp32
# summation order: 128 products per dot, then H heads. 1e-5 of the largest score is ~100 ulp of it.
TOL = 1e-5


def test_xla_path_matches_reference_in_key_blocks():
    q, k, w = _inputs(0, 2, 5, 4, 50)
    ref = index_scores_reference(q, k, w)
    assert _rel(index_scores_xla(q, k, w), ref) < TOL
    # 5 blocks, a partial last one: same inputs per score; XLA may order the head sum differently per
    # block shape (measured: not bitwise on the CPU), so fp32 rounding apart
    assert _rel(index_scores_xla(q, k, w, key_block=12), ref) < TOL


@pytest.mark.parametrize("t,s,h,block_s", [(130, 200, 4, 128), (64, 64, 3, 64)], ids=["ragged", "one-tile"])
def test_kernel_in_gpu_interpreter_matches_reference(t, s, h, block_s):
    q, k, w = _inputs(1, 1, t, h, s)
    got = _kernel(q, k, w, None, config=IndexScoresConfig(block_s=block_s, stages=2), detect_races=True)
    assert not races_found()
    assert got.shape == (1, t, s)
    assert _rel(got, index_scores_reference(q, k, w)) < TOL


def test_kernel_is_batch_invariant_and_skipped_tiles_change_no_visible_score():
    q, k, w = _inputs(2, 2, 70, 2, 300)
    q1, k1, w1 = _inputs(3, 1, 70, 2, 300)
    alone = _kernel(q1, k1, w1, None)
    batched = _kernel(jnp.concatenate([q, q1]), jnp.concatenate([k, k1]), jnp.concatenate([w, w1]), None)
    assert np.array_equal(np.asarray(batched[2:]), np.asarray(alone))
    # causal visibility: query t sees t + 100 keys, so the last key tiles of the first query tile are skipped
    n_vis = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32) + 100, (1, 70))
    skipped = np.asarray(_kernel(q1, k1, w1, n_vis))
    visible = np.arange(300)[None, :] < np.asarray(n_vis)[0][:, None]
    assert np.array_equal(skipped[0][visible], np.asarray(alone)[0][visible])
    # the op's contract: -inf past each query's own count, in computed tiles ([128, 256) holds keys some
    # queries see and others do not) and in the skipped tile [256, 384), past every query's 169 keys
    assert np.all(np.isneginf(skipped[0][~visible]))


def test_every_implementation_writes_minus_inf_past_each_querys_visible_keys():
    """The op's n_visible contract (what lets the model drop its masking pass): the kernel in the
    interpreter, the XLA path and the reference give -inf exactly at keys >= the query's count and the
    reference's finite scores elsewhere (TOL); the kernel's output is its buffer, unsliced, when T and S
    are whole tiles."""
    q, k, w = _inputs(5, 2, 128, 3, 256)
    n_vis = jnp.asarray(np.random.default_rng(5).integers(0, 300, (2, 128)), jnp.int32)   # some past S
    unseen = np.arange(256)[None, None, :] >= np.asarray(n_vis)[..., None]
    want = np.asarray(index_scores_reference(q, k, w))
    for got in (_kernel(q, k, w, n_vis), index_scores_xla(q, k, w, n_vis), index_scores_reference(q, k, w, n_vis),
                index_scores(q, k, w, n_vis)):
        got = np.asarray(got)
        assert np.all(np.isneginf(got[unseen])) and np.all(np.isfinite(got[~unseen]))
        assert _rel(got[~unseen], want[~unseen]) < TOL
    from pallas_kernels.indexer.kernel import index_scores_pallas

    jaxpr = str(jax.make_jaxpr(lambda *a: index_scores_pallas(*a, config=IndexScoresConfig()))(q, k, w, n_vis))
    assert " slice[" not in jaxpr and "dynamic_slice" not in jaxpr


def test_kernel_lowers_for_cuda_at_v41_prefill_shapes():
    from pallas_kernels.indexer.kernel import index_scores_pallas

    q = jax.ShapeDtypeStruct((1, 2048, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 32784, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, 2048, 32), jnp.float32)
    nv = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
    for cfg in (IndexScoresConfig(), IndexScoresConfig(block_s=64, stages=4)):
        lowered = jax.jit(lambda *a, cfg=cfg: index_scores_pallas(*a, config=cfg)).trace(q, k, w, nv).lower(
            lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def test_op_dispatch_and_unsupported_shapes():
    from pallas_kernels.indexer import kernel_unsupported_reason
    from pallas_kernels.registry import resolve

    q, k, w = _inputs(4, 1, 3, 2, 9)
    assert np.array_equal(np.asarray(index_scores(q, k, w)), np.asarray(index_scores_xla(q, k, w)))   # CPU: XLA
    assert _rel(index_scores(q, k, w, impl="reference"), index_scores_reference(q, k, w)) == 0
    # picked automatically on a CUDA platform (it ran on the H200: 6-7x the XLA path), XLA elsewhere
    assert resolve("index_scores", platform="cuda").name == "pallas_mosaic_gpu"
    assert resolve("index_scores", platform="cpu").name == "xla"
    assert "head_dim=64" in kernel_unsupported_reason(32, 64, IndexScoresConfig())
    assert "shared memory" in kernel_unsupported_reason(512, 128, IndexScoresConfig())
    with pytest.raises(ValueError, match="block_s"):
        IndexScoresConfig(block_s=256)


def _model_scores(hi: int, stored: bool = False):
    """run(t, numerics) -> (indexer.index_scores with those numerics, with the reference numerics) for
    one random row of a toy indexer with ``hi`` heads of 128 dims over 90 keys (stored: the keys as the
    index cache stores them, ``kv_codec.INDEX_K``)."""
    from deepinfer_jax.config import RopeSpec
    from deepinfer_jax.model import indexer
    from deepinfer_jax.model.numerics import Numerics
    from deepinfer_jax.model.rope import rope_inv_freq

    r = np.random.default_rng(5)
    di, d, qrank, s = 128, 32, 32, 90
    cfg = type("C", (), {"index_n_heads": hi, "index_head_dim": di, "act_quant_block": 32})
    p = {"wq_b": {"weight": jnp.asarray(r.standard_normal((hi * di, qrank)) / 3, jnp.float32)},
         "weights_proj": {"weight": jnp.asarray(r.standard_normal((hi, d)) / 5, jnp.float32)}}
    inv_freq = rope_inv_freq(RopeSpec(160000.0, 16.0, 32, 1, 256), di)
    keys = jnp.asarray(r.standard_normal((1, s, di)), jnp.bfloat16)
    if stored:
        keys = _stored_keys(keys)[0]

    def run(t, numerics):
        x = jnp.asarray(r.standard_normal((1, t, d)), jnp.bfloat16)
        qr = jnp.asarray(r.standard_normal((1, t, qrank)), jnp.bfloat16)
        pos = jnp.arange(20, 20 + t, dtype=jnp.int32)[None]
        args = (p, cfg, x, qr, pos, keys, 1, inv_freq)
        return indexer.index_scores(*args, numerics), indexer.index_scores(*args, Numerics.reference())
    return run


def _assert_close_with_the_same_mask(got, want):
    finite = np.isfinite(np.asarray(want))
    assert np.array_equal(np.isfinite(np.asarray(got)), finite)
    assert _rel(np.where(finite, got, 0), np.where(finite, want, 0)) < TOL


def test_model_routes_prefill_scores_to_the_kernel_and_decode_to_xla():
    """Numerics.kernels="indexer=interpret" without the decode kernel: a 64-query prefill chunk scores in
    the kernel, a decode step (T = 1) and exact numerics on XLA; the scores agree to fp32 summation order
    (TOL) and the mask."""
    from deepinfer_jax.model.numerics import Numerics

    run, calls = _model_scores(2), []
    with pytest.MonkeyPatch.context() as mp:
        import pallas_kernels.indexer.kernel as kernel_module

        real = kernel_module.index_scores_pallas
        mp.setattr(kernel_module, "index_scores_pallas", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        wired = Numerics(kernels="indexer=interpret", decode_index_kernel=False)
        got, want = run(64, wired)
        assert calls == [1]
        _assert_close_with_the_same_mask(got, want)
        got1, want1 = run(1, wired)
        assert calls == [1] and np.array_equal(np.asarray(got1), np.asarray(want1))   # decode: XLA


def test_model_routes_decode_scores_to_the_decode_kernel_when_asked():
    """Numerics.decode_index_kernel (on by default since session 35): a decode step's scores on the
    decode kernel (interpreter), within fp32 summation order of XLA's and with the same mask; asked for
    heads it cannot take (2: not a multiple of 8), the error says why."""
    from deepinfer_jax.model.numerics import Numerics

    assert Numerics().decode_index_kernel
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        import pallas_kernels.indexer.decode as decode_module

        real = decode_module.index_scores_decode_pallas
        mp.setattr(decode_module, "index_scores_decode_pallas", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        wired = Numerics(kernels="indexer=interpret", decode_index_kernel=True)
        got, want = _model_scores(8)(1, wired)
        assert calls == [1]
        _assert_close_with_the_same_mask(got, want)
        # Numerics.decode_index_tiles picks the streamed form: the same bits
        streamed, _ = _model_scores(8)(1, dataclasses.replace(wired, decode_index_tiles=2))
        assert calls == [1, 1] and np.array_equal(np.asarray(streamed), np.asarray(got))
        from pallas_kernels.registry import KernelUnavailableError

        with pytest.raises(KernelUnavailableError, match="multiple of 8"):
            _model_scores(2)(1, wired)
        assert calls == [1, 1]


def test_decode_kernel_in_gpu_interpreter_matches_reference_and_is_batch_invariant():
    """``indexer.decode`` (one query a batch row, keys on the wgmma M side): the reference's scores to
    fp32 summation order (TOL) at 8, 32 and 64 heads, a ragged last key tile, -inf at keys past a row's
    visible count, a row's scores bitwise alone and in a batch; no races; CUDA lowering at the
    V4.1 decode shape (B = 64, 4,160 keys)."""
    from pallas_kernels.indexer.decode import decode_unsupported_reason, index_scores_decode_pallas

    for h in (8, 32, 64):
        q, k, w = _inputs(10 + h, 3, 1, h, 600)
        with gpu_interpreter(detect_races=True):
            got = np.asarray(jax.block_until_ready(index_scores_decode_pallas(q[:, 0], k, w[:, 0],
                                                                              jnp.asarray([600, 300, 10]))))
        assert not races_found()
        want = np.asarray(index_scores_reference(q, k, w))[:, 0]
        for row, n in enumerate((600, 300, 10)):
            assert _rel(got[row, :n], want[row, :n]) < TOL, (h, row)
            assert np.all(np.isneginf(got[row, n:])), (h, row)   # in computed tiles and in skipped ones
    q, k, w = _inputs(20, 3, 1, 8, 300)
    with gpu_interpreter():
        batched = np.asarray(index_scores_decode_pallas(q[:, 0], k, w[:, 0]))
        alone = np.asarray(index_scores_decode_pallas(q[2:, 0], k[2:], w[2:, 0]))
    assert np.array_equal(batched[2:], alone)
    assert "head_dim=64" in decode_unsupported_reason(32, 64) and "heads" in decode_unsupported_reason(12, 128)
    args = (jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64, 4160, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.int32))
    lowered = jax.jit(index_scores_decode_pallas).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_streamed_decode_forms_give_the_one_tile_forms_bits():
    """``DecodeIndexConfig(tiles > 1)`` (a producer warpgroup streaming key tiles through a ring to two
    consumers): bit for bit the one-tile form's scores, with whole tiles past a row's count skipped, a
    CTA's last tiles past S, a single visible tile, and a row with none; no races; the shape checks; CUDA
    lowering at the V4.1 decode shape."""
    from pallas_kernels.indexer.config import DecodeIndexConfig
    from pallas_kernels.indexer.decode import index_scores_decode_pallas

    q, k, w = _inputs(30, 4, 1, 8, 1280)
    n_vis = jnp.asarray([1280, 700, 10, 0], jnp.int32)
    with gpu_interpreter(detect_races=True):
        want = np.asarray(index_scores_decode_pallas(q[:, 0], k, w[:, 0], n_vis))
        for cfg in (DecodeIndexConfig(tiles=2), DecodeIndexConfig(tiles=3, stages=2),
                    DecodeIndexConfig(tiles=4, stages=3, tile_keys=128)):
            got = np.asarray(jax.block_until_ready(index_scores_decode_pallas(q[:, 0], k, w[:, 0], n_vis, config=cfg)))
            assert np.array_equal(got, want), cfg
    assert not races_found()
    assert np.all(np.isneginf(want[3])) and np.all(np.isneginf(want[2, 10:])) and np.isfinite(want[2, :10]).all()
    for bad in (dict(tiles=5), dict(tiles=0), dict(stages=1), dict(tile_keys=64), dict(tiles=1, tile_keys=128)):
        with pytest.raises(ValueError, match="DecodeIndexConfig"):
            DecodeIndexConfig(**bad)
    args = (jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64, 4352, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.int32))
    lowered = jax.jit(lambda *a: index_scores_decode_pallas(*a, config=DecodeIndexConfig(tiles=4))).trace(
        *args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_decode_form_specs_parse_to_their_configs():
    """The benchmarks' --forms: 'tiles[x tile_keys[x stages]]'."""
    from pallas_kernels.indexer.config import DecodeIndexConfig

    assert DecodeIndexConfig.parse("1") == DecodeIndexConfig()
    assert DecodeIndexConfig.parse("4x128x3") == DecodeIndexConfig(tiles=4, stages=3, tile_keys=128)
    assert DecodeIndexConfig.parse("2x256") == DecodeIndexConfig(tiles=2)
    with pytest.raises(ValueError, match="DecodeIndexConfig"):
        DecodeIndexConfig.parse("5")


def _stored_keys(k_bsd):
    """Keys -> the index cache as stored (packed E2M1 + E8M0, ``kv_codec.INDEX_K``) and its decoded bf16 keys."""
    from deepinfer_jax.model import kv_codec

    stored = kv_codec.encode(kv_codec.INDEX_K, jnp.asarray(k_bsd, jnp.float32), True, jnp.bfloat16)
    return stored, kv_codec.decode(kv_codec.INDEX_K, stored, jnp.bfloat16)


def test_fp4_decode_kernel_reads_the_stored_cache_as_the_decoded_keys():
    """``indexer.decode_fp4`` (the index cache as stored, decoded tile by tile in shared memory): the
    reference's scores over ``kv_codec.decode``'s keys to fp32 summation order (TOL) at 8 and 32 heads,
    with a ragged last tile, an all-zero key, -inf past each row's visible count and in skipped tiles; a
    row's bits alone and in a batch; no races; the shape checks; CUDA lowering at the V4.1 decode shape."""
    from pallas_kernels.indexer.decode_fp4 import index_scores_decode_fp4_pallas

    for h in (8, 32):
        q, k, w = _inputs(40 + h, 3, 1, h, 600)
        k = k.at[0, 5].set(0.0)     # an all-zero key: its scale is E8M0's smallest, its score 0 x w
        stored, k_dec = _stored_keys(k)
        n_vis = jnp.asarray([600, 300, 10])
        with gpu_interpreter(detect_races=True):
            got = np.asarray(jax.block_until_ready(index_scores_decode_fp4_pallas(
                q[:, 0], stored["values"], stored["scale"], w[:, 0], n_vis)))
        assert not races_found()
        want = np.asarray(index_scores_reference(q, k_dec, w))[:, 0]
        for row, n in enumerate((600, 300, 10)):
            assert _rel(got[row, :n], want[row, :n]) < TOL, (h, row)
            assert np.all(np.isneginf(got[row, n:])), (h, row)
        assert got[0, 5] == 0.0
    with gpu_interpreter():
        alone = np.asarray(index_scores_decode_fp4_pallas(q[2:, 0], stored["values"][2:], stored["scale"][2:],
                                                          w[2:, 0], n_vis[2:]))
    assert np.array_equal(got[2:], alone)
    with pytest.raises(ValueError, match="must be"):
        index_scores_decode_fp4_pallas(q[:, 0], stored["values"][:, :, :32], stored["scale"], w[:, 0])
    args = (jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64, 4352, 64), jnp.uint8),
            jax.ShapeDtypeStruct((64, 4352, 4), jnp.float8_e8m0fnu), jax.ShapeDtypeStruct((64, 32), jnp.float32),
            jax.ShapeDtypeStruct((64,), jnp.int32))
    lowered = jax.jit(index_scores_decode_fp4_pallas).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_fp4_decode_kernels_scale_is_exact_for_every_e8m0_byte():
    """The kernel's scale 2^(e - 127) from the byte's bits: ml_dtypes' E8M0 value for every byte (0: the
    float32 subnormal 2^-127; 255: NaN)."""
    from pallas_kernels.indexer.decode_fp4 import _e8m0_to_f32

    e = np.arange(256, dtype=np.uint8)
    got = np.asarray(_e8m0_to_f32(jnp.asarray(e)))
    want = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(e), jnp.float8_e8m0fnu).astype(jnp.float32))
    assert np.array_equal(got[:255].view(np.uint32), want[:255].view(np.uint32)) and np.isnan(got[255])
    assert got[0] == 2.0 ** -127 and got[254] == 2.0 ** 127


def test_model_routes_decode_scores_to_the_fp4_kernel_when_asked():
    """Numerics.decode_index_fp4 (on by default since session 36) with the index cache as stored: a decode
    step's scores on the FP4 kernel (interpreter), within fp32 summation order of the reference numerics' over the decoded keys
    and with the same mask; off, the same stored cache is decoded for the bf16 kernel; prefill chunks
    and exact numerics decode it too."""
    from deepinfer_jax.model.numerics import Numerics

    assert Numerics().decode_index_fp4
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        import pallas_kernels.indexer.decode_fp4 as fp4_module

        real = fp4_module.index_scores_decode_fp4_pallas
        mp.setattr(fp4_module, "index_scores_decode_fp4_pallas", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        wired = Numerics(kernels="indexer=interpret", decode_index_kernel=True, decode_index_fp4=True)
        got, want = _model_scores(8, stored=True)(1, wired)
        assert calls == [1]
        _assert_close_with_the_same_mask(got, want)
        bf16_kernel, _ = _model_scores(8, stored=True)(1, dataclasses.replace(wired, decode_index_fp4=False))
        assert calls == [1]
        _assert_close_with_the_same_mask(bf16_kernel, want)
        _model_scores(8, stored=True)(64, wired)
        assert calls == [1]
