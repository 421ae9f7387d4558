"""The persistent compilation cache option (deepinfer_jax/compile_cache.py; ``LLM(compile_cache=)``,
``--compile-cache``). It is process-wide jax configuration, so each test runs in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, timeout: int = 600) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_enabled_after_a_compile_it_caches_later_programs_and_keeps_one_dir(tmp_path):
    out = _child(f"""
import os, jax, jax.numpy as jnp
from deepinfer_jax.compile_cache import enable_compile_cache
jax.jit(lambda x: x + 1)(1.0)                 # jax has already decided 'no cache' once
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
d = enable_compile_cache({str(tmp_path / "c")!r})
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3))
print(sum(1 for f in os.listdir(d) if "lambda" in f))
assert enable_compile_cache({str(tmp_path / "c")!r}) == d     # the same directory again is fine
try:
    enable_compile_cache({str(tmp_path / "other")!r})
except ValueError as e:
    print("refused:", e)
""")
    lines = out.strip().splitlines()
    assert int(lines[0]) >= 1
    assert lines[1].startswith("refused:") and "already" in lines[1]


@pytest.mark.slow
def test_a_second_cli_run_loads_its_programs_and_writes_the_same_results(tmp_path):
    """Two CLI runs on the tiny checkpoint with one cache directory: the second compiles nothing it can
    load (jax's cache-hit events) and its results are the first run's, byte for byte."""
    reqs = tmp_path / "in.jsonl"
    reqs.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Count to {i}.", "max_tokens": 6,
                                        "temperature": 0.7, "seed": i}) + "\n" for i in range(3)))
    code = """
import sys, jax
from deepinfer_jax.cli import main
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
rc = main(["generate", "--input", sys.argv[1], "--output", sys.argv[2], "--compile-cache", sys.argv[3],
           "--quiet", "--no-resume"])
print(rc, len(hits))
"""
    runs = []
    for out in ("a.jsonl", "b.jsonl"):
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-c", code, str(reqs), str(tmp_path / out), str(tmp_path / "cache")],
                              capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append([int(v) for v in done.stdout.split()[-2:]])
    assert runs[0] == [0, 0] and runs[1][0] == 0
    assert runs[1][1] >= 2          # at least the prefill and decode programs came from the cache
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all("error" not in r and r["token_ids"] for r in records)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
