"""The benchmark slice (benchmarks/slice_model.py) on CPU: its random weights have exactly the params
pytree the loader builds from a real checkpoint (paths, shapes, stored dtypes), the model runs on them,
its synthetic cache holds the positions a real cache would after ``context`` tokens, and its byte
count is the sum of its parts. The H200 numbers in the README come from this code (benchmarks/e2e_gpu.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from slice_model import (decode_bytes, expected_active_experts, matmul_macs_per_token, random_params,  # noqa: E402
                         slice_config, synthetic_cache)

from deepinfer_jax.checkpoint.loader import load_params  # noqa: E402
from deepinfer_jax.model.numerics import Numerics  # noqa: E402
from deepinfer_jax.model.transformer import forward  # noqa: E402


pytestmark = pytest.mark.slow  # ~90 s: the Engram token map and a jit per weight shape on CPU


def _layout(tree):
    return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in jax.tree.flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def tiny_slice():
    cfg = slice_config(12, tiny_widths=True)
    return cfg, random_params(cfg)


def test_random_params_have_the_loaders_layout(tiny_slice, tiny_ckpt):
    cfg, params = tiny_slice
    ref = load_params(tiny_ckpt, progress=False)
    assert _layout(params) == _layout(ref)


def test_the_model_runs_on_random_params_with_finite_logits(tiny_slice):
    cfg, params = tiny_slice
    num = Numerics.reference()
    cache = synthetic_cache(cfg, 2, 64, 20, num)
    rows = jnp.zeros((2, 1, len(cfg.engram_layer_ids), cfg.engram_columns), jnp.int32)
    logits, _ = jax.jit(forward, static_argnums=(1, 6))(params, cfg, cache, jnp.array([[5], [7]]),
                                                          jnp.array([[20], [20]]), rows, num)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_synthetic_cache_rings_hold_the_last_window(tiny_slice):
    cfg, _ = tiny_slice
    w = cfg.sliding_window
    cache = synthetic_cache(cfg, 3, 64, 21, Numerics.reference())
    pos = np.asarray(cache["window"][0]["pos"])
    want = np.arange(21 - w, 21)
    assert sorted(pos[1].tolist()) == want.tolist()
    assert all(pos[1][p % w] == p for p in want)  # slot = position mod W, as window.py writes it
    short = np.asarray(synthetic_cache(cfg, 1, 64, 3, Numerics.reference())["window"][0]["pos"])[0]
    assert sorted(short.tolist()) == [-1] * (w - 3) + [0, 1, 2]


def test_decode_bytes_add_up(tiny_slice):
    cfg, params = tiny_slice
    one, many = decode_bytes(cfg, params, 1, 40), decode_bytes(cfg, params, 64, 40)
    for d in (one, many):
        assert d["total"] == pytest.approx(d["weights"] + d["experts"] + d["kv"] + d["engram"])
    assert one["weights"] == many["weights"] and many["kv"] == 64 * one["kv"]
    # experts: six distinct per token at batch 1 (expected value under uniform routing), all of them in the limit
    assert expected_active_experts(8, 2) == pytest.approx(8 * (1 - (7 / 8) ** 2))
    assert one["experts"] < many["experts"] <= 8 * 12 * one["experts"] / expected_active_experts(8, 2)
    assert matmul_macs_per_token(cfg, params) > params["head"]["weight"].size


def test_e2e_script_diagnostic_sections_run_on_cpu(tmp_path):
    """benchmarks/e2e_gpu.py's diagnostic sections (experts, host, nographs, bf16experts, gatherattn, expf32) run end to end
    on the tiny slice, as a device call would run them: no section records an error, the experts
    section counts each layer's distinct routed experts (at most the batch's picks, at most the
    experts there are) and reprices the step's bytes with them."""
    import json

    import e2e_gpu

    rc = e2e_gpu.main(["--tiny", "--layers", "4", "--sections", "decode,experts,host,nographs,bf16experts,gatherattn,expf32",
                       "--compile-cache", "none", "--out", str(tmp_path)])
    got = json.loads((tmp_path / "e2e_gpu.json").read_text())
    assert rc == 0, got["sections"]
    exp = got["sections"]["experts"]
    cfg = slice_config(4, tiny_widths=True)
    picks = exp["batch"] * cfg.num_experts_per_tok
    assert len(exp["distinct_experts_per_layer"]) == 4
    assert all(1 <= n <= min(picks, cfg.n_routed_experts) for n in exp["distinct_experts_per_layer"])
    row = next(r for r in got["sections"]["decode"] if (r["batch"], r["context"]) == (exp["batch"], exp["context"]))
    assert exp["total_bytes_own_routing"] - exp["expert_bytes_own_routing"] == pytest.approx(
        row["bytes"]["total"] - exp["expert_bytes_uniform"], rel=1e-9)
    assert {"step_ms", "model_program_ms", "sampler_ms", "noop_same_args_ms"} <= set(got["sections"]["host"])
    assert got["sections"]["gather-attn-decode"] and all(r["ms_per_step"] > 0
                                                         for r in got["sections"]["gather-attn-decode"])
