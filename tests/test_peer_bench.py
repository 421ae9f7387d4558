"""Smoke run of benchmarks/peer_transformers.py (the transformers peer, issue 7) on its tiny CPU slice.

The benchmark's two halves run in two interpreters here: ours in this one (jax), transformers in the
torch interpreter of the parity test (``torch_python``: $DEEPINFER_TORCH_PYTHON or .venv-torch), the
weights passed through a safetensors directory. The test checks what the run reports: its agreement
verdict on the short prompt's prefill logits, in float32 (every row within 1e-5: the two sides compute
the same function, so any plumbing error of the benchmark -- weight names, chunked prefill, the cache
copied into B rows -- shows) and in bfloat16 (the dtype the GPU run compares, with its looser rounding
tolerance), and that every side produced its timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_transformers_parity import torch_python

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peer_transformers.py"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peer_tiny_run_agrees(tmp_path, dtype):
    py = torch_python()
    if py is None:  # as the parity test: skipped without torch, except under CI
        (pytest.fail if os.environ.get("CI") else pytest.skip)("no torch interpreter (see test_transformers_parity)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DEEPINFER_TORCH_PYTHON": py}
    # the smallest run that still passes every code path once: one decode batch, no XLA-only section
    # bf16 also runs the XLA-only side once, for its chunked pass over the agreement prompt (diagnostics)
    xla = "1" if dtype == "bfloat16" else ""
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--dtype", dtype, "--batches", "1", "--xla-batches", xla,
           "--steps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    report = tmp_path / "peer_transformers.json"
    assert report.exists(), f"no report ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(report.read_text())
    for side in ("torch", "ours"):
        assert "error" not in res[side], f"{side}: {res[side]['error']}"
        assert res[side]["prefill"]["ms"] > 0
        assert [r["batch"] for r in res[side]["decode"]] == [1] and res[side]["decode"][0]["ms_per_step"] > 0
    assert res["torch"]["attn_implementation"] == "eager"
    check = res["check"]
    compared = {"check_logits", "prefill_last_logits", "decode_logits"}
    diagnostics = {"check_logits_xla_vs_transformers", "check_logits_kernels_vs_xla"} if xla else set()
    # bf16 runs also run transformers in float32 (the default --noise-floor): that is the gate's reference
    floor = {"check_logits_vs_transformers_float32", "check_logits_transformers_vs_its_float32"} if xla else set()
    assert set(check) == compared | diagnostics | floor
    assert res["gate"] == ("check_logits_vs_transformers_float32" if xla else "check_logits")
    if xla:  # on CPU both of our paths are the model's XLA code, run in different chunkings: near-identical
        assert check["check_logits_kernels_vs_xla"]["top1_agree"] == 1.0
        assert check["check_logits_kernels_vs_xla"]["median_rel"] < 1e-3
        # both bf16 sides near the float32 reference: a plumbing error in the float32 pass would show here
        assert check["check_logits_transformers_vs_its_float32"]["median_rel"] < 5e-2
    c = check[res["gate"]]
    assert c["passed"], f"prefill logits disagree ({dtype}): {c}"
    if xla:  # the bf16-vs-bf16 comparison passes on the tiny slice too (8 experts: few routing flips)
        assert check["check_logits"]["passed"], check["check_logits"]
    if dtype == "float32":  # the long prefill's last position and the first decode step, same bound
        for key in ("prefill_last_logits", "decode_logits"):
            assert check[key]["passed"], f"{key} disagrees: {check[key]}"
    assert proc.returncode == 0, proc.stdout[-3000:]
