"""The model's attention core, routed experts and indexer top-k behind the kernel registry (``Numerics.kernels``).

* on the CPU the default (``auto``) takes the model's own XLA code, bit for bit;
* ``ops`` (the pallas_kernels ops' XLA fallbacks) and ``interpret`` (the Mosaic GPU kernels in the GPU
  interpreter) agree with it within the roundings the kernels add, for one attention layer core and one
  MoE layer at shapes the kernels run (head_dim 128, expert dims 128);
* a whole tiny-model forward through the ops path equals the model path in fp32 (this checks the
  window/compressed index plumbing of every layer role);
* forcing a kernel where it cannot run raises instead of falling back;
* the indexer top-k is the registry's op: an implementation registered for the platform (the reference
  here, as a CANN operator would be on ``npu``) serves the model and gives its logits bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import deepinfer_jax.model.moe as moe_module
from deepinfer_jax.model import kv_codec
from deepinfer_jax.model.attention import attention_core, sink_attention, sparse_inputs
from deepinfer_jax.model.moe import moe, routed_experts, routed_experts_gather, route
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp4_e4m3, fake_quant_fp8, kernel_route
from pallas_kernels import registry
from pallas_kernels.registry import KernelUnavailableError

_FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _mode(mode: str, base: Numerics = Numerics.reference()) -> Numerics:
    return Numerics(base.act_dtype, base.fake_quant, base.kv_quant, mode)


# ---- the switch itself --------------------------------------------------------------------------------

def test_kernel_modes_parse_validate_and_hash():
    n = Numerics(kernels="attention=interpret, experts=ops")
    assert (n.kernel_mode("attention"), n.kernel_mode("experts")) == ("interpret", "ops")
    assert Numerics(kernels="xla").kernel_mode("experts") == "xla"
    assert Numerics().kernel_mode("attention") == "auto"
    assert hash(Numerics.fast()) != hash(Numerics.reference()) and Numerics.fast().kernels == "ops"
    assert Numerics.named("fast") == Numerics.fast() and Numerics.named("exact") == Numerics.exact()
    for bad in ("cuda", "attention=fast", "mlp=xla"):
        with pytest.raises(ValueError, match="Numerics.kernels"):
            Numerics(kernels=bad)
    with pytest.raises(ValueError, match="unknown numerics"):
        Numerics.named("fp64")


def test_cpu_routes():
    assert kernel_route(Numerics(), "attention", "sparse_sink_attention", None) == ("model", None)
    assert kernel_route(_mode("xla"), "experts", "grouped_matmul", None) == ("model", None)
    assert kernel_route(_mode("ops"), "attention", "sparse_sink_attention", None) == ("op", "xla")
    assert kernel_route(_mode("interpret"), "experts", "grouped_matmul", None) == ("op", "interpret")
    with pytest.raises(KernelUnavailableError, match="pallas_mosaic_gpu"):
        kernel_route(_mode("pallas"), "attention", "sparse_sink_attention", None)
    with pytest.raises(KernelUnavailableError, match="multiple of 128"):
        kernel_route(_mode("interpret"), "attention", "sparse_sink_attention", "head_dim=64 must be a multiple of 128")


# ---- one attention layer's core -------------------------------------------------------------------------

def _attention_inputs(rng, b, t, h, d, w, n, k):
    """A layer's core inputs as attention() builds them: FP8-grid window keys (ring + chunk) with the
    window mask, the FP4 compressed cache as stored, and a top-k selection with -1 entries."""
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    win = fake_quant_fp8(jnp.asarray(rng.standard_normal((b, w + t, d)), jnp.float32)).astype(jnp.bfloat16)
    mask = rng.random((b, t, w + t)) < 0.7
    mask &= np.cumsum(mask, axis=-1) <= w        # a query sees at most W keys, as window_keys' masks
    mask = jnp.asarray(mask).at[0, 0].set(False)  # (0, 0): window empty
    comp = kv_codec.encode(kv_codec.COMPRESSED, fake_quant_fp4_e4m3(
        jnp.asarray(rng.standard_normal((b, n, d)) * 2, jnp.float32)), True, jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, n, (b, t, k)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    return q, win, mask, comp, idx, sink


def _kv_max(win, comp):
    return max(float(jnp.max(jnp.abs(win.astype(jnp.float32)))),
               float(jnp.max(jnp.abs(kv_codec.decode(kv_codec.COMPRESSED, comp, jnp.float32)))))


# The ops path and the kernel round p to bf16 for p.kv and round o to bf16 (each <= 2^-9 relative), and
# |o| <= max|kv| (a convex combination shrunk by the sink): 4 bf16 half-ulps of max|kv| bound their
# distance from the float32 model path after its own bf16 cast (as in tests/test_attention_kernel.py).
def _attn_tol(win, comp):
    return 4 * 2.0 ** -9 * _kv_max(win, comp)


def test_sparse_inputs_equal_the_model_path_in_float32():
    """The single-kv problem built for the op is the same attention (reference op, fp32) as the model's."""
    from pallas_kernels.attention import sparse_sink_attention_reference

    rng = np.random.default_rng(0)
    q, win, mask, comp, idx, sink = _attention_inputs(rng, 2, 3, 4, 64, 8, 10, 4)
    want = sink_attention(q, win, mask, comp, idx, sink, 0.125, jax.lax.Precision.HIGHEST)
    kv, ids = sparse_inputs(win, mask, comp, idx, jnp.float32, window=8)
    assert ids.shape == (2, 3, 8 + 4)          # the window part compacted to W columns (window_index)
    got = sparse_sink_attention_reference(q, kv, ids, sink, 0.125)
    # Both float32 at HIGHEST over the same 15 rows; only the summation order differs.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(got[0, 0]))) > 0.1     # the window-less query attends its compressed rows


def test_window_index_lists_every_visible_key_in_order():
    """window_index compacts each query's visible columns into W slots (-1 after), for the masks
    window_keys makes (a ring in slot order, stale slots, a chunk longer than the window) and random
    ones with at most W per query; nothing visible is dropped."""
    from deepinfer_jax.model.window import window_index, window_keys

    rng = np.random.default_rng(3)
    w, t, b = 8, 21, 3
    pos = np.stack([np.arange(30, 30 + t), np.arange(5, 5 + t), np.r_[np.arange(40, 40 + t - 4), [-1] * 4]])
    ring_pos = np.stack([np.arange(22, 30)[np.argsort(np.arange(22, 30) % w)],        # slot = pos mod W
                         np.r_[np.arange(0, 5), [-1] * 3], np.arange(50, 58)])        # 3rd: stale slots
    _, mask = window_keys(jnp.zeros((b, w, 4)), jnp.asarray(ring_pos), jnp.zeros((b, t, 4)), jnp.asarray(pos), w)
    rnd = rng.random((b, t, w + t)) < 0.5
    rnd &= np.cumsum(rnd, axis=-1) <= w
    for m in (np.asarray(mask), rnd):
        got = np.asarray(window_index(jnp.asarray(m), w))
        assert got.shape == (b, t, w)
        for bi in range(b):
            for ti in range(t):
                cols = np.flatnonzero(m[bi, ti])
                assert np.array_equal(got[bi, ti], np.r_[cols, [-1] * (w - cols.size)]), (bi, ti)
    assert np.asarray(mask).sum(-1).max() == w     # the realistic masks do fill the window


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_chunk_window_index_is_the_masks_window_index():
    """chunk_window_index (the kernel routes' window columns, no [B, T, W+T] mask) equals window_index of
    window_keys' mask for chunks as the engine makes them (one run of consecutive positions, anywhere in
    the chunk, or none), decode rows, windows narrower than the ring, and rings with empty, stale and
    wrapped slots."""
    from deepinfer_jax.model.window import chunk_window_index, window_index, window_keys

    rng = np.random.default_rng(5)
    for _ in range(200):
        b, t = int(rng.integers(1, 4)), int(rng.choice([1, 2, 5, 16, 40]))
        w = int(rng.choice([4, 8, 16]))
        window = int(rng.integers(1, w + 1))
        pos, ring_pos = np.full((b, t), -1, np.int32), np.full((b, w), -1, np.int32)
        for i in range(b):
            n, start = int(rng.integers(0, t + 1)), int(rng.integers(0, 60))
            t0 = int(rng.integers(0, t - n + 1)) if rng.random() < 0.3 else 0
            pos[i, t0:t0 + n] = np.arange(start, start + n)
            top = start + int(rng.integers(-3, 5))                # some slots at or past the chunk: stale
            for p_ in range(max(0, top - w - 3), top):
                if rng.random() < 0.8:
                    ring_pos[i, p_ % w] = p_
        _, mask = window_keys(jnp.zeros((b, w, 1)), jnp.asarray(ring_pos), jnp.zeros((b, t, 1)), jnp.asarray(pos),
                              window)
        want = np.asarray(window_index(mask, w))
        got = np.asarray(chunk_window_index(jnp.asarray(ring_pos), jnp.asarray(pos), window, w))
        assert np.array_equal(got, want), (pos, ring_pos, window)


def test_attention_auto_is_bitwise_the_model_path_and_ops_is_close():
    rng = np.random.default_rng(1)
    args = _attention_inputs(rng, 2, 3, 4, 64, 8, 10, 4)
    xla = attention_core(*args, 0.125, _mode("xla"))
    auto = attention_core(*args, 0.125, Numerics.reference())
    assert np.array_equal(np.asarray(auto), np.asarray(xla))
    ops = attention_core(*args, 0.125, _mode("ops"))
    assert ops.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ops, np.float32), np.asarray(xla.astype(jnp.bfloat16), np.float32),
                               rtol=0, atol=_attn_tol(args[1], args[3]))


def test_attention_layer_core_in_gpu_interpreter():
    """head_dim 128 (the kernel needs a multiple of 128), 4 heads, window 8 + chunk 2, 6 compressed
    entries, top-4: the Mosaic GPU kernel in the interpreter vs the ops path and the model path."""
    rng = np.random.default_rng(2)
    args = _attention_inputs(rng, 1, 2, 4, 128, 8, 6, 4)
    scale = 128 ** -0.5
    got = jax.jit(lambda *a: attention_core(*a, scale, _mode("interpret")))(*args)
    ops = attention_core(*args, scale, _mode("ops"))
    xla = attention_core(*args, scale, _mode("xla"))
    tol = _attn_tol(args[1], args[3])
    # Same roundings as the ops path, another summation order: a couple of output ulps apart.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ops, np.float32), rtol=0, atol=tol / 2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla.astype(jnp.bfloat16), np.float32),
                               rtol=0, atol=tol)
    assert float(jnp.max(jnp.abs(xla))) > 10 * tol      # not a comparison of two near-zero outputs


def test_gathered_rows_give_the_decoded_caches_bits_in_the_gpu_interpreter():
    """``attention_fp4_rows="gather"``'s inputs (each query's selected rows decoded, in selection order)
    against the whole decoded cache's (``sparse_inputs``): the Mosaic GPU kernel, in the interpreter,
    returns the same bits from both, since every query meets the same rows in the same order."""
    from deepinfer_jax.model.attention import gathered_inputs, sparse_inputs
    from deepinfer_jax.model.window import window_index
    from pallas_kernels.attention.config import BLOCK_ROWS, SparseAttentionConfig
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas
    from pallas_kernels.interpret import gpu_interpreter

    rng = np.random.default_rng(9)
    q, win, mask, comp, idx, sink = _attention_inputs(rng, 1, 2, 4, 128, 8, 6, 4)
    win_idx = window_index(mask, 8)
    whole = sparse_inputs(win, mask, comp, idx, jnp.bfloat16, window=8, win_idx_btw=win_idx)
    sel = gathered_inputs(win, win_idx, comp, idx, jnp.bfloat16)
    assert sel[0].shape[1] == win.shape[1] + 2 * 4 and sel[1].shape == whole[1].shape
    config = SparseAttentionConfig(split_rows=-(-whole[1].shape[-1] // BLOCK_ROWS) * BLOCK_ROWS)
    with gpu_interpreter():
        a, b = (sparse_sink_attention_pallas(q, kv, ix, sink, 128 ** -0.5, config) for kv, ix in (whole, sel))
    bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))   # noqa: E731
    assert np.array_equal(bits(a), bits(b))
    assert float(jnp.max(jnp.abs(a.astype(jnp.float32)))) > 0


def test_attention_fp4_rows_and_split_pick_the_kernel_form(monkeypatch):
    """Numerics.attention_fp4_rows / attention_split_rows where the Mosaic kernel would run (simulated:
    the route is forced to it and the two ops record their call, then run their XLA fallback): "always"
    calls the FP4 variant on the stored cache, "never" the bf16 op on the decoded cache, each with the
    configured split; both give the model path's attention within the kernel tolerance. Off the kernel
    route (the CPU's own choice) "never" changes nothing: the selected rows are read either way."""
    import deepinfer_jax.model.attention as attention_module
    from pallas_kernels import attention as pk_attn
    from pallas_kernels.registry import PALLAS_MOSAIC_GPU

    rng = np.random.default_rng(5)
    args = _attention_inputs(rng, 1, 2, 4, 128, 8, 6, 4)
    scale = 128 ** -0.5
    base = _mode("ops")
    ops_out = attention_core(*args, scale, base)
    never = Numerics(base.act_dtype, base.fake_quant, base.kv_quant, base.kernels, attention_fp4_rows="never")
    assert np.array_equal(np.asarray(attention_core(*args, scale, never)), np.asarray(ops_out))

    calls, schedules = [], []
    for name in ("sparse_sink_attention", "sparse_sink_attention_fp4"):
        real = getattr(pk_attn, name)

        def record(*a, _real=real, _name=name, config, impl, **kw):
            calls.append((_name, impl, config.split_rows, a[1].shape))
            schedules.append(config.schedule)
            return _real(*a, config=config, impl="xla", **kw)
        monkeypatch.setattr(pk_attn, name, record)
    monkeypatch.setattr(attention_module, "_route", lambda *a: ("op", PALLAS_MOSAIC_GPU))
    xla = attention_core(*args, scale, _mode("xla"))
    tol = _attn_tol(args[1], args[3])
    outs = {}
    for rows, split in (("always", 320), ("never", 640), ("decode", 128), ("gather", 640)):
        calls.clear()
        numerics = dataclasses.replace(base, attention_fp4_rows=rows, attention_split_rows=split)
        got = outs[rows] = attention_core(*args, scale, numerics)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla.astype(jnp.bfloat16), np.float32),
                                   rtol=0, atol=tol)
        op = "sparse_sink_attention" if rows in ("never", "gather") else "sparse_sink_attention_fp4"
        # + the decoded cache ("never") or each query's decoded selection ("gather": T * K rows)
        extra = {"never": args[3]["values"].shape[1], "gather": args[4].shape[1] * args[4].shape[2]}.get(rows, 0)
        assert calls == [(op, PALLAS_MOSAIC_GPU, split, (1, args[1].shape[1] + extra, 128))]
    # the gathered rows are the decoded cache's, met in the same order: the same bits
    assert np.array_equal(np.asarray(outs["gather"], np.float32), np.asarray(outs["never"], np.float32))
    # Numerics.attention_schedule reaches the bf16 kernel's config; the FP4 variant keeps "halves"
    for rows, schedule, want in (("never", "seesaw", "seesaw"), ("always", "seesaw", "halves"),
                                 ("never", "seesaw-prefill", "halves")):
        schedules.clear()
        numerics = dataclasses.replace(base, attention_fp4_rows=rows, attention_split_rows=640,
                                       attention_schedule=schedule)
        attention_core(*args, scale, numerics)
        assert schedules == [want], (rows, schedule)


def test_attention_numerics_per_program_and_validation():
    nq = dataclasses.replace(Numerics.reference(), attention_fp4_rows="decode", attention_prefill_split_rows=640)
    dec, pre = nq.for_program("decode"), nq.for_program("prefill")
    assert (dec.attention_fp4_rows, dec.attention_split_rows) == ("always", 320)
    assert (pre.attention_fp4_rows, pre.attention_split_rows) == ("never", 640)
    default = Numerics.reference()     # the defaults: the same as nq above
    assert (default.attention_fp4_rows, default.attention_split_rows, default.attention_prefill_split_rows) == \
        ("decode", 320, 640)
    assert default.for_program("prefill") == pre and default.for_program("decode") == dec
    gather = dataclasses.replace(nq, attention_fp4_rows="gather-decode")
    assert (gather.for_program("decode").attention_fp4_rows, gather.for_program("prefill").attention_fp4_rows) == \
        ("gather", "never")
    same = dataclasses.replace(default, attention_prefill_split_rows=0, attention_schedule="halves")
    assert same.for_program("prefill").attention_split_rows == same.attention_split_rows == 320
    seesaw = default     # "seesaw-prefill" by default (the decode split 320 is 5 blocks)
    assert seesaw.attention_schedule == "seesaw-prefill"
    assert seesaw.for_program("prefill").kernel_attention_schedule() == "seesaw"
    assert seesaw.for_program("decode").kernel_attention_schedule() == "halves"
    assert seesaw.kernel_attention_schedule() == "halves"    # outside the engine's programs
    with pytest.raises(ValueError, match="multiple of 128"):    # the prefill split must hold whole pairs
        dataclasses.replace(default, attention_prefill_split_rows=0)
    for bad in (dict(attention_fp4_rows="prefill"), dict(attention_split_rows=0), dict(attention_split_rows=100),
                dict(attention_prefill_split_rows=-64), dict(attention_prefill_split_rows=96),
                dict(attention_schedule="pairs"), dict(attention_schedule="seesaw"),
                dict(attention_schedule="seesaw-prefill", attention_prefill_split_rows=320)):
        with pytest.raises(ValueError, match="attention_"):
            dataclasses.replace(Numerics.reference(), **bad)


# ---- one MoE layer --------------------------------------------------------------------------------------

def _moe_layer(rng, d, inter, e):
    """Random MoE params in the checkpoint's formats: packed FP4 routed experts with E8M0 1x32 scales
    near 2^-4 (outputs O(1)), bf16 gate and shared expert."""
    def fp4(n, k):
        return {"weight": jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8),
                "scale": jnp.asarray(rng.integers(120, 124, (e, n, k // 32)), jnp.uint8).view(jnp.float8_e8m0fnu)}

    def bf16(n, k):
        return {"weight": jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)}

    return {"gate": {"weight": jnp.asarray(rng.standard_normal((e, d)), jnp.bfloat16),
                     "bias": jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32)},
            "experts": {"w1": fp4(inter, d), "w3": fp4(inter, d), "w2": fp4(d, inter)},
            "shared_experts": {"w1": bf16(inter, d), "w3": bf16(inter, d), "w2": bf16(d, inter)}}


def _dequant(p_lin):
    b = np.asarray(p_lin["weight"])
    vals = np.empty(b.shape[:-1] + (b.shape[-1] * 2,))
    vals[..., 0::2] = _FP4[b & 15]
    vals[..., 1::2] = _FP4[b >> 4]
    return vals * np.repeat(2.0 ** (np.asarray(p_lin["scale"].view(jnp.uint8), np.float64) - 127), 32, axis=-1)


def _routed_tol(p_exp, x, ids, w, limit):
    """Per-element bound on two implementations' distance for routed_experts without fake quantization.

    Both compute the same exact bf16 products in float32; the sums differ in order only (f32 ulps), and
    that can flip a bf16 rounding by one bf16 ulp (<= 2^-7 of the value) wherever the model rounds: g and
    u (the GEMMs' results, ``Numerics.expert_out_dtype``), the hidden activation, and y. A flip of g moves
    h by |silu'(g)| |u| 2^-7 |g| (0 where the clamp holds g), of u by |silu(g)| 2^-7 |u|, of h by 2^-7 |h|;
    those move y[d] by at most sum_i |dh_i| |w2[d, i]|, and y's own flip adds 2^-7 |y|. float64 here."""
    xs = np.asarray(x, np.float64)
    ids = np.asarray(ids)
    w1, w3, w2 = (_dequant(p_exp[n]) for n in ("w1", "w3", "w2"))
    g = np.einsum("md,mkid->mki", xs, w1[ids])
    u = np.einsum("md,mkid->mki", xs, w3[ids])
    gc, uc = np.minimum(g, limit), np.clip(u, -limit, limit)
    sig = 1 / (1 + np.exp(-gc))
    rw = np.asarray(w, np.float64)[..., None]
    hid = gc * sig * uc * rw
    d_g = np.where(g < limit, np.abs(sig * (1 + gc * (1 - sig))) * np.abs(uc) * np.abs(g), 0.0)
    d_u = np.where(np.abs(u) < limit, np.abs(gc * sig) * np.abs(u), 0.0)
    d_hid = 2.0 ** -7 * ((d_g + d_u) * np.abs(rw) + np.abs(hid))
    y = np.einsum("mki,mkdi->mkd", hid, w2[ids])
    return (np.einsum("mki,mkdi->mkd", d_hid, np.abs(w2[ids])) + 2.0 ** -7 * np.abs(y)) * 1.01 + 1e-6


def test_experts_auto_is_bitwise_the_gather_path_and_ops_is_close(tiny_cfg):
    rng = np.random.default_rng(3)
    p = _moe_layer(rng, 64, 32, 8)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.bfloat16)
    ids, w = route(p["gate"], tiny_cfg, x, 2)
    nq = Numerics("bfloat16", False, False)
    base = routed_experts_gather(p["experts"], x, ids, w, 10.0, nq, 32)
    auto = routed_experts(p["experts"], x, ids, w, 10.0, nq, 32)
    assert np.array_equal(np.asarray(auto), np.asarray(base))
    ops = routed_experts(p["experts"], x, ids, w, 10.0, _mode("ops", nq), 32)
    assert np.all(np.abs(np.asarray(ops) - np.asarray(base)) <= _routed_tol(p["experts"], x, ids, w, 10.0))
    # fp32 activations: the op takes bf16 only, so ops mode keeps the gather path; forcing the kernel raises.
    x32 = x.astype(jnp.float32)
    e32 = Numerics.exact()
    assert np.array_equal(np.asarray(routed_experts(p["experts"], x32, ids, w, 10.0, _mode("ops", e32), 32)),
                          np.asarray(routed_experts_gather(p["experts"], x32, ids, w, 10.0, e32, 32)))
    with pytest.raises(KernelUnavailableError, match="bf16"):
        routed_experts(p["experts"], x32, ids, w, 10.0, _mode("interpret", e32), 32)


# A hang here (see the comment below) blocks in C, where the default signal timeout cannot interrupt it.
@pytest.mark.timeout(300, method="thread")
def test_moe_layer_in_gpu_interpreter(tiny_cfg):
    """A whole MoE layer (router, 8 FP4 experts of 128 x 128, top-2, shared expert, rank-order combine)
    with the routed GEMMs in the Mosaic GPU kernel (interpreter) vs the ops path and the gather path."""
    rng = np.random.default_rng(4)
    p = _moe_layer(rng, 128, 128, 8)
    x = jnp.asarray(rng.standard_normal((1, 5, 128)), jnp.bfloat16)
    nq = Numerics("bfloat16", False, False)
    ids, w = jax.block_until_ready(route(p["gate"], tiny_cfg, x.reshape(5, 128), 2))
    # Each interpreter run is one blocking jitted call with nothing else in flight: the interpreter runs
    # its warpgroups as computations launched from a host callback, and with other work queued on the
    # CPU client's few threads (2 cores, -n 2) that starved and hung on 2026-12-02 and 2026-12-04.
    tiled_calls = []
    with pytest.MonkeyPatch.context() as mp:   # count the shared-plan path, so the bitwise check below is real
        real = moe_module._routed_experts_tiled
        mp.setattr(moe_module, "_routed_experts_tiled", lambda *a: tiled_calls.append(1) or real(*a))
        got_routed = jax.block_until_ready(jax.jit(
            lambda xm: routed_experts(p["experts"], xm, ids, w, 10.0, _mode("interpret", nq), 32))(x.reshape(5, 128)))
        # the swiglu on every padded row instead of the routed ones (here 128 padded rows for 10 routed)
        mp.setattr(moe_module, "ROUTED_SWIGLU_PADDING", 1e9)
        got_padded = jax.block_until_ready(jax.jit(
            lambda xm: routed_experts(p["experts"], xm, ids, w, 10.0, _mode("interpret", nq), 32))(x.reshape(5, 128)))
    assert tiled_calls == [1, 1]
    # One tile plan for w1, w3 and w2 gives each row the bits of a plan per GEMM, either swiglu form.
    per_gemm = jax.block_until_ready(jax.jit(lambda xm: moe_module.routed_experts_grouped(
        p["experts"], xm, ids, w, 10.0, nq, 32, "interpret", tiled=False))(x.reshape(5, 128)))
    assert np.array_equal(np.asarray(got_routed), np.asarray(per_gemm))
    assert np.array_equal(np.asarray(got_padded), np.asarray(per_gemm))
    # ... also with the FP8 activation quantizer in front of w2 (per row and 32-column block)
    nq8 = Numerics("bfloat16", True, False)
    tiled8 = jax.jit(lambda xm: moe_module.routed_experts_grouped(p["experts"], xm, ids, w, 10.0, nq8, 32,
                                                                  "interpret"))(x.reshape(5, 128))
    per_gemm8 = jax.jit(lambda xm: moe_module.routed_experts_grouped(p["experts"], xm, ids, w, 10.0, nq8, 32,
                                                                     "interpret", tiled=False))(x.reshape(5, 128))
    assert np.array_equal(np.asarray(tiled8), np.asarray(per_gemm8))
    assert not np.array_equal(np.asarray(tiled8), np.asarray(per_gemm))   # the quantizer did something
    ops_routed = routed_experts(p["experts"], x.reshape(5, 128), ids, w, 10.0, _mode("ops", nq), 32)
    gather = routed_experts_gather(p["experts"], x.reshape(5, 128), ids, w, 10.0, nq, 32)
    tol = _routed_tol(p["experts"], x.reshape(5, 128), ids, w, 10.0)
    assert np.all(np.abs(np.asarray(got_routed) - np.asarray(ops_routed)) <= tol)
    assert np.all(np.abs(np.asarray(got_routed) - np.asarray(gather)) <= tol)
    assert float(np.abs(np.asarray(gather)).max()) > 20 * float(tol.max())   # a real comparison
    # The layer as the model calls it: y = shared + routed in rank order, rounded to bf16 once (the
    # routed tolerance, plus one bf16 half-ulp of the output for the final rounding).
    y_int = jax.block_until_ready(jax.jit(lambda xb: moe(p, tiny_cfg, xb, _mode("interpret", nq), top_k=2))(x))
    y_ref = moe(p, tiny_cfg, x, nq, top_k=2)
    y_tol = tol.sum(axis=1).reshape(1, 5, 128) + 2.0 ** -8 * np.abs(np.asarray(y_ref, np.float32))
    assert np.all(np.abs(np.asarray(y_int, np.float32) - np.asarray(y_ref, np.float32)) <= y_tol)


def test_w1_and_w3_in_one_launch_change_no_bits(tiny_cfg):
    """``Numerics.expert_w13_launch`` (default): the shared-plan path runs w1 and w3 as one kernel launch
    (two launches then w2's one, counted), with the bits of their two launches (interpreter)."""
    import dataclasses

    from pallas_kernels.grouped_gemm import kernel as gg_kernel

    rng = np.random.default_rng(6)
    p = _moe_layer(rng, 128, 128, 8)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    nq = Numerics("bfloat16", False, False)
    assert nq.expert_w13_launch
    ids, w = jax.block_until_ready(route(p["gate"], tiny_cfg, x, 2))
    launches = {}
    outs = {}
    for one_launch in (True, False):
        calls = launches[one_launch] = []
        with pytest.MonkeyPatch.context() as mp:
            real = gg_kernel.grouped_matmul_tiles
            mp.setattr(gg_kernel, "grouped_matmul_tiles",
                       lambda *a, **kw: calls.append(len(kw.get("more", ()))) or real(*a, **kw))
            num = dataclasses.replace(nq, expert_w13_launch=one_launch)
            outs[one_launch] = jax.block_until_ready(jax.jit(lambda xm: moe_module.routed_experts_grouped(
                p["experts"], xm, ids, w, 10.0, num, 32, "interpret"))(x))
    assert launches == {True: [1, 0], False: [0, 0, 0]}
    assert np.array_equal(np.asarray(outs[True]), np.asarray(outs[False]))


@pytest.mark.timeout(300, method="thread")
def test_swiglu_epilogue_changes_no_bits_in_gpu_interpreter(tiny_cfg):
    """``Numerics.expert_swiglu_epilogue`` (default on): where the swiglu runs on tile-order rows (few padding
    rows) and the config has 128 weight rows a consumer (the 256-row tile-major layout), w1, w3 and the
    swiglu are one ``swiglu_tiles`` launch, with the bits of the w1/w3 launch and XLA's swiglu in the
    interpreter; mostly-padding calls (decode) keep the routed-row swiglu."""
    import dataclasses

    from pallas_kernels.grouped_gemm import kernel as gg_kernel

    rng = np.random.default_rng(12)
    p = _moe_layer(rng, 256, 256, 4)
    experts = moe_module.prepare_experts_tile_major(moe_module.prepare_expert_scales(p))["experts"]
    nq = Numerics("bfloat16", False, False)
    assert nq.expert_swiglu_epilogue
    outs, calls = {}, {}
    for tokens in (64, 5):      # 128 routed rows in 11 tiles of 16 (1.4x), and 10 in 4 tiles (mostly padding)
        x = jnp.asarray(rng.standard_normal((tokens, 256)), jnp.bfloat16)
        ids, w = jax.block_until_ready(route(p["gate"], tiny_cfg, x, 2))
        for on in (True, False):
            seen = calls[tokens, on] = []
            with pytest.MonkeyPatch.context() as mp:
                real = gg_kernel.swiglu_tiles
                mp.setattr(gg_kernel, "swiglu_tiles", lambda *a, **kw: seen.append(1) or real(*a, **kw))
                num = dataclasses.replace(nq, expert_swiglu_epilogue=on)
                outs[tokens, on] = np.asarray(jax.block_until_ready(jax.jit(
                    lambda xm, ids=ids, w=w, num=num: moe_module.routed_experts_grouped(
                        experts, xm, ids, w, 10.0, num, 32, "interpret"))(x)))
        assert np.array_equal(outs[tokens, True], outs[tokens, False]), tokens
        assert float(np.abs(outs[tokens, True]).max()) > 0.1
    assert calls == {(64, True): [1], (64, False): [], (5, True): [], (5, False): []}


@pytest.mark.timeout(300, method="thread")
def test_swiglu_quantizer_in_the_epilogue_changes_no_bits_in_gpu_interpreter(tiny_cfg, monkeypatch):
    """``Numerics.expert_swiglu_quant`` (on by default since session 35): with 64-row tiles (the form needs
    them; the interpreter's are raised to 64 here) the epilogue launch writes w2's bf16 rows, through
    the FP8 quantizer where fake_quant is on and the bf16 rounding alone where it is off; the routed
    experts' output has the bits of the float32 epilogue + XLA's quantizer either way."""
    import dataclasses

    from pallas_kernels.grouped_gemm import kernel as gg_kernel

    monkeypatch.setattr(moe_module, "INTERPRET_BLOCK_M", 64)
    rng = np.random.default_rng(13)
    p = _moe_layer(rng, 256, 256, 4)
    experts = moe_module.prepare_experts_tile_major(moe_module.prepare_expert_scales(p))["experts"]
    x = jnp.asarray(rng.standard_normal((192, 256)), jnp.bfloat16)     # 384 routed rows: <= 1.5x padded
    ids, w = jax.block_until_ready(route(p["gate"], tiny_cfg, x, 2))
    assert Numerics.reference().expert_swiglu_quant
    for fake_quant in (True, False):
        outs, calls = {}, {}
        for on in (True, False):
            seen = calls[on] = []
            with pytest.MonkeyPatch.context() as mp:
                real = gg_kernel.swiglu_tiles
                mp.setattr(gg_kernel, "swiglu_tiles", lambda *a, **kw: seen.append(
                    (str(jnp.dtype(kw.get("out_dtype", jnp.float32))), kw.get("act_block"))) or real(*a, **kw))
                num = Numerics("bfloat16", fake_quant, False, expert_swiglu_quant=on)
                outs[on] = np.asarray(jax.block_until_ready(jax.jit(
                    lambda xm, num=num: moe_module.routed_experts_grouped(
                        experts, xm, ids, w, 10.0, num, 32, "interpret"))(x)))
        assert calls == {True: [("bfloat16", 32 if fake_quant else None)], False: [("float32", None)]}
        assert np.array_equal(outs[True], outs[False]), fake_quant
        assert float(np.abs(outs[True]).max()) > 0.1


def test_e4m3_expert_operands_in_gpu_interpreter_and_per_program(tiny_cfg):
    """``Numerics.expert_operands``: "e4m3" runs the FP4 experts' kernel on E4M3 operands (interpreter)
    within float32 rounding of the bf16 form (same products: the activations are FP8 values); the shared
    tile plan takes E4M3 rows too; "e4m3-decode" resolves per program; the act-quant block must be whole
    32-column blocks; fake_quant off is refused."""
    import dataclasses

    from deepinfer_jax.model.moe import _tile_config

    rng = np.random.default_rng(5)
    p = _moe_layer(rng, 128, 128, 8)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    nq8 = Numerics("bfloat16", True, False, expert_operands="bf16")
    e4 = dataclasses.replace(nq8, expert_operands="e4m3")
    ids, w = jax.block_until_ready(route(p["gate"], tiny_cfg, x, 2))
    run = lambda nq, tiled: jax.block_until_ready(jax.jit(lambda xm: moe_module.routed_experts_grouped(  # noqa: E731
        p["experts"], xm, ids, w, 10.0, nq, 32, "interpret", tiled=tiled))(x))
    want = np.asarray(run(nq8, True))
    got, got_per_gemm = np.asarray(run(e4, True)), np.asarray(run(e4, False))
    # Exact products summed in float32 in another grouping: float32 ulps of the partial sums in the
    # GEMMs, which may flip a bf16 rounding of g, u, a hidden activation or an output (as _routed_tol
    # bounds) -- the difference stays below 2^-7 of the largest output.
    assert np.abs(got - want).max() <= 2.0 ** -7 * np.abs(want).max()
    assert np.array_equal(got, got_per_gemm)             # one tile plan or a plan per GEMM: same bits
    assert float(np.abs(want).max()) > 0.1

    split = dataclasses.replace(nq8, expert_operands="e4m3-decode")
    assert split.for_program("decode").expert_operands == "e4m3"
    assert split.for_program("prefill").expert_operands == "bf16"
    # nothing left for for_program to resolve
    resolved = dataclasses.replace(nq8, attention_fp4_rows="always", dense_kernel="on", attention_schedule="halves")
    assert resolved.for_program("decode") is resolved
    assert Numerics.reference().expert_operands == "e4m3-decode"                    # the default
    assert Numerics.exact().for_program("decode").expert_operands == "bf16"        # no FP8 activations
    p_lin = p["experts"]["w1"]
    assert _tile_config(p_lin, 6, split.for_program("decode")).fp4_operands == "e4m3"
    assert _tile_config(p_lin, 6, split.for_program("decode"), act_block=16).fp4_operands == "bf16"
    assert _tile_config(p_lin, 6, split).fp4_operands == "bf16"        # unresolved: the bf16 form
    with pytest.raises(ValueError, match="fake_quant"):
        Numerics("bfloat16", False, False, expert_operands="e4m3")
    with pytest.raises(ValueError, match="expert_operands"):
        Numerics(expert_operands="fp8")
    with pytest.raises(ValueError, match="program kind"):
        nq8.for_program("mtp")
    # the engine compiles its decode program with the decode resolution, its prefill programs with the other
    from deepinfer_jax.engine.scheduler import _compiled_steps

    class _Model:
        split_at_replay = True
        readable = staticmethod(lambda a: a)

    prefill, upper, decode, *_ = _compiled_steps(None, split, _Model(), None, 0, 0)
    assert decode.__wrapped__.keywords["numerics"].expert_operands == "e4m3"
    assert prefill.__wrapped__.keywords["numerics"].expert_operands == "bf16"
    assert upper.__wrapped__.keywords["numerics"].expert_operands == "bf16"


@pytest.mark.timeout(300, method="thread")
def test_tile_major_expert_weights_change_no_bits(tiny_cfg):
    """prepare_experts_tile_major (the engine's default on Hopper) holds each FP4 expert linear as the
    kernel's tile-major layout: the kernel path (interpreter, its K steps reading half of each layout
    tile) gives the stored layout's bits, the gather path lays the weights back to the same bits, the
    tile config reads the layout's width, and ``donate`` consumes the input's weights."""
    from pallas_kernels.grouped_gemm.config import TILE_MAJOR_TILE

    rng = np.random.default_rng(9)
    p = _moe_layer(rng, 256, 256, 4)           # N and K multiples of the 256 x 128 layout tile
    prepared = moe_module.prepare_expert_scales(p)
    tiled = moe_module.prepare_experts_tile_major(prepared)
    for name in ("w1", "w3", "w2"):
        assert "weight" not in tiled["experts"][name] and tiled["experts"][name]["weight_tm"].ndim == 5
        assert moe_module._weight_shape(tiled["experts"][name]) == tuple(prepared["experts"][name]["weight"].shape)
    cfg = moe_module._tile_config(tiled["experts"]["w1"], 6, Numerics.reference())
    assert cfg.weights_tile_major and (cfg.block_n, 128 % cfg.block_k) == (TILE_MAJOR_TILE[0], 0)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    nq = Numerics("bfloat16", False, False)
    ids, w = jax.block_until_ready(route(p["gate"], tiny_cfg, x, 2))
    want = jax.block_until_ready(jax.jit(lambda xm: moe_module.routed_experts_grouped(
        prepared["experts"], xm, ids, w, 10.0, nq, 32, "interpret"))(x))
    got = jax.block_until_ready(jax.jit(lambda xm: moe_module.routed_experts_grouped(
        tiled["experts"], xm, ids, w, 10.0, nq, 32, "interpret"))(x))
    assert np.array_equal(np.asarray(got), np.asarray(want))
    gathered = routed_experts_gather(tiled["experts"], x, ids, w, 10.0, nq, 32)
    assert np.array_equal(np.asarray(gathered), np.asarray(routed_experts_gather(p["experts"], x, ids, w, 10.0, nq, 32)))
    moe_module.prepare_experts_tile_major(prepared, donate=True)
    assert prepared["experts"]["w1"]["weight"].is_deleted()
    # on a mesh the layout keeps the experts' split and nothing else (sharding rules by path)
    from deepinfer_jax.sharding import DEFAULT_RULES, logical_axes

    path = ("layers", 0, "ffn", "experts", "w1", "weight_tm")
    axes = logical_axes(path)
    assert axes == ("experts", "ffn", "embed", "tile_rows", "tile_bytes")
    assert tuple(DEFAULT_RULES.spec(axes, "w1"))[1:] in ((), (None,) * 4)
    assert tuple(DEFAULT_RULES.spec(axes, "w1"))[0] == tuple(DEFAULT_RULES.spec(("experts",), "e"))[0]


# ---- the whole tiny model -------------------------------------------------------------------------------

def test_tiny_model_forward_through_the_ops_path_equals_the_model_path_fp32(tiny_params, tiny_cfg, tiny_token_map):
    """fp32, every layer role (SWA, FULL ratio 2/1, REINDEX, REUSE), prefill chunks that cross the window:
    the pallas_kernels attention op fed by sparse_inputs gives the model's logits (the experts stay on the
    gather path in fp32). A wrong window/compressed index would move logits by O(1)."""
    from test_model_consistency import EXACT_ATOL, _prompts, run_chunks

    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    exact = Numerics.exact()
    want = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, exact)
    got = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, _mode("ops", exact))
    for i, pr in enumerate(prompts):
        np.testing.assert_allclose(got[i, :len(pr)], want[i, :len(pr)], atol=EXACT_ATOL, rtol=0)


@pytest.mark.slow  # two compiles of the tiny model: 65 s in CI's parallel run
def test_registered_topk_serves_the_model_with_the_same_logits(tiny_params, tiny_cfg, tiny_token_map):
    """The reference top-k, registered for this platform, is what the model's indexer runs unless
    ``indexer=xla`` pins the XLA path; the two give the same selections, so the same logits. BF16 with
    FP4 index keys: many tied scores."""
    from pallas_kernels.topk import topk_indices_reference
    from test_model_consistency import _prompts, run_chunks

    calls = []
    impl = registry.Impl("reference_here", lambda s, k: calls.append(k) or topk_indices_reference(s, k),
                         platforms=frozenset({registry.platform_name(jax.devices()[0])}))
    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    # Numerics no other test compiles, so each forward is traced here, under this registration.
    pinned, auto = _mode("indexer=xla"), _mode("indexer=ops")
    reg = registry.register_impl("topk_indices", impl)
    try:
        want = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, pinned)
        assert not calls
        got = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, auto)
    finally:
        reg.unregister()
    assert calls
    assert np.array_equal(got, want)


@pytest.mark.slow  # four compiles of the tiny model: 33 s alone, 164 s in CI's parallel run
def test_prepared_expert_scales_change_no_bits(tiny_params, tiny_cfg, tiny_token_map):
    """prepare_expert_scales (the engine does it once on Hopper) moves every routed expert's scales to the
    kernel layout; the paths that read the checkpoint layout convert back, so the logits keep their bits."""
    from deepinfer_jax.model.moe import prepare_expert_scales
    from deepinfer_jax.sharding import logical_axes, tree_paths
    from test_model_consistency import _prompts, run_chunks

    prepared = prepare_expert_scales(tiny_params)
    moved = [p for p, _ in tree_paths(prepared) if p[-1] == "scale_kn"]
    left = [p for p, _ in tree_paths(prepared) if "experts" in p and p[-1] == "scale"]
    assert moved and not left
    for path, leaf in tree_paths(prepared):
        if path[-1] == "scale_kn":
            w = prepared
            for part in path[:-1]:
                w = w[part]
            w = w["weight"]
            assert leaf.shape == (w.shape[0], w.shape[2] * 2 // 32, w.shape[1])    # packed FP4 [G, N, K/2]
            assert len(logical_axes(path, tiny_cfg)) == 3
    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    for mode in ("auto", "ops"):       # the gather path and the grouped op's XLA fallback
        nq = _mode(mode)
        want = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, nq)
        got = run_chunks(prepared, tiny_cfg, tiny_token_map, prompts, 7, nq)
        assert np.array_equal(got, want), mode


def test_fp4_scale_max_picks_the_subnormal_decoder_only_when_every_scale_allows_it(tiny_params):
    """prepare_experts_for_kernel reads the largest FP4 expert scale byte into Numerics; the kernel config
    uses the "subnormal" decoder (exact for bytes <= 128) only then, and "packed" when unknown or larger."""
    from deepinfer_jax.model.moe import _expert_linears, _tile_config, fp4_expert_scale_max, prepare_experts_for_kernel

    want = max(int(np.max(np.asarray(jax.lax.bitcast_convert_type(p["scale"], jnp.uint8))))
               for p in _expert_linears(tiny_params))
    assert fp4_expert_scale_max(tiny_params) == want
    prepared, nq = prepare_experts_for_kernel(tiny_params, Numerics.reference())
    assert nq.fp4_scale_max == want and nq == Numerics.reference().__class__(
        **{**Numerics.reference().__dict__, "fp4_scale_max": want})
    assert fp4_expert_scale_max(prepared) == want                       # kernel layout read the same
    p_lin = next(_expert_linears(prepared))
    m = 6
    assert _tile_config(p_lin, m, nq).fp4_dequant == ("subnormal" if want <= 128 else "packed")
    assert _tile_config(p_lin, m, Numerics.reference()).fp4_dequant == "packed"          # not known
    big = Numerics.reference().__class__(**{**nq.__dict__, "fp4_scale_max": 129})
    assert _tile_config(p_lin, m, big).fp4_dequant == "packed"
    assert fp4_expert_scale_max({"layers": [{"mlp": {"dense": 1}}]}) is None               # no experts


def test_dense_fp8_held_as_bf16_changes_no_bits(tiny_params, tiny_cfg, tiny_token_map):
    """dequantize_dense_fp8 (the GPU engine does it at load) holds every dense FP8 linear as its bf16
    dequantized weight; quant_linear made the same bf16 weight in each step, so the logits keep their
    bits. The routed experts and the Engram table stay as stored, and the planner's extra byte per
    converted element matches the tree."""
    from deepinfer_jax.model.linear import dequantize_dense_fp8
    from deepinfer_jax.planner import plan_memory
    from deepinfer_jax.sharding import tree_paths
    from test_model_consistency import _prompts, run_chunks

    held = dequantize_dense_fp8(tiny_params)
    before = {p: leaf for p, leaf in tree_paths(tiny_params)}
    after = {p: leaf for p, leaf in tree_paths(held)}
    converted = [p for p in before if p[-1] == "scale" and p not in after]
    assert converted, "the tiny checkpoint has dense FP8 linears"
    for p in converted:
        w = p[:-1] + ("weight",)
        assert before[w].dtype == jnp.float8_e4m3fn and after[w].dtype == jnp.bfloat16, p
        assert "experts" not in p and "embed" not in p
    kept = [p for p in before if p[-1] == "scale" and p in after]
    assert all("experts" in p or "embed" in p for p in kept)
    extra = sum(before[p[:-1] + ("weight",)].size for p in converted)
    plain = plan_memory(tiny_cfg, "data=1", 2, 64)
    with_bf16 = plan_memory(tiny_cfg, "data=1", 2, 64, dense_bf16=True)
    assert with_bf16.weight_bytes - plain.weight_bytes == extra
    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    nq = Numerics.reference()
    want = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, nq)
    got = run_chunks(held, tiny_cfg, tiny_token_map, prompts, 7, nq)
    assert np.array_equal(got, want)


def test_gpu_forms_of_mhc_run_the_tiny_model_close_to_the_cpu_forms(tiny_params, tiny_cfg, tiny_token_map):
    """What a GPU backend picks by default for mHC (the bf16 stream dot, the unrolled Sinkhorn rounds;
    here also cut into segments at 8 rows so that form runs too) against the CPU defaults. Each moves a
    mix coefficient by fp32 ulps (tests/test_modules_vs_numpy.py checks that tightly, per form); here
    the forms are checked wired into the whole model."""
    import dataclasses

    from test_model_consistency import _prompts, run_chunks

    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    cpu = Numerics.reference()
    gpu = dataclasses.replace(cpu, stream_dot_bf16=True, sinkhorn_unroll=True, sinkhorn_segment_rows=8)
    assert not (cpu.bf16_stream_dot() or cpu.unroll_sinkhorn())      # this test runs on a CPU backend
    want = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, cpu)
    got = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, gpu)
    # Through the bf16 residual stream an fp32-ulp change in a mix is a bf16 step here and there, and one
    # can flip a near-tied discrete choice (an expert in a router's top-k, an indexer's top-k) at some
    # position, which attention then carries to every later position of that prompt. On one CPU machine
    # (AMD EPYC, 2026-12-05) the bf16 stream dot did: logits moved by up to 1.7 % of their scale from the
    # first prompt's position 1 on. With the expert GEMMs' results rounded to bf16 (2026-12-08) a flip
    # at the second prompt's position 2 moved its later logits by 3-35 % there, while the first prompt's
    # 14 positions came out equal. A flip's size has no useful bound in a random tiny model, so the
    # checks are that most positions agree to bf16 noise (a mis-wired form moves every position) and the
    # argmax agrees at >= 90 % of the real positions.
    assert np.abs(want).max() > 1.0
    real = [(i, t) for i, p in enumerate(prompts) for t in range(len(p))]
    rel = np.array([np.abs(got[i, t] - want[i, t]).max() for i, t in real]) / np.abs(want).max()
    assert np.median(rel) <= 1e-2, np.round(rel, 3)
    top1_same = sum(got[i, t].argmax() == want[i, t].argmax() for i, t in real)
    assert top1_same >= 0.9 * len(real), (top1_same, len(real))


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_mhc_split_made_at_load_changes_no_bits(tiny_params, tiny_cfg, tiny_token_map):
    """mhc.prepare_stream_dots (the engine does it at load with the bf16 stream dot) holds each hc_*_fn's
    bf16 parts, which stream_dot otherwise made in every step: the GPU forms' logits keep their bits,
    the CPU's fp32 form ignores the parts, and the planner counts what is held."""
    import dataclasses

    from deepinfer_jax.model import mhc
    from deepinfer_jax.planner import plan_memory
    from deepinfer_jax.sharding import tree_paths
    from test_model_consistency import _prompts, run_chunks

    held = mhc.prepare_stream_dots(tiny_params)
    before = dict(tree_paths(tiny_params))
    added = {p: leaf for p, leaf in tree_paths(held) if p not in before}
    fns = [p for p, leaf in before.items() if mhc.is_stream_mix_fn(p[-1], leaf)]
    assert len(fns) == 2 * tiny_cfg.num_hidden_layers
    assert sorted(added) == sorted(p[:-1] + (p[-1] + mhc.SPLIT_SUFFIX,) for p in fns)
    for p in fns:
        assert np.array_equal(np.asarray(added[p[:-1] + (p[-1] + mhc.SPLIT_SUFFIX,)]),
                              np.asarray(mhc.split_bf16x3(before[p])))
    plain = plan_memory(tiny_cfg, "data=1", 2, 64)
    with_parts = plan_memory(tiny_cfg, "data=1", 2, 64, stream_dot_parts=True)
    assert with_parts.weight_bytes - plain.weight_bytes == sum(leaf.nbytes for leaf in added.values())
    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    cpu = Numerics.reference()
    gpu = dataclasses.replace(cpu, stream_dot_bf16=True, sinkhorn_unroll=True, sinkhorn_segment_rows=8)
    for nq in (gpu, cpu):
        want = run_chunks(tiny_params, tiny_cfg, tiny_token_map, prompts, 7, nq)
        got = run_chunks(held, tiny_cfg, tiny_token_map, prompts, 7, nq)
        assert np.array_equal(got, want)


def test_mhc_mixes_through_the_sinkhorn_kernel_in_gpu_interpreter():
    """mHC's Sinkhorn rounds by the Mosaic GPU kernel (the Hopper default, ``kernels`` "sinkhorn") in
    the interpreter, and by the op's XLA fallback ("ops"), against the CPU's XLA loop: the rounds'
    order of operations differs (tests/test_sinkhorn_kernel.py), so comb agrees to a few fp32 ulps and
    pre / post are the same values. (A whole tiny-model run in the interpreter needs over 24 GiB.)"""
    from deepinfer_jax.model import mhc

    assert kernel_route(Numerics(), "sinkhorn", "sinkhorn_rounds", None) == ("model", None)     # CPU: XLA
    assert kernel_route(_mode("ops"), "sinkhorn", "sinkhorn_rounds", None) == ("op", "xla")
    r = np.random.default_rng(9)
    x = jnp.asarray(r.standard_normal((2, 70, 4, 64)), jnp.bfloat16)
    fn = jnp.asarray(r.standard_normal((24, 256)) / 8, jnp.float32)
    base, scale = jnp.asarray(r.standard_normal(24), jnp.float32), jnp.asarray(r.standard_normal(3), jnp.float32)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    want = mhc.mixes(x, fn, base, scale, **kw)
    for impl in ("interpret", "xla"):
        got = mhc.mixes(x, fn, base, scale, sinkhorn_impl=impl, **kw)
        assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
        assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
        # entries in [0, 1]: 1e-6 is ~8 ulp of 1.0 (the bound tests/test_sinkhorn_kernel.py justifies)
        assert np.abs(np.asarray(got[2]) - np.asarray(want[2])).max() < 1e-6
