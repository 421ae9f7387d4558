"""Dense FP8 linears on the grouped GEMM kernel (``pallas_kernels.grouped_gemm.dense``,
``deepinfer_jax.model.dense_fp8``, ``Numerics.dense_kernel``).

* the K-split layout made at load gives back the checkpoint's exact weights (bitwise);
* the kernel (Mosaic GPU interpreter) in both operand forms against a float64 product of the same
  operands, and a row's bits unchanged by the other rows and by M (which picks the row tile);
* the model: prepared weights on the XLA route (the CPU, prefill programs) keep every logit's bits; the
  kernel route in ``quant_linear`` and attention's ``wo_a`` matches the XLA route within float32
  summation order; ``for_program`` turns "decode" on in decode programs only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from deepinfer_jax.model import dense_fp8
from deepinfer_jax.model.linear import dequant_fp8, dequantize_dense_fp8, quant_linear
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp8
from deepinfer_jax.sharding import tree_paths
from pallas_kernels.grouped_gemm import dense


def _fp8_linear(key, g: int, n: int, k: int):
    """Random E4M3 weights [G, N, K] and E8M0 block scales [G, N/32, K/32] (bytes 117..121: 2^-10..2^-6)."""
    kw, ks = jax.random.split(key)
    w = jnp.clip(jax.random.normal(kw, (g, n, k)) * 64.0, -448, 448).astype(jnp.float8_e4m3fn)
    s = jax.random.randint(ks, (g, n // 32, k // 32), 117, 122).astype(jnp.uint8)
    return w, jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("g,n,k,splits", [(1, 256, 512, 1), (1, 128, 1024, 4), (2, 64, 256, 2)])
def test_split_layout_gives_back_the_exact_weights(g, n, k, splits):
    w, s = _fp8_linear(jax.random.key(g * n + k), g, n, k)
    p = dense.split_weights(w, s, splits)
    assert p.weight.shape == (g * splits, n, k // splits) and p.scale_kn.shape == (g * splits, k // 32 // splits, n)
    assert p.shape == (g, n, k)
    want = dequant_fp8(w, s).astype(jnp.bfloat16)
    assert np.array_equal(_bits(dense.dequantized(p)), _bits(want))


def test_split_rule_depends_on_the_shape_only():
    """At least MIN_ITEMS (N tile, piece) work items, whole 128-column steps per piece."""
    assert dense.MIN_ITEMS == 72
    assert dense.split_for(32768, 1280) == 1               # wq_b: 256 N tiles already
    assert dense.split_for(5120, 8192) == 2                # wo_b: 40 N tiles
    assert dense.split_for(4608, 5120) == 2                # the shared w13: 36 N tiles
    assert dense.split_for(1024, 4096, groups=8) == 2      # wo_a: 8 linears of 8 N tiles
    assert dense.split_for(512, 5120) == 8                 # wkv: 4 N tiles; 5120 = 8 x 640 (5 steps)
    assert dense.split_for(5120, 2304) == 2                # shared w2: 4 pieces of 576 are no whole steps
    assert all(5120 % (dense.split_for(n, 5120) * 128) == 0 for n in (512, 1280, 2304))


def _x(m: int, g: int, k: int, seed: int = 1) -> jax.Array:
    """Activation rows as the model's quantizer leaves them (FP8 per 1 x 32, bf16)."""
    return fake_quant_fp8(jax.random.normal(jax.random.key(seed), (m, g, k)), 32).astype(jnp.bfloat16)


@pytest.mark.parametrize("form", ["e4m3", "bf16"])
@pytest.mark.parametrize("g,n,k,splits", [(1, 256, 512, 2), (2, 128, 256, 1)])
def test_kernel_in_gpu_interpreter_matches_float64_and_keeps_row_bits(form, g, n, k, splits):
    """Same products as the float64 oracle (exact in float32), float32 sums: the difference is summation
    order, ~K x 2^-24 of the largest output at most (K <= 512: < 3e-5; measured ~7e-8). Row 0's bits do
    not change when every other row does and M moves from 5 rows (16-row tiles) to 40 (64-row tiles)."""
    from pallas_kernels.interpret import gpu_interpreter

    w, s = _fp8_linear(jax.random.key(3), g, n, k)
    p = dense.split_weights(w, s, splits)
    w64 = np.asarray(dequant_fp8(w, s), np.float64)
    x = _x(40, g, k)
    x_other = x.at[1:].set(-x[1:])
    got = {}
    for name, xm in (("few", x[:5]), ("many", x_other)):
        cfg = dense.dense_config(xm.shape[0], form, block_k=64, a_from_registers=False)
        with gpu_interpreter():
            y = dense.dense_fp8_matmul(xm, p, config=cfg)
        assert y.shape == (xm.shape[0], g, n) and y.dtype == jnp.float32
        want = np.einsum("mgk,gnk->mgn", np.asarray(xm, np.float64), w64)
        assert np.max(np.abs(np.asarray(y, np.float64) - want)) <= 3e-5 * np.max(np.abs(want))
        got[name] = y
    assert dense.dense_config(5, form).block_m != dense.dense_config(40, form).block_m
    assert np.array_equal(_bits(got["few"][0]), _bits(got["many"][0]))
    if form == "e4m3":     # x given as E4M3 rows (the model's act_quant_rows): the same rows, the same bits
        from pallas_kernels.grouped_gemm.fp8_operands import E4m3Rows, e4m3_rows

        r = e4m3_rows(x_other.reshape(40 * g, k))
        rows = E4m3Rows(r.values.reshape(40, g, k), r.scale.reshape(40, g, k // 32))
        with gpu_interpreter():
            y = dense.dense_fp8_matmul(rows, p, config=dense.dense_config(40, form, block_k=64, a_from_registers=False))
        assert np.array_equal(_bits(y), _bits(got["many"]))


def test_act_quant_rows_is_the_two_step_form_bit_for_bit():
    """``act_quant_rows`` (one pass) = ``e4m3_rows(fake_quant_fp8(x))`` (the quantizer, then the kernel
    rows re-derived from its output): values and scales, for 32- and 128-wide quantizer blocks, over
    magnitudes from 1e-9 (under the quantizer's amax floor) to 1e4, zero blocks, and blocks whose
    quantized maximum sits on a binade edge (224, 448), where the re-derived scale halves."""
    from deepinfer_jax.model.linear import act_quant_rows
    from deepinfer_jax.model.numerics import fit_block
    from pallas_kernels.grouped_gemm.fp8_operands import e4m3_rows

    rng = np.random.default_rng(0)
    for trial in range(60):
        k, block = int(rng.choice([32, 128, 256, 512])), int(rng.choice([32, 128]))
        x = rng.standard_normal((int(rng.integers(1, 6)), k)) * 10.0 ** rng.uniform(-9, 4)
        if trial % 3 == 0:
            x[:, :32] = 0.0
        if trial % 4 == 0:
            x[0, :32] = rng.choice([224.0, 448.0, -224.0, 0.0], 32) * 2.0 ** int(rng.integers(-10, 10))
        x = jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)
        got = jax.jit(act_quant_rows, static_argnums=1)(x, block)
        want = e4m3_rows(fake_quant_fp8(x, fit_block(k, block)))
        assert np.array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8)), trial
        assert np.array_equal(np.asarray(got.scale), np.asarray(want.scale)), trial


def _linear_params(n: int, k: int, groups: int = 1, seed: int = 0) -> dict:
    w, s = _fp8_linear(jax.random.key(seed), groups, n, k)
    return {"weight": w.reshape(groups * n, k), "scale": s.reshape(groups * n // 32, k // 32)}


@pytest.mark.parametrize("form", ["bf16", "e4m3"])
def test_quant_linear_kernel_route_matches_the_xla_route(form, monkeypatch):
    """quant_linear on prepared weights: with dense_kernel off (or the kernel not here) bitwise the held-
    bf16 path; on the kernel in the interpreter, in either operand form (``DENSE_OPERANDS``; E4M3 rows
    from ``act_quant_rows``), within float32 summation order of it."""
    monkeypatch.setattr(dense_fp8, "DENSE_OPERANDS", form)
    p = {"lin": _linear_params(256, 512)}
    prepared = dense_fp8.prepare_dense_fp8(p, cfg=None)
    assert dense_fp8.is_prepared(prepared["lin"]) and prepared["lin"][dense_fp8.KERNEL_FP8].splits == 4
    held = dequantize_dense_fp8(p)
    x = jax.random.normal(jax.random.key(5), (3, 2, 512)).astype(jnp.bfloat16)
    nq = Numerics.reference()
    want = quant_linear(x, held["lin"], nq, jnp.float32, act_block=32)
    for numerics in (nq, dataclasses.replace(nq, dense_kernel="on"), dataclasses.replace(nq, dense_kernel="decode")):
        got = quant_linear(x, prepared["lin"], numerics, jnp.float32, act_block=32)
        assert np.array_equal(_bits(got), _bits(want)), numerics.dense_kernel
    on = dataclasses.replace(nq, dense_kernel="on", kernels="dense=interpret")
    assert dense_fp8.kernel_impl(prepared["lin"], on, 6, form) == "interpret"
    got = quant_linear(x, prepared["lin"], on, jnp.float32, act_block=32)
    assert got.shape == want.shape
    # both: exact products summed in float32 over K = 512 (the XLA dot's order vs 4 pieces of 128 + 3 adds)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=3e-5 * float(jnp.max(jnp.abs(want))))


def test_grouped_wo_a_kernel_route_matches_the_einsum():
    """attention's wo_a (o_groups linears on their own slices of o): the bf16 operand form (o has no
    quantizer) against the model's grouped einsum on the same dequantized weights."""
    from pallas_kernels.interpret import gpu_interpreter  # noqa: F401 - the interpreter must import here

    g, n, k = 2, 128, 256

    class Cfg:
        o_groups = g

    p = dense_fp8.prepare_dense_fp8({"wo_a": _linear_params(n, k, groups=g, seed=2)}, Cfg)["wo_a"]
    assert p[dense_fp8.KERNEL_FP8].groups == g
    o = jax.random.normal(jax.random.key(6), (7, g, k)).astype(jnp.bfloat16)
    on = dataclasses.replace(Numerics.reference(), dense_kernel="on", kernels="dense=interpret")
    impl = dense_fp8.kernel_impl(p, on, 7, "bf16")
    assert impl == "interpret"
    got = dense_fp8.kernel_matmul(o, p, impl, "bf16")
    w = dense_fp8.held_weight(p, jnp.bfloat16).reshape(g, n, k)
    want = jnp.einsum("mgi,gri->mgr", o, w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=3e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_prepared_tiny_model_keeps_its_logits_bits(tiny_params, tiny_cfg, tiny_token_map):
    """The held layout on the tiny model (its linears are narrower than the kernel's tiles, so prepared
    here with 32-wide tiles: the layout, not the kernel): every dense FP8 linear, attention's grouped
    wo_a included, rebuilt inside the step gives the logits of the held-bf16 engine bit for bit, with
    dense_kernel off and on (the kernel cannot take them: XLA's dots)."""
    from test_model_consistency import _prompts, run_chunks

    prepared = dequantize_dense_fp8(dense_fp8.prepare_dense_fp8(tiny_params, tiny_cfg, block_n=32, block_k=32))
    n_prepared = sum(isinstance(leaf, dense.DenseFp8Weights)
                     for leaf in jax.tree.leaves(prepared, is_leaf=lambda x: isinstance(x, dense.DenseFp8Weights)))
    assert n_prepared >= 4 * tiny_cfg.num_hidden_layers
    assert dense_fp8.is_prepared(prepared["layers"][0]["attn"]["wo_a"])
    shared = [path for path, _ in tree_paths(prepared) if "shared_experts" in path]
    assert shared and all("w13" in path and "w1" not in path and "w3" not in path
                          for path in shared if path[path.index("shared_experts") + 1] != "w2")
    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    nq = Numerics.reference()
    want = run_chunks(dequantize_dense_fp8(tiny_params), tiny_cfg, tiny_token_map, prompts, 7, nq)
    for numerics in (nq, dataclasses.replace(nq, dense_kernel="on")):
        got = run_chunks(prepared, tiny_cfg, tiny_token_map, prompts, 7, numerics)
        assert np.array_equal(got, want), numerics.dense_kernel


def test_prepare_holds_only_the_selected_linears(tiny_params, tiny_cfg, tiny_token_map):
    """``linears=`` (``Numerics.dense_kernel_linears``): only the named linears are held for the kernel,
    every other stays a bf16 copy for XLA's dots, and the logits keep their bits; unknown names are
    refused where they are given."""
    from test_model_consistency import _prompts, run_chunks

    chosen = ("wo_a", "wo_b", "shared.w13")
    prepared = dense_fp8.prepare_dense_fp8(tiny_params, tiny_cfg, block_n=32, block_k=32, linears=chosen)
    k = dense_fp8.KERNEL_FP8
    held = {dense_fp8.linear_name(path[:path.index(k)]) for path, _ in tree_paths(prepared) if k in path}
    assert held == set(chosen)
    layer = prepared["layers"][0]
    assert dense_fp8.is_prepared(layer["attn"]["wo_a"]) and not dense_fp8.is_prepared(layer["attn"]["wq_b"])
    prompts = _prompts(tiny_cfg, 2, [14, 9], seed=7)
    nq = dataclasses.replace(Numerics.reference(), dense_kernel="on", dense_kernel_linears=chosen)
    want = run_chunks(dequantize_dense_fp8(tiny_params), tiny_cfg, tiny_token_map, prompts, 7, Numerics.reference())
    assert np.array_equal(run_chunks(dequantize_dense_fp8(prepared), tiny_cfg, tiny_token_map, prompts, 7, nq), want)
    with pytest.raises(ValueError, match="unknown"):
        dense_fp8.prepare_dense_fp8(tiny_params, tiny_cfg, linears=("wo_c",))
    with pytest.raises(ValueError, match="unknown"):
        Numerics(dense_kernel_linears=("w13",))
    with pytest.raises(ValueError, match="tuple"):
        Numerics(dense_kernel_linears="wo_a")
    # the benchmarks' command-line form
    assert dense_fp8.parse_linear_names("wo_a,wo_b,shared.w13") == chosen
    assert dense_fp8.parse_linear_names("all") is None
    with pytest.raises(ValueError, match="unknown"):
        dense_fp8.parse_linear_names("wo_a,w13")


def test_shared_expert_pair_on_one_launch_matches_two_linears():
    """A shared expert's w1 and w3 held as one linear ("w13"): XLA's route gives two quant_linear
    calls' bits; the kernel (interpreter) one launch within float32 summation order of them."""
    from deepinfer_jax.model.linear import quant_linear_pair

    p = {"shared_experts": {"w1": _linear_params(128, 512, seed=3), "w3": _linear_params(128, 512, seed=4),
                            "w2": _linear_params(512, 128, seed=5)}}
    prepared = dense_fp8.prepare_dense_fp8(p, cfg=None)["shared_experts"]
    assert set(prepared) == {"w13", "w2"} and prepared["w13"][dense_fp8.KERNEL_FP8].shape == (1, 256, 512)
    held = dequantize_dense_fp8(p)["shared_experts"]
    x = jax.random.normal(jax.random.key(8), (5, 512)).astype(jnp.bfloat16)
    nq = Numerics.reference()
    want = [quant_linear(x, held[name], nq, jnp.float32, act_block=32) for name in ("w1", "w3")]
    got = quant_linear_pair(x, prepared["w13"], nq, jnp.float32, act_block=32)
    assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(got, want))
    on = dataclasses.replace(nq, dense_kernel="on", kernels="dense=interpret")
    got = quant_linear_pair(x, prepared["w13"], on, jnp.float32, act_block=32)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=3e-5 * float(jnp.max(jnp.abs(b))))


def test_dense_kernel_modes_per_program():
    nq = dataclasses.replace(Numerics.reference(), dense_kernel="decode")
    assert nq.for_program("decode").dense_kernel == "on"
    assert nq.for_program("prefill").dense_kernel == "off"
    # the default since the 12-layer H200 A/B (session 28): decode programs, three linears
    assert Numerics.reference().dense_kernel == "decode"
    assert Numerics.reference().dense_kernel_linears == ("wo_a", "wo_b", "shared.w13")
    on = dataclasses.replace(nq, dense_kernel="on")
    assert on.for_program("prefill").dense_kernel == "on"
    with pytest.raises(ValueError, match="dense_kernel"):
        Numerics(dense_kernel="always")
    assert Numerics(kernels="dense=xla").kernel_mode("dense") == "xla"


def test_bf16_output_dense_is_one_dot_with_the_f32_forms_bits_on_the_cpu():
    """``Numerics.dense_bf16_out``: bf16 operands to a bf16 result are one dot asking for bf16 (no f32
    result, no convert); off, an f32 dot and a convert. Both forms at the model's kinds of shapes give
    the same bits on the CPU, as benchmarks/bf16_out_dot_gpu.py found on the H100 (its check is the
    GPU's); the default (None) is the f32 form off the GPU."""
    from deepinfer_jax.model.linear import dense

    on = dataclasses.replace(Numerics.reference(), dense_bf16_out=True)
    off = dataclasses.replace(Numerics.reference(), dense_bf16_out=False)
    assert not Numerics.reference().bf16_out_dense()          # the CPU's default
    rng = np.random.default_rng(3)
    for m, n, k in ((1, 64, 512), (37, 96, 1280), (300, 256, 2304)):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
        eqns = {name: jax.make_jaxpr(lambda a, b, nq=nq: dense(a, b, nq, jnp.bfloat16))(x, w).eqns
                for name, nq in (("on", on), ("off", off))}
        assert [e.primitive.name for e in eqns["on"]] == ["dot_general"]
        assert eqns["on"][0].params["preferred_element_type"] == jnp.bfloat16
        assert [e.primitive.name for e in eqns["off"]][-1] == "convert_element_type"
        got, want = (np.asarray(jax.jit(lambda a, b, nq=nq: dense(a, b, nq, jnp.bfloat16))(x, w)).view(np.uint16)
                     for nq in (on, off))
        assert np.array_equal(got, want), (m, n, k)
    # f32 results and f32 weights keep the f32 dot
    x32 = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    assert dense(x32, x32[:8], on).dtype == jnp.float32


def test_grouped_bf16_output_dense_is_one_dot_with_the_f32_forms_bits_on_the_cpu():
    """Attention's grouped wo_a (``linear.grouped_dense``) follows ``Numerics.dense_bf16_out`` as ``dense``
    does: on, one dot asking for bf16; off (the CPU default), an f32 dot and a convert; the same bits on
    the CPU at a decode and a prefill-like row count (the GPU's check: bf16_out_dot_gpu.py's wo_a rows)."""
    from deepinfer_jax.model.linear import grouped_dense

    on = dataclasses.replace(Numerics.reference(), dense_bf16_out=True)
    off = dataclasses.replace(Numerics.reference(), dense_bf16_out=False)
    rng = np.random.default_rng(4)
    for b, t, g, r, i in ((2, 1, 4, 32, 128), (1, 200, 2, 64, 256)):
        x = jnp.asarray(rng.standard_normal((b, t, g, i)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((g, r, i)) / np.sqrt(i), jnp.bfloat16)
        eqns = {name: jax.make_jaxpr(lambda a, c, nq=nq: grouped_dense(a, c, nq, jnp.bfloat16))(x, w).eqns
                for name, nq in (("on", on), ("off", off))}
        # (einsum puts the group batch dimension first, then transposes it back)
        assert [e.primitive.name for e in eqns["on"]] == ["dot_general", "transpose"]
        assert eqns["on"][0].params["preferred_element_type"] == jnp.bfloat16
        assert [e.primitive.name for e in eqns["off"]][-1] == "convert_element_type"
        got, want = (np.asarray(jax.jit(lambda a, c, nq=nq: grouped_dense(a, c, nq, jnp.bfloat16))(x, w))
                     for nq in (on, off))
        assert got.shape == (b, t, g, r) and np.array_equal(got.view(np.uint16), want.view(np.uint16)), (b, t)
    x32 = jnp.asarray(rng.standard_normal((1, 2, 2, 16)), jnp.float32)
    assert grouped_dense(x32, x32[0, :, :, :].transpose(1, 0, 2)[:, :3], on, jnp.float32).dtype == jnp.float32
