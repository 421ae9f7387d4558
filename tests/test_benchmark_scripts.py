"""Every script in benchmarks/ at least compiles: most of them only run on the GPU machine, where a
syntax error costs a device call (session 17 lost one to an indentation error in e2e_gpu.py)."""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_plot_takes_each_decode_cell_from_the_last_run_that_has_it():
    """The README plot's merge rule: a later run's row replaces an earlier run's of the same batch and
    context, whether it sits in that run's "decode" section or in its "(partial)" one (session 21's
    B=256 row sat under "(partial)" and lost to an older "decode" row before the rule was per run)."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    from plot_e2e import latest_decode_rows

    def row(batch, ms):
        return {"batch": batch, "context": 4096, "ms_per_step": ms}

    merged = {"note": "", "run_a": {"sections": {"decode": [row(64, 30.0), row(256, 80.0)]}},
              "run_b": {"sections": {"kernels-decode (partial)": [row(256, 44.0)]}},
              "run_c": {"sections": {"decode": [row(64, 23.4)], "kernels-decode (partial)": [row(16, 11.5)]}}}
    got = {r["batch"]: r["ms_per_step"] for r in latest_decode_rows(merged)}
    assert got == {64: 23.4, 256: 44.0, 16: 11.5}


def test_plot_share_uses_the_bytes_the_step_own_routing_read_where_counted():
    """A run with an experts section (e2e_gpu.py --sections experts) is annotated with the share of its
    own routing's bytes; other rows keep the uniform-routing bytes."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    from plot_e2e import copy_share, latest_decode_rows

    def row(batch, ms, total):
        return {"batch": batch, "context": 4096, "ms_per_step": ms, "bytes": {"total": total}}

    merged = {"run_a": {"sections": {"decode": [row(16, 10.0, 2e10), row(64, 20.0, 6e10)]}},
              "run_b": {"sections": {"decode": [row(64, 18.0, 6e10)],
                                     "experts": {"batch": 64, "context": 4096, "total_bytes_own_routing": 5e10}}}}
    shares = {r["batch"]: copy_share(r, 4e12) for r in latest_decode_rows(merged)}
    assert shares[64] == pytest.approx(5e10 / 18e-3 / 4e12)
    assert shares[16] == pytest.approx(2e10 / 10e-3 / 4e12)


def test_timeline_names_no_site_for_another_programs_kernel():
    """e2e_gpu.py's timeline: a kernel of another program ("name @program") gets no site from the step's
    HLO dump, whose fusion names it repeats; the step's own kernels keep theirs."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    from e2e_gpu import _site_of

    sites = {"input_reduce_fusion_14": "layer11/moe/routed/reduce_max", "loop_select_fusion": "layer0/moe/take"}
    assert _site_of("input_reduce_fusion_14", sites) == "layer11/moe/routed/reduce_max"
    assert _site_of("input_reduce_fusion_14 @jit_top_p_keep", sites) == ""
    assert _site_of("loop_select_fusion_3", sites) == "layer0/moe/take"      # a suffixed launch name


def test_bf16_out_dot_script_checks_bits_on_the_cpu(tmp_path):
    """``bf16_out_dot_gpu.py --tiny``: XLA:CPU's bf16-output dot is bitwise its float32 dot + convert
    (checked there in session 24 at larger shapes), so the script's own check finds 0 differing values
    and writes a row per shape and row count."""
    import json
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    import bf16_out_dot_gpu

    assert bf16_out_dot_gpu.main(["--tiny", "--tokens", "8,40", "--reps", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bf16_out_dot_gpu.json").read_text())["rows"]
    assert len(rows) == 4 and {r["tokens"] for r in rows} == {8, 40}
    assert all(r["values_differ"] == 0 for r in rows), rows


def test_pcandsort_sort_form_is_the_bisection_mask(monkeypatch):
    """e2e_gpu's ``pcandsort`` A/B swaps the candidate pool's bisection mask for the sort form it
    replaced (``sorted_top_mask``); both must give the same blocks, or the A/B times two models."""
    import numpy as np
    import jax.numpy as jnp

    from pallas_kernels.topk.select import top_mask

    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import e2e_gpu

    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (2, 5, 40)).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = -np.inf
    x[rng.random(x.shape) < 0.1] = -0.0
    x[:, :, 7] = np.inf
    for k in (1, 6, 40, 50):
        got = np.asarray(e2e_gpu.sorted_top_mask(jnp.asarray(x), k))
        assert np.array_equal(got, np.asarray(top_mask(jnp.asarray(x), k))), k
        assert got.any()


def test_e2e_script_refuses_an_unknown_section(capsys, monkeypatch):
    """A misspelt --sections name stops the run with the known names, instead of running nothing."""
    monkeypatch.syspath_prepend(str(SCRIPTS[0].parent))
    import e2e_gpu

    with pytest.raises(SystemExit):
        e2e_gpu.main(["--tiny", "--sections", "ceil,prefil"])
    err = capsys.readouterr().err
    assert "prefil" in err and "prefill" in err
    assert set(e2e_gpu.SECTIONS) >= {"ceil", "decode", "prefill", "gatherattn", "pattn"}


def test_matmul_macs_refuse_the_dense_kernels_load_time_form():
    """e2e_gpu.py's prefill TFLOP/s once came from params after ``prepare_dense_fp8``, whose renamed
    linears went uncounted (a 12-layer slice: 4.34e9 MACs a token instead of 5.53e9, H200 2026-12-06);
    the count now takes the stored layout and refuses the other."""
    import sys

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(SCRIPTS[0].parent))    # benchmarks/ (the other tests' imports may not have run)
    from slice_model import matmul_macs_per_token

    class Cfg:
        num_experts_per_tok = 2

    experts = {n: {"weight": jax.ShapeDtypeStruct((4, 8, 16), jnp.bfloat16)} for n in ("w1", "w2", "w3")}
    layer = {"attn": {"wo_a": {"weight": jax.ShapeDtypeStruct((32, 64), jnp.float8_e4m3fn)}},
             "ffn": {"experts": experts}}
    stored = {"head": {"weight": jax.ShapeDtypeStruct((100, 64), jnp.bfloat16)}, "layers": [layer]}
    assert matmul_macs_per_token(Cfg, stored) == 100 * 64 + 32 * 64 + 2 * 3 * 8 * 16
    held = {**layer, "attn": {"wo_a": {"kernel_fp8": {"w": jax.ShapeDtypeStruct((32, 64), jnp.float8_e4m3fn)}}}}
    with pytest.raises(ValueError, match="kernel_fp8"):
        matmul_macs_per_token(Cfg, {**stored, "layers": [held]})


def test_hlo_sites_counts_named_bytes_in_nested_branches():
    """hlo_sites --bytes: a launch's result plus its distinct operands at their shapes, in the entry and
    in conditional branches nested in branches (marked), never in fused computations."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    import hlo_sites

    hlo = """HloModule m

%fused_add (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %a = f32[4,8]{1,0} add(%p, %p)
}

%inner_true (t: (f32[4,8])) -> u32[4] {
  %t = (f32[4,8]{1,0}) parameter(0)
  ROOT %r = u32[4]{0} fusion(%t), kind=kInput, calls=%fused_add, metadata={op_name="jit(f)/layer2/idx/cond/branch_1_fun/cond/reduce"}
}

%branch_a (b: (f32[4,8])) -> u32[4] {
  %b = (f32[4,8]{1,0}) parameter(0)
  %pred = pred[] fusion(%b), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/layer2/idx/cond/branch_1_fun/gt"}
  ROOT %c = u32[4]{0} conditional(%pred, %b, %b), true_computation=%inner_true, false_computation=%inner_true
}

ENTRY %main (x: f32[4,8], i: s32[]) -> u32[4] {
  %x = f32[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %y = bf16[4,8]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/layer2/mlp/convert"}
  %tup = (f32[4,8]{1,0}) tuple(%x)
  ROOT %s = u32[4]{0} conditional(%i, %tup, %tup), branch_computations={%branch_a, %branch_a}
}
"""
    assert hlo_sites.shape_bytes("(f32[4,8]{1,0}, f8e4m3fn[2]{0}, pred[])") == 128 + 2 + 1
    rows = hlo_sites.launch_bytes(hlo)
    assert ("fusion", "jit(f)/layer2/mlp/convert", 64 + 128, False) in rows   # bf16 result + x once
    assert ("fusion", "jit(f)/layer2/idx/cond/branch_1_fun/cond/reduce", 16 + 128, True) in rows
    assert ("fusion", "jit(f)/layer2/idx/cond/branch_1_fun/gt", 1 + 128, True) in rows
    assert not any("fused_add" in name for _, name, _, _ in rows) and len(rows) == 3
    # --list: the entry's launches in order with their result and operand shapes (branches not entered)
    assert hlo_sites.launch_listing(hlo) == [("fusion", "jit(f)/layer2/mlp/convert", "bf16[4,8]{1,0}", ["f32[4,8]{1,0}"])]


@pytest.mark.slow
def test_indexer_decode_script_checks_pass_on_the_cpu(tmp_path):
    """``indexer_gpu.py --decode`` with its kernels in the Mosaic GPU interpreter (B = 2, 256 keys): every
    form's checks pass (the one-tile form, a streamed form with the same bits, the FP4 form over the
    cache as stored), so the script a device call runs has no error of its own; a row per form, heads
    and key count."""
    import json
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    import indexer_gpu

    assert indexer_gpu.main(["--decode", "--batch", "2", "--keys", "256", "--decode-forms", "1,2x128x2,fp4",
                             "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "indexer_gpu_decode.json").read_text())
    assert {(r["form"], r["heads"]) for r in res["rows"]} == {(f, h) for f in ("1", "2x128x2", "fp4") for h in (32, 64)}
    assert res["checks"]["heads32"]["form_2x128x2_same_bits"] and res["checks"]["fp4_heads64"]["batch_invariant"]
