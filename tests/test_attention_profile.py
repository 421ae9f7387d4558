"""Profiling the sparse-attention kernel (SparseAttentionConfig.profile_dir / profile_ranges): the config's
checks, the named phases the kernel records when lowered with the profiler on, and the trace summary of
benchmarks/attention_profile_gpu.py on synthetic traces (the GPU runs themselves need an H200)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.attention import SparseAttentionConfig, kernel_unsupported_reason
from pallas_kernels.attention.config import profile_ranges_needed, smem_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from attention_profile_gpu import config_fields, newest_trace, split_of, summarize_trace, trace_ranges  # noqa: E402


def test_profile_fields_are_set_together():
    with pytest.raises(ValueError, match="profile_dir"):
        SparseAttentionConfig(profile_dir="/tmp/x")
    with pytest.raises(ValueError, match="profile_ranges"):
        SparseAttentionConfig(profile_ranges=64)
    with pytest.raises(ValueError, match="profile_ranges"):
        SparseAttentionConfig(profile_dir="/tmp/x", profile_ranges=-1)
    cfg = SparseAttentionConfig(profile_dir="/tmp/x", profile_ranges=64)
    assert cfg != SparseAttentionConfig() and hash(cfg) != hash(SparseAttentionConfig())   # another static config


def test_profile_ranges_must_hold_a_trace_and_fit_in_shared_memory():
    # Mosaic's "Init", c_init, c_out, nine phases per 64-row block, one range for the 3-entry header
    assert profile_ranges_needed(320) == 3 + 9 * 5 + 1
    few = SparseAttentionConfig(320, profile_dir="/tmp/x", profile_ranges=48)
    assert "need 49" in kernel_unsupported_reason(64, 512, few, fp4=True)
    ok = SparseAttentionConfig(320, profile_dir="/tmp/x", profile_ranges=64)
    assert kernel_unsupported_reason(64, 512, ok, fp4=True) is None
    assert smem_bytes(512, 320, True, 64) - smem_bytes(512, 320, True) == 3 * 64 * 16 + 8
    # The FP4 kernel has ~3 KB of shared memory left: 96 ranges a warpgroup do not fit.
    big = SparseAttentionConfig(320, profile_dir="/tmp/x", profile_ranges=96)
    assert "shared memory" in kernel_unsupported_reason(64, 512, big, fp4=True)


_FP4_DECODE_ARGS = (jax.ShapeDtypeStruct((64, 1, 64, 512), jnp.bfloat16),
                    jax.ShapeDtypeStruct((64, 128, 512), jnp.bfloat16), jax.ShapeDtypeStruct((64, 1, 128), jnp.int32),
                    jax.ShapeDtypeStruct((64, 8192, 256), jnp.uint8),
                    jax.ShapeDtypeStruct((64, 8192, 32), jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((64, 1, 512), jnp.int32), jax.ShapeDtypeStruct((64,), jnp.float32))


@pytest.fixture
def profiler_regions(monkeypatch):
    """The names of the profiler regions Mosaic GPU emits while lowering, in order. The trace writer is
    a host callback, which cannot be lowered for CUDA on a CPU host, so it is stubbed out here."""
    from jax.experimental.mosaic.gpu import launch_context

    regions = []
    original = launch_context.LaunchContext.named_region

    @contextlib.contextmanager
    def spy(self, name, *a, **k):
        regions.append(name)
        with original(self, name, *a, **k):
            yield

    monkeypatch.setattr(launch_context.LaunchContext, "named_region", spy)
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)
    return regions


def test_fp4_kernel_with_the_profiler_lowers_for_cuda_and_records_its_phases(profiler_regions, tmp_path):
    """Cross-lowers the profiled FP4 variant (the one closest to the shared-memory limit) for CUDA and
    lists the profiler regions Mosaic emits, in program order: Mosaic's "Init", each consumer's and the
    producer's phases, the per-block ones once (they sit in the block loop). The count per block is what
    ``profile_ranges_needed`` assumes."""
    from pallas_kernels.attention.config import PROFILE_SCOPES_PER_BLOCK
    from pallas_kernels.attention.kernel import sparse_sink_attention_fp4_pallas

    cfg = SparseAttentionConfig(320, profile_dir=str(tmp_path), profile_ranges=64)
    fn = jax.jit(lambda *a: sparse_sink_attention_fp4_pallas(*a, 512 ** -0.5, cfg))
    assert "mosaic_gpu" in jax.export.export(fn, platforms=["cuda"])(*_FP4_DECODE_ARGS).mlir_module()
    per_block = ["c_wait", "c_tile", "c_tile_sync", "c_qk", "c_max", "c_exp", "c_psync", "c_pv", "c_sync"]
    consumer = ["c_init", *per_block, "c_out"]
    assert profiler_regions == ["Init", *consumer, *consumer, "p_init", "p_wait_free", "p_issue", "p_drain"]
    assert len(per_block) == PROFILE_SCOPES_PER_BLOCK


def test_bf16_kernel_with_the_profiler_lowers_for_cuda_and_records_its_phases(profiler_regions, tmp_path):
    """The bf16 kernel's phases: no c_tile_sync; the producer waits and issues per landing slot."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas

    cfg = SparseAttentionConfig(320, profile_dir=str(tmp_path), profile_ranges=64)
    args = (jax.ShapeDtypeStruct((64, 1, 64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((64, 8320, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 1, 640), jnp.int32), jax.ShapeDtypeStruct((64,), jnp.float32))
    fn = jax.jit(lambda q, kv, idx, sink: sparse_sink_attention_pallas(q, kv, idx, sink, 512 ** -0.5, cfg))
    assert "mosaic_gpu" in jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
    consumer = ["c_init", "c_wait", "c_tile", "c_qk", "c_max", "c_exp", "c_psync", "c_pv", "c_sync", "c_out"]
    assert profiler_regions == ["Init", *consumer, *consumer, "p_init", "p_wait_free", "p_issue", "p_wait_free",
                                "p_issue", "p_drain"]


# ---- the trace summary -------------------------------------------------------------------------------

def _ev(tid, name, ph, ts):
    return {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}


def _range(tid, name, begin, end):
    return [_ev(tid, name, "B", begin), _ev(tid, name, "E", end)]


def _synthetic_trace():
    """Two CTAs of three warpgroups (tid = 1 + warpgroup + 3 * cta); ts in trace units (1,000 cycles).
    CTA 0 spans 0..5, CTA 1 10..14; CTA 1's consumer 1 recorded nothing; the producer of CTA 0 has a
    nested range."""
    return {"traceEvents": [
        *_range(1, "Init", 0, 1), *_range(1, "c_qk", 1, 3), *_range(1, "c_qk", 3, 4),
        *_range(2, "Init", 0, 1), *_range(2, "c_qk", 1, 5),
        *_range(3, "Init", 0, 0.5), _ev(3, "p_issue", "B", 0.5), *_range(3, "inner", 1, 1.5),
        _ev(3, "p_issue", "E", 2),
        *_range(4, "Init", 10, 11), *_range(4, "c_qk", 11, 14),
        *_range(6, "Init", 10, 10.5), *_range(6, "p_issue", 10.5, 12)]}


def _rows(summary):
    return {(r["role"], r["phase"]): r for r in summary["rows"]}


def test_trace_ranges_pairs_begins_and_ends_per_warpgroup():
    got = trace_ranges(_synthetic_trace()["traceEvents"], 3)
    assert got[(0, 2)] == [("Init", 0, 0.0, 0.5), ("p_issue", 0, 0.5, 2.0), ("inner", 1, 1.0, 1.5)]
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2)]
    with pytest.raises(ValueError, match="does not close"):
        trace_ranges([_ev(1, "a", "B", 0), _ev(1, "b", "E", 1)], 3)
    with pytest.raises(ValueError, match="never end"):
        trace_ranges([_ev(1, "a", "B", 0)], 3)


def test_summary_of_a_synthetic_trace():
    s = summarize_trace(_synthetic_trace())
    assert s["ctas"] == 2 and s["span_mean"] == 4500.0 and s["span_median"] == 4500.0   # 5000 and 4000 cycles
    assert [(r["role"], r["phase"]) for r in s["rows"]] == [
        ("consumer0", "Init"), ("consumer0", "c_qk"), ("consumer0", "(untracked)"),
        ("consumer1", "Init"), ("consumer1", "c_qk"), ("consumer1", "(untracked)"),
        ("producer", "Init"), ("producer", "p_issue"), ("producer", "inner"), ("producer", "(untracked)")]
    rows = _rows(s)
    qk = rows[("consumer0", "c_qk")]        # 2000 + 1000 in CTA 0, 3000 in CTA 1
    assert (qk["count"], qk["per_cta"], qk["mean"], qk["median"], qk["per_cta_cycles"]) == (3, 1.5, 2000.0, 2000.0,
                                                                                            3000.0)
    assert qk["share"] == 6000 / 9000 and qk["by_occurrence"] == [2500.0, 1000.0]
    un = rows[("consumer0", "(untracked)")]   # CTA 0: 5000 - 4000; CTA 1: 4000 - 4000
    assert (un["count"], un["mean"], un["share"], un["by_occurrence"]) == (2, 500.0, 1000 / 9000, [500.0])
    qk1 = rows[("consumer1", "c_qk")]       # recorded in CTA 0 only: per CTA over both CTAs
    assert (qk1["count"], qk1["per_cta"], qk1["mean"], qk1["per_cta_cycles"], qk1["share"]) == (1, 0.5, 4000.0,
                                                                                               2000.0, 4000 / 9000)
    assert rows[("consumer1", "(untracked)")]["mean"] == 0.0
    inner = rows[("producer", "inner")]
    assert (inner["count"], inner["mean"]) == (1, 500.0)
    # the producer's untracked time counts its outermost ranges only: 5000 - 2000 and 4000 - 2000
    assert rows[("producer", "(untracked)")]["by_occurrence"] == [2500.0]
    assert rows[("producer", "p_issue")]["median"] == 1500.0


def test_summary_of_some_ctas():
    s = summarize_trace(_synthetic_trace(), ctas=[1])
    assert s["ctas"] == 1 and s["span_mean"] == 4000.0
    assert {r["role"] for r in s["rows"]} == {"consumer0", "producer"}
    assert _rows(s)[("consumer0", "c_qk")]["share"] == 3000 / 4000


def test_summary_reads_what_mosaics_trace_writer_writes(tmp_path):
    """A profiler buffer written by hand (2 CTAs x 3 warpgroups; times in SM cycles) through Mosaic GPU's
    own ``ProfilerSpec.dump``: the summary finds each CTA and warpgroup and reads durations in cycles."""
    from jax.experimental.mosaic.gpu.profiler import ProfilerSpec

    spec = ProfilerSpec(4 * 8)
    tag = {name: spec.intern_name(name) for name in ("Init", "c_qk", "p_issue")}
    buf = np.zeros((2, 3, 4 * 8), np.uint32)

    def record(cta, wg, start, events):   # events: (name, begin cycle, end cycle)
        flat = []
        for name, b, e in events:
            flat += [tag[name] | ProfilerSpec.ENTER, b, tag[name] | ProfilerSpec.EXIT, e]
        buf[cta, wg, :3] = (start, 7, len(flat))
        buf[cta, wg, 3:3 + len(flat)] = flat

    # a 1-cycle range makes the writer's estimate of its own per-event overhead 0
    record(0, 0, 1000, [("Init", 100, 101), ("c_qk", 200, 2200)])
    record(0, 2, 1000, [("Init", 100, 101), ("p_issue", 300, 800)])
    # (no two events on the same cycle: the writer's overhead estimate is unsigned, 0 - 1 wraps)
    record(1, 0, 9000, [("Init", 50, 51), ("c_qk", 52, 3052)])
    path = tmp_path / "t.json"
    with open(path, "w") as f:
        spec.dump(buf.reshape(-1), f, grid=(2, 1, 1), block=(384, 1, 1))
    with open(path) as f:
        trace = json.load(f)
    s = summarize_trace(trace)
    rows = _rows(s)
    assert s["ctas"] == 2
    assert s["span_mean"] == pytest.approx((2100 + 3002) / 2)
    assert rows[("consumer0", "c_qk")]["mean"] == pytest.approx(2500.0)
    assert rows[("producer", "p_issue")]["count"] == 1 and rows[("producer", "p_issue")]["mean"] == pytest.approx(500)
    assert not any(r["role"] == "consumer1" for r in s["rows"])


def test_newest_trace_and_split_of(tmp_path):
    for name in ("entry-20-trace.json", "entry-100-trace.json", "notes.json"):
        (tmp_path / name).write_text("{}")
    assert Path(newest_trace(str(tmp_path))).name == "entry-100-trace.json"   # by number, not by text
    with pytest.raises(FileNotFoundError):
        newest_trace(str(tmp_path / "none"))
    assert [split_of(c, 64) for c in (0, 63, 64, 127)] == [0, 0, 1, 1]


def test_config_fields_parse_literals_and_refuse_bare_names():
    assert config_fields(" pv_in_place=True, pv_cols=64 ") == {"pv_in_place": True, "pv_cols": 64}
    assert config_fields("row_issue='warps'") == {"row_issue": "warps"}
    assert config_fields("") == {}
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        config_fields("pv_in_place")
