"""Where the time of one CTA of the sparse-attention kernel goes, phase by phase (Mosaic GPU's profiler).

Run on the H200 from the repo root:  PYTHONPATH=. python3 benchmarks/attention_profile_gpu.py [--out DIR]
                                       [--cases decode_fp4,decode_bf16,prefill_fp4,prefill_bf16]
                                       [--split-rows 320,640] [--config FIELD=VALUE,...] [--no-profile]
                                       [--sm-clock-mhz MHZ]

Cases (640 rows a query: 128 window rows, bf16, and 512 of a compressed cache of 8,192 rows; 64 heads,
D = 512, split_rows 320, i.e. two CTAs a query of five 64-row blocks each):
  decode_fp4   B = 64, T = 1, ``sparse_sink_attention_fp4_pallas`` (the compressed rows as stored: FP4).
  decode_bf16  the same problem, the compressed cache decoded to bf16 first (outside the timed call),
               ``sparse_sink_attention_pallas``.
  prefill_fp4  B = 1, T = 1024 (a prefill chunk; the rows fit in L2), the FP4 variant.
  prefill_bf16 the same prefill problem on the decoded cache, the bf16 kernel (the prefill programs' form
               since 2026-12-06).
Each case runs at every --split-rows and every --config set (';' separates sets); --no-profile times
only (the kernel and the whole call, whose wrapper work and split merge count too).

Per case: the kernel's default config is called (compile, warm) and its kernel timed by CUPTI; then
``SparseAttentionConfig(profile_dir=..., profile_ranges=...)``, another static config and so a second
compile, runs twice: the first (cold) run's Chrome trace is removed, the second's is kept
(``<out>/attention_profile_traces/<case>/``, for Perfetto or chrome://tracing) and summarized: per
warpgroup role (consumer 0 / 1, producer) and named phase (kernel.py's ``jax.named_scope`` regions,
plus Mosaic's own "Init"), the mean and median duration per occurrence, the occurrences per CTA, the
time per CTA, its share of the CTA's span, and the mean of the k-th occurrence (for the per-block
phases: of block k of the split); also the CTA span (first begin to last end over the CTA's
warpgroups) and the CTA count; once over all CTAs and once per split. The results go to
``<out>/attention_profile_gpu.json``.
The profiled kernel is then timed by CUPTI too (the profiler's own cost). Two compiles a case, six in
all (~15-30 s each on the H200). The prefill trace is ~40 MB of JSON (2,048 CTAs).

Units: the profiler stamps events with the SM's cycle counter (%clock) and its JSON writer treats a
cycle as a nanosecond, so a trace "microsecond" is 1,000 cycles. The summaries are in cycles; the
tables convert at --sm-clock-mhz (default: nvidia-smi's clocks.max.sm, else 1980). Each warpgroup's
trace starts at its "Init" event, anchored to a clock read at the kernel's start, so phases compare
across warpgroups to within that anchoring.

The trace's CTA order is Mosaic's block order, (x * grid_y + y) * grid_z + z, with Pallas' last grid
axis (here "split") on x: CTA c is split c // n_queries (jax 0.11-0.12; ``split_of`` below).
"""

from __future__ import annotations

import argparse
import ast
import glob
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.attention import SparseAttentionConfig
from pallas_kernels.attention.config import profile_ranges_needed
from pallas_kernels.attention.kernel import sparse_sink_attention_fp4_pallas, sparse_sink_attention_pallas
from timing import cupti_ms   # benchmarks/timing.py (the script's folder is on sys.path)

H, D, WINDOW, SELECTED, CACHE_ROWS = 64, 512, 128, 512, 8192
SCALE = D ** -0.5
SPLIT_ROWS = 320
#: Warpgroup roles in trace order (Mosaic's trace index within a CTA is the warpgroup index): the two
#: consumers, then the one producer of the default config.
ROLES = ("consumer0", "consumer1", "producer")
#: Trace units (what the JSON calls microseconds) per SM clock cycle.
_CYCLES_PER_TRACE_UNIT = 1000.0


def log(*a):
    print(*a, flush=True)


# ---- the trace: pure functions (tests/test_attention_profile.py) ------------------------------------

def trace_ranges(events: list[dict], warpgroups_per_cta: int) -> dict[tuple[int, int], list[tuple]]:
    """Chrome-trace events of Mosaic GPU's profiler -> {(cta, warpgroup): [(name, depth, begin, end)]},
    ranges in order of their begin, times in trace units. Mosaic numbers a trace (tid) 1 + warpgroup +
    warpgroups_per_cta * cta and writes each trace's events in order, so B/E pairs nest per tid."""
    open_by_tid: dict[int, list[tuple[str, float, int]]] = {}
    out: dict[tuple[int, int], list[tuple]] = {}
    for ev in events:
        if ev.get("ph") not in ("B", "E"):
            continue
        tid = int(ev["tid"])
        key = divmod(tid - 1, warpgroups_per_cta)
        stack = open_by_tid.setdefault(tid, [])
        ranges = out.setdefault(key, [])
        if ev["ph"] == "B":
            stack.append((ev["name"], float(ev["ts"]), len(ranges)))
            ranges.append(None)   # filled at the end event: keeps the ranges in begin order
            continue
        if not stack or stack[-1][0] != ev["name"]:
            raise ValueError(f"trace {tid}: end of {ev['name']!r} does not close the open range "
                             f"{stack[-1][0] if stack else None!r}")
        name, begin, slot = stack.pop()
        ranges[slot] = (name, len(stack), begin, float(ev["ts"]))
    for tid, stack in open_by_tid.items():
        if stack:
            raise ValueError(f"trace {tid}: {[s[0] for s in stack]} never end")
    return out


def summarize_trace(trace: dict, roles: tuple[str, ...] = ROLES, ctas=None) -> dict:
    """The per-phase table of one profiler trace ({"traceEvents": [...]}), durations in SM cycles.

    roles: one name per warpgroup of a CTA, in warpgroup order. ctas: the CTA indices to include
    (None: all). -> {"ctas": number of CTAs, "span_mean" / "span_median": a CTA's span (its first begin
    to its last end over all its warpgroups), "rows": [one per (role, phase), roles in order, phases in
    order of first appearance, then the role's "(untracked)" row: the CTA span minus the role's
    outermost ranges]}. A row: count (occurrences in all CTAs), per_cta (count / ctas), mean / median
    (per occurrence), per_cta_cycles (total / ctas), share (total / the sum of the CTAs' spans) and
    by_occurrence (the mean of each CTA's k-th occurrence, over the CTAs that have one)."""
    ranges = trace_ranges(trace["traceEvents"], len(roles))
    keep = None if ctas is None else set(ctas)
    by_cta: dict[int, dict[int, list[tuple]]] = {}
    for (cta, wg), rs in sorted(ranges.items()):
        if keep is None or cta in keep:
            by_cta.setdefault(cta, {})[wg] = rs
    spans = {}
    for cta, wgs in by_cta.items():
        all_r = [r for rs in wgs.values() for r in rs]
        spans[cta] = (max(r[3] for r in all_r) - min(r[2] for r in all_r)) * _CYCLES_PER_TRACE_UNIT
    n = len(by_cta)
    total_span = sum(spans.values())
    rows = []
    for wg, role in enumerate(roles):
        per_phase: dict[str, list[list[float]]] = {}   # phase -> per CTA: durations in order
        untracked = []
        for cta, wgs in by_cta.items():
            if wg not in wgs:
                continue
            mine: dict[str, list[float]] = {}
            outer = 0.0
            for name, depth, begin, end in wgs[wg]:
                dur = (end - begin) * _CYCLES_PER_TRACE_UNIT
                mine.setdefault(name, []).append(dur)
                outer += dur if depth == 0 else 0.0
            for name, durs in mine.items():
                per_phase.setdefault(name, []).append(durs)
            untracked.append([spans[cta] - outer])
        for name, per_cta in [*per_phase.items(), ("(untracked)", untracked)]:
            if not per_cta:
                continue
            durs = [d for ds in per_cta for d in ds]
            total = sum(durs)
            most = max(len(ds) for ds in per_cta)
            by_occ = [statistics.fmean([ds[k] for ds in per_cta if len(ds) > k]) for k in range(most)]
            rows.append(dict(role=role, phase=name, count=len(durs), per_cta=len(durs) / n,
                             mean=statistics.fmean(durs), median=statistics.median(durs), per_cta_cycles=total / n,
                             share=total / total_span if total_span else float("nan"), by_occurrence=by_occ))
    span_list = list(spans.values())
    return dict(ctas=n, span_mean=statistics.fmean(span_list) if span_list else float("nan"),
                span_median=statistics.median(span_list) if span_list else float("nan"), rows=rows)


def format_table(summary: dict, clock_mhz: float) -> str:
    """The summary as a text table, cycles converted to microseconds at ``clock_mhz``."""
    us = 1.0 / clock_mhz   # microseconds per cycle
    lines = [f"{summary['ctas']} CTAs; CTA span mean {summary['span_mean'] * us:.2f} us, median "
             f"{summary['span_median'] * us:.2f} us ({summary['span_mean']:.0f} cycles; at {clock_mhz:.0f} MHz)",
             f"{'role':10s} {'phase':12s} {'n/CTA':>6s} {'mean us':>8s} {'median':>8s} {'us/CTA':>8s} "
             f"{'share':>6s}  mean of occurrence k (us)"]
    for r in summary["rows"]:
        occ = " ".join(f"{v * us:.2f}" for v in r["by_occurrence"][:12])
        lines.append(f"{r['role']:10s} {r['phase']:12s} {r['per_cta']:6.1f} {r['mean'] * us:8.3f} "
                     f"{r['median'] * us:8.3f} {r['per_cta_cycles'] * us:8.2f} {r['share']:6.1%}  {occ}")
    return "\n".join(lines)


def newest_trace(directory: str) -> str:
    """The newest ``<kernel>-<ns>-trace.json`` Mosaic wrote into ``directory`` (by the ns in its name)."""
    paths = glob.glob(os.path.join(directory, "*-trace.json"))
    if not paths:
        raise FileNotFoundError(f"no profiler trace in {directory}")
    return max(paths, key=lambda p: int(os.path.basename(p).rsplit("-", 2)[-2]))


def split_of(cta: int, n_queries: int) -> int:
    """The split a trace's CTA index belongs to (module docstring: Mosaic's block order)."""
    return cta // n_queries


# ---- inputs ----------------------------------------------------------------------------------------

def sm_clock_mhz(given: float) -> float:
    """``given`` if positive, else the GPU's maximum SM clock by nvidia-smi, else 1980 (the H200's)."""
    if given > 0:
        return given
    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return float(got[0])
    except Exception:  # noqa: BLE001 - no nvidia-smi: the H200's figure
        return 1980.0


def distinct_rows(rng, n: int, count: int, pool: int) -> np.ndarray:
    """[n, count] int32: per row ``count`` distinct values of range(pool), ascending."""
    picks = np.argpartition(rng.random((n, pool), dtype=np.float32), count - 1, axis=1)[:, :count]
    return np.sort(picks, axis=1).astype(np.int32)


def fp4_problem(rng, b: int, t: int) -> tuple:
    """(q [b,t,H,D], window rows [b,128,D] bf16, window idx [b,t,128], FP4 values [b,N,D/2] uint8, E4M3
    scales [b,N,D/16], compressed idx [b,t,512], sink [H]): every query lists the 128 window rows and
    512 distinct rows of its sequence's N = 8,192 compressed rows."""
    from deepinfer_jax.model import kv_codec

    k = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    q = jax.random.normal(k[0], (b, t, H, D), jnp.bfloat16)
    win = jax.random.normal(k[1], (b, WINDOW, D), jnp.bfloat16)
    comp = jax.jit(lambda x: kv_codec.encode(kv_codec.COMPRESSED, x, True, jnp.bfloat16))(
        jax.random.normal(k[2], (b, CACHE_ROWS, D), jnp.float32))
    widx = jnp.broadcast_to(jnp.arange(WINDOW, dtype=jnp.int32), (b, t, WINDOW))
    cidx = jnp.asarray(distinct_rows(rng, b * t, SELECTED, CACHE_ROWS).reshape(b, t, SELECTED))
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    return q, win, widx, comp["values"], comp["scale"], cidx, sink


def decoded_problem(fp4_args: tuple) -> tuple:
    """The FP4 problem as the bf16 kernel's: (q, kv [b, 128 + N, D] with the cache decoded, idx
    [b, t, 640], sink); the decode runs here, outside the profiled call."""
    from deepinfer_jax.model.attention import sparse_inputs

    q, win, widx, values, scale, cidx, sink = fp4_args
    kv, idx = jax.jit(lambda w, wi, v, s, ci: sparse_inputs(w, wi >= 0, {"values": v, "scale": s}, ci,
                                                            jnp.bfloat16))(win, widx, values, scale, cidx)
    return q, kv, idx, sink


# ---- the GPU runs --------------------------------------------------------------------------------------

def kernel_call(case: str, cfg: SparseAttentionConfig):
    """The jitted kernel call of a case under ``cfg``."""
    if case.endswith("bf16"):
        return jax.jit(lambda q, kv, idx, sink: sparse_sink_attention_pallas(q, kv, idx, sink, SCALE, cfg))
    return jax.jit(lambda *a: sparse_sink_attention_fp4_pallas(*a, SCALE, cfg))


def kernel_us(fn, args, iters: int, total: bool = False):
    """The Mosaic kernel's CUPTI time per call in microseconds (after an untimed call), None without CUPTI;
    total: (kernel, every kernel of the call: the wrapper's XLA work and the split merge too)."""
    got = cupti_ms(fn, *args, iters=iters, match="mosaic")
    kern = None if got is None or got[1] is None else got[1] * 1e3
    if not total:
        return kern
    return kern, None if got is None else got[0] * 1e3


def run_case(case: str, args: tuple, n_queries: int, trace_dir: str, profile_ranges: int, clock_mhz: float,
             plain: bool, split_rows: int = SPLIT_ROWS, profile: bool = True, overrides: dict | None = None) -> dict:
    """Time the case's kernel (no profiler), run the profiled one twice and summarize the second run's
    trace (all CTAs and per split); n_queries: the kernel's queries (B * T, one head group)."""
    overrides = overrides or {}
    splits = SparseAttentionConfig(split_rows).num_splits(WINDOW + SELECTED)
    res: dict = dict(case=case, split_rows=split_rows, config=overrides, ctas_expected=n_queries * splits,
                     profile_ranges=profile_ranges, clock_mhz=clock_mhz)
    if plain:
        t0 = time.time()
        res["kernel_us"], res["call_us"] = kernel_us(kernel_call(case, SparseAttentionConfig(split_rows, **overrides)), args,
                                                     iters=5, total=True)
        log(f"{case}: split {split_rows} kernel {res['kernel_us']} us, whole call {res['call_us']} us "
            f"(CUPTI; compile + runs {time.time() - t0:.0f} s)")
    if not profile:
        return res
    os.makedirs(trace_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(trace_dir, "*-trace.json")):   # an earlier run's: not to be read as this one's
        os.remove(stale)
    cfg = SparseAttentionConfig(split_rows, profile_dir=trace_dir, profile_ranges=profile_ranges, **overrides)
    fn = kernel_call(case, cfg)
    t0 = time.time()
    # Mosaic names the trace file once per compile and never overwrites it: the first (cold) run's
    # trace is removed so that the second, warm, run can write its own.
    jax.block_until_ready(fn(*args))
    jax.effects_barrier()   # the trace is written by a host callback
    os.remove(newest_trace(trace_dir))
    jax.block_until_ready(fn(*args))
    jax.effects_barrier()
    res["trace"] = path = newest_trace(trace_dir)
    log(f"{case}: profiled: compile + 2 runs + traces {time.time() - t0:.0f} s")
    # (these runs find the file written: their dumps fail, silently, main's warning filter)
    res["kernel_us_profiled"] = kernel_us(fn, args, iters=3)
    log(f"{case}: profiled kernel {res['kernel_us_profiled']} us (CUPTI)")
    with open(path) as f:
        trace = json.load(f)
    res["summary"] = summary = summarize_trace(trace)
    log(f"\n--- {case}: all CTAs ({os.path.basename(path)})\n{format_table(summary, clock_mhz)}")
    ctas = {int(ev["tid"] - 1) // len(ROLES) for ev in trace["traceEvents"]}
    res["by_split"] = {}
    for split in sorted({split_of(c, n_queries) for c in ctas}):
        part = summarize_trace(trace, ctas=[c for c in ctas if split_of(c, n_queries) == split])
        res["by_split"][f"split{split}"] = part
        log(f"\n--- {case}: split {split}\n{format_table(part, clock_mhz)}")
    return res


def config_fields(text: str) -> dict:
    """"pv_in_place=True,pv_cols=64" -> {"pv_in_place": True, "pv_cols": 64} (values: Python literals)."""
    fields = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"--config {text!r}: {part!r} is not FIELD=VALUE")
        fields[key.strip()] = ast.literal_eval(value.strip())
    return fields


CASES = {"decode_fp4": (64, 1), "decode_bf16": (64, 1), "prefill_fp4": (1, 1024), "prefill_bf16": (1, 1024)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--profile-ranges", type=int, default=64,
                    help=f"each warpgroup's profiler buffer in ranges (>= {profile_ranges_needed(SPLIT_ROWS)} at "
                         f"split {SPLIT_ROWS}; 16 B a range and warpgroup of the FP4 kernel's last ~3 KB of smem)")
    ap.add_argument("--sm-clock-mhz", type=float, default=0.0, help="cycles -> us; 0: nvidia-smi's clocks.max.sm")
    ap.add_argument("--no-plain", action="store_true", help="skip the unprofiled config's compile and timing")
    ap.add_argument("--split-rows", default=str(SPLIT_ROWS),
                    help="comma-separated split_rows to run each case at (the profile needs more ranges for more)")
    ap.add_argument("--no-profile", action="store_true", help="time the kernel only (no profiled compile)")
    ap.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a SparseAttentionConfig field for every case (repeatable; Python literals, e.g. "
                         "pv_in_place=True); each set of fields is a run of its own: separate them with ';'")
    args = ap.parse_args()
    # Mosaic's trace writer warns on every profiled run after the one that wrote the trace (run_case)
    warnings.filterwarnings("ignore", message="Failed to dump profile")
    dev = jax.devices()[0]
    clock = sm_clock_mhz(args.sm_clock_mhz)
    log(f"jax {jax.__version__}  device {dev.device_kind}  SM clock {clock:.0f} MHz (cycles -> us)")
    results: dict = dict(device=dev.device_kind, jax=jax.__version__, clock_mhz=clock, cases={}, errors={})
    rng = np.random.default_rng(0)
    problems: dict = {}   # (B, T) -> the FP4 problem: the bf16 case of a shape reads the same rows, decoded
    variants = [config_fields(part) for part in ";".join(args.config).split(";")] if args.config else [{}]
    for case, split_rows, overrides in itertools.product(args.cases.split(","), map(int, args.split_rows.split(",")),
                                                        variants):
        b, t = CASES[case]
        name = case if split_rows == SPLIT_ROWS else f"{case}/split{split_rows}"
        name += "".join(f"/{k}={v}" for k, v in overrides.items())
        t0 = time.time()
        log(f"\n=== {name}: B={b} T={t} ===")
        try:
            if (b, t) not in problems:
                problems[b, t] = fp4_problem(rng, b, t)
            case_args = decoded_problem(problems[b, t]) if case.endswith("bf16") else problems[b, t]
            trace_dir = os.path.abspath(os.path.join(args.out, "attention_profile_traces", name.replace("/", "_")))
            results["cases"][name] = run_case(case, case_args, b * t, trace_dir, args.profile_ranges, clock,
                                              not args.no_plain, split_rows, not args.no_profile, overrides)
        except Exception:  # keep going: each case answers its own question
            results["errors"][name] = traceback.format_exc()
            log(traceback.format_exc())
        log(f"--- {name}: {time.time() - t0:.1f}s")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_profile_gpu.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    log(f"\nwrote {path}; errors: {list(results['errors'])}")
    return 0 if not results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
