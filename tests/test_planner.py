"""Memory planner: weight and cache bytes are exact (checked against the official total and the cache
shapes), the activation estimate covers XLA's compiled temp bytes, and a plan that does not fit is
refused with what would fit."""

from __future__ import annotations

import io
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.cache import cache_bytes, cache_shapes
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.planner import PlanError, parse_bytes, plan, plan_memory
from deepinfer_jax.sharding import ShardingError, abstract_params

ROOT = Path(__file__).resolve().parents[1]
REAL_CONFIG = ROOT / "tests" / "fixtures" / "v41_flash_config.json"
OFFICIAL_BYTES = 509_315_516_760  # docs/CONTRACTS.md: every tensor of V4.1-Flash but the vision tower
GROUPS = ("backbone", "image", "dspark")


@pytest.fixture(scope="module")
def real_cfg():
    return ModelConfig.from_json(REAL_CONFIG)


def _weights(p):
    return dict(p.weights)


def test_one_device_weights_are_the_official_total(real_cfg):
    p = plan_memory(real_cfg, "data=1", 1, 1024, "reference", groups=GROUPS)
    assert p.weight_bytes == OFFICIAL_BYTES


def test_expert_parallel_weights_split_exactly(real_cfg):
    one = _weights(plan_memory(real_cfg, "data=1", 8, 1024))
    ep = _weights(plan_memory(real_cfg, "expert=8", 8, 1024))
    assert ep["routed experts"] * 8 == one["routed experts"]
    assert ep["embedding + LM head"] * 8 == one["embedding + LM head"]
    # Engram: rows split over all 8 devices, padded by < 1 row per device per table; projections whole
    tables = sum(math.prod(t["embed"][k].shape) for t in (l["engram"] for l in abstract_params(real_cfg)["layers"]
                                                            if "engram" in l) for k in ("weight", "scale"))
    assert 0 <= ep["Engram tables and projections"] - (one["Engram tables and projections"] - tables) - tables / 8 \
        < 2 * 8 * (256 + 8)
    assert ep["attention (q/kv/o, compressor, indexer)"] == one["attention (q/kv/o, compressor, indexer)"]
    tp = _weights(plan_memory(real_cfg, "tensor=8", 8, 1024))
    assert tp["attention (q/kv/o, compressor, indexer)"] < one["attention (q/kv/o, compressor, indexer)"] / 3


@pytest.mark.parametrize("numerics", ["reference", "reference-bf16-kv", "exact"])
def test_cache_bytes_split_over_data(real_cfg, numerics):
    num = {"reference": Numerics.reference(), "reference-bf16-kv": Numerics.reference(False),
           "exact": Numerics.exact()}[numerics]
    p = plan_memory(real_cfg, "data=4,expert=2", 64, 8192, numerics)
    assert p.cache_bytes * 4 == cache_bytes(real_cfg, 64, 8192, num)
    assert p.numerics == num


def test_table_lists_every_part(real_cfg):
    text = plan_memory(real_cfg, "tensor=2,expert=4", 16, 4096, step_tokens=64).table()
    for word in ("routed experts", "Engram tables", "compressed KV", "indexer keys", "sliding-window",
                 "largest stage", "total", "data=1,tensor=2,expert=4"):
        assert word in text, word


def test_refuses_what_does_not_fit_and_says_what_would(real_cfg):
    p = plan_memory(real_cfg, "data=1,tensor=1,expert=8", 512, 1 << 20, experts_path="grouped")
    budget = parse_bytes("139GiB")
    with pytest.raises(PlanError, match=r"512 slots x max_len 1048576 on mesh data=1,tensor=1,expert=8 does not "
                                        r"fit: needs .* \(weights .*KV/state caches .*activations .*would fit: "
                                        r"(\d+) slots at max_len 1048576; or max_len (\d+) with 512 slots") as e:
        p.check_fits(budget)
    import re

    slots, length = map(int, re.search(r"would fit: (\d+) slots.*max_len (\d+) with", str(e.value)).groups())
    assert plan_memory(real_cfg, "expert=8", slots, 1 << 20, experts_path="grouped").total_bytes <= budget
    assert plan_memory(real_cfg, "expert=8", slots + 1, 1 << 20, experts_path="grouped").total_bytes > budget
    assert plan_memory(real_cfg, "expert=8", 512, length, experts_path="grouped").total_bytes <= budget
    assert plan_memory(real_cfg, "expert=8", 512, length + 1, experts_path="grouped").total_bytes > budget
    with pytest.raises(PlanError, match=r"weights alone do not fit \(largest: routed experts.*a mesh with "
                                        r"expert=4 \(data=1,tensor=1,expert=4\) would need"):
        plan_memory(real_cfg, "expert=2", 8, 4096).check_fits("139GiB")
    plan_memory(real_cfg, "expert=8", 64, 65536, experts_path="grouped").check_fits("139GiB")  # the sizing that fits


def test_meshes_that_do_not_split_are_refused(real_cfg):
    with pytest.raises(ShardingError, match="n_routed_experts=384"):
        plan_memory(real_cfg, "expert=256", 8, 1024)
    with pytest.raises(ShardingError, match="slots do not split"):
        plan_memory(real_cfg, "data=8", 12, 1024)


@pytest.fixture
def fresh_compiles():
    """Compiles in this test come from XLA, never from the on-disk cache that every test process shares
    (conftest): an executable another process (other flags, other kernels) wrote there could stand in for
    this one, and its buffer assignment would then decide the test. Restored afterwards."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def test_activation_estimate_covers_compiled_temp_bytes(fresh_compiles):
    """The XLA:CPU compile of one step of the test config: its temp bytes are within the estimate, and
    the estimate is not a vacuous bound (at most 2.5x). Weights + caches equal the compiled argument
    bytes exactly, less the step inputs.

    Independent of what ran before in the same process (pytest -n 2 puts any tests before it): the
    numerics pin the routed experts and attention to the model's own XLA code (``kernels="xla"``,
    the gather path the plan is made for) instead of the automatic choice, which reads the kernel
    registry's process-wide registrations; the compile is fresh (``fresh_compiles``); the config is
    built here, not taken from another test module's state."""
    import dataclasses

    from deepinfer_jax.model.transformer import forward
    from test_sharding import mesh_test_config

    cfg = mesh_test_config()
    for num, b, t, max_len in ((Numerics.reference(), 8, 6, 64), (Numerics.exact(), 8, 1, 64)):
        num = dataclasses.replace(num, kernels="xla")
        sds = jax.ShapeDtypeStruct
        args = (abstract_params(cfg), cache_shapes(cfg, b, max_len, num), sds((b, t), jnp.int32), sds((b, t), jnp.int32),
                sds((b, t, len(cfg.engram_layer_ids), cfg.engram_columns), jnp.int32))
        step = jax.jit(lambda p, c, tok, pos, rows, num=num: forward(p, cfg, c, tok, pos, rows, num),
                       donate_argnums=(1,), keep_unused=True)  # gate.bias_vl is unused: keep its bytes
        mem = step.lower(*args).compile().memory_analysis()
        p = plan_memory(cfg, "data=1", b, max_len, num, step_tokens=t, experts_path="gather")
        inputs = b * t * 4 * (2 + len(cfg.engram_layer_ids) * cfg.engram_columns)
        assert mem.argument_size_in_bytes == p.weight_bytes + p.cache_bytes + inputs
        assert mem.temp_size_in_bytes <= p.activation_bytes <= 2.5 * mem.temp_size_in_bytes, (num, t, mem, p)


def test_cli_plan_prints_and_refuses(capsys):
    from deepinfer_jax.cli import main

    assert main(["plan", "--config", str(REAL_CONFIG), "--mesh", "expert=8", "--slots", "64", "--max-len", "65536",
                 "--experts-path", "grouped", "--device-memory", "139GiB"]) == 0
    out = capsys.readouterr()
    assert "routed experts" in out.out and "fits in 139.000 GiB" in out.out
    assert main(["plan", "--config", str(REAL_CONFIG), "--mesh", "expert=2", "--device-memory", "139GiB"]) == 2
    assert "weights alone do not fit" in capsys.readouterr().err
    buf = io.StringIO()
    plan(str(REAL_CONFIG), "expert=8", 8, 1024, out=buf)
    assert "total" in buf.getvalue()


def test_parse_bytes():
    assert parse_bytes("139GiB") == 139 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes(123) == 123
    with pytest.raises(ValueError, match="cannot read a byte count"):
        parse_bytes("lots")
