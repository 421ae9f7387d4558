"""End-to-end throughput of the engine on a real-width slice of DeepSeek-V4.1-Flash (issue 7), one process.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/e2e_gpu.py --layers 12 --sections ceil,decode
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/e2e_gpu.py --layers 12 --sections ceil,prefill,xla
    python benchmarks/e2e_gpu.py --tiny          # CPU smoke run: tiny widths, small contexts, same code

The slice (``slice_model.py``) keeps every width of V4.1-Flash and the roles of all its layers, with
random weights in the official stored formats made on the device. Everything runs through the engine's
own jitted programs (``engine.scheduler``): the decode step (model + head + per-row sampler) and the
prefill programs (lower layers, and the layers above the last KV source only when a row of the step is
in its replay window).

Sections:
* ceil: the two ceilings measured in this run: HBM copy (bytes read + written) and a dense bf16 matmul.
* decode: ms/step and tokens/s at each batch (slots) and context; the step's fewest bytes (weights it
  touches, the routed experts expected under uniform routing, KV and index-K rows per slot) over the
  step time, as a fraction of the copy bandwidth. The cache is synthetic (random stored values, rings
  holding the last W positions): attention, the indexers and top-k do their full work.
* prefill: one prompt of each length, chunked, through ``Scheduler.run`` (max_tokens=1), with and
  without bounded replay: tokens/s, and matmul + attention-core FLOPs over time as a fraction of the
  dense matmul rate.
  The step is the engine's: its model program, then the sampler's programs its plan picks
  (``Scheduler.decode_step``; the rows use top-p and no top-k and report no top-n logprobs, so the
  top-k search and the top-20 are skipped).
* fullsampler: the decode row at --profile-batch and the first context with the sampler's plan forced
  to run every program (``SamplerPlan()``): what the plan saves, against the decode section's row.
* searchbits: the same row with the searches settling 4 bits a pass (8 passes of 15 masked sums)
  instead of 2 (16 of 3), on the rows' own plan.
* profile: one decode step (at --profile-batch and the first context) timed per kernel by CUPTI,
  largest first, each XLA kernel with the jax op it came from (GPU only). On jax 0.11.2 the list missed
  most of the step (38 of 169 ms; NOTES.md): read it against the timeline section.
  The model program only (the sampler's later programs are not in it).
* experts: the distinct routed experts the decode step's own (random-weight) routing touches in each
  layer, at --profile-batch and the first context, against uniform routing's count, which the decode
  rows' bytes assume; and the step's bytes under its own routing (a diagnostic compile of the step).
* host: the host's time inside a decode step at --profile-batch and the first context, by program,
  against a jitted no-op over the same arguments, and the step's largest Python functions (cProfile).
* timeline: the same step (the engine's compiled programs, no second compile) under jax.profiler only:
  wall ms/step against GPU busy time, the longest idle gaps, GPU time by XLA program and by kernel.
* ptimeline: the prefill of the last --prompts length (replay off: every chunk runs every layer) under
  jax.profiler, after a warm-up compile: GPU busy time against wall time, and busy time by kernel name.
  With ``E2E_HLO_DUMP=DIR XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=.*prefill.*"`` each
  kernel is shown with the jax op it came from (``.*decode.*`` does the same for the timeline section).
* pattn: the prefill of the last --prompts length at the first --chunk, replay off, once per --pattn
  variant, each the defaults with one thing set back to its form before 2026-12-06: ``fp4-rows-split320``
  (the attention kernel's FP4 variant with two splits a query, ``Numerics.attention_fp4_rows="always"``,
  ``attention_prefill_split_rows=0``), ``fp4-rows`` or ``split320`` (one of the two), ``f32-dense`` (the
  dense linears as a float32 dot + convert, ``dense_bf16_out=False``), ``halves`` (the attention
  kernel's schedule before session 34, ``Numerics.attention_schedule="halves"``; the split320 variants
  take it too: the seesaw needs whole pairs of 64-row blocks) or ``seesaw`` (the default since session
  34, ``"seesaw-prefill"``): to compare with the prefill section's replay-off row on the same machine.
* pswigluq: the prefill of the last --prompts length at the first --chunk, replay off, with the other
  setting of ``Numerics.expert_swiglu_quant`` (the activation quantizer of h in the SwiGLU epilogue, or
  in XLA after it; ``--swiglu-quant`` sets the run's own): the A/B against the prefill section's row.
* ptopk: the prefill of the last --prompts length at the first --chunk, replay off, with the indexer's
  bisection top-k on whole rows (``without_topk_prefilter``: no candidate list): the A/B of
  ``select_on_candidates`` against the prefill section's replay-off rows, in the same process (the
  compiled programs are cleared before and after, so each form compiles its own).
* pcandsort: the prefill of the last --prompts length at the first --chunk, replay off, with the
  candidate pool's block mask built by a stable sort and a scatter of its picks (``sorted_top_mask``,
  the form before session 32) instead of the bisection's mask: the A/B against the prefill section's
  replay-off row, in the same process (the same blocks, so the same bits).
* pswiglu: the prefill of the last --prompts length at the first --chunk, replay off, with the other
  setting of ``Numerics.expert_swiglu_epilogue`` (the routed experts' SwiGLU in the w1/w3 launch's
  epilogue, or in XLA after it; ``--swiglu-epilogue`` sets the run's own): the A/B against the prefill
  section's replay-off row, in the same process.
* nographs: the decode row at --profile-batch and the first context with XLA's command buffers off
  (``xla_gpu_enable_command_buffer=""``: every kernel launched on its own instead of one CUDA graph per
  program, which XLA re-records whenever a buffer it holds moved, e.g. each step's new inputs).
* bf16experts: the decode row at --profile-batch and the first context with the FP4 experts' kernel
  operands in bf16 (``Numerics.expert_operands="bf16"``): the A/B of the E4M3 form on one machine.
* w13two: the decode row at --profile-batch and the first context with the routed experts' w1 and w3
  as two grouped GEMM launches (``Numerics.expert_w13_launch=False``) instead of one: the A/B on one
  machine (same bits).
* decidx: the decode row at --profile-batch and the first context with the other setting of
  ``Numerics.decode_index_kernel`` (a decode step's index scores on the Pallas decode kernel, or XLA's
  dot and head-sum fusion): the A/B on one machine (other bits: the first-step digests may differ).
* decfp4: the decode row at --profile-batch and the first context with the other setting of
  ``Numerics.decode_index_fp4`` (the decode index kernel's FP4 form over the cache as stored, or XLA's
  decode of the cache then the bf16 kernel): the A/B on one machine (other bits: the digests may differ).
* dectiles: the decode row at --profile-batch and the first context with ``Numerics.decode_index_tiles``
  at --decode-index-tiles-ab (the streamed decode index-score form): the A/B on one machine (same bits).
* expf32: the decode row at --profile-batch and the first context with the expert GEMMs' results kept
  in float32 (``Numerics.expert_outputs_f32``, the model before session 37) instead of rounded to bf16
  as the reference writes them: the A/B of that rounding on one machine (other bits).
* pexpf32: the same for the prefill of the last --prompts length at the first --chunk, replay off.
* pdl: the decode row at --profile-batch and the first context with the Mosaic GPU kernels (grouped
  GEMM, attention, Sinkhorn) under programmatic dependent launch (``Numerics.kernel_pdl``): the A/B on
  one machine (same bits: the first step's token digest must match the decode row's).
* densexla: with ``--dense-kernel`` on or decode, the decode row at --profile-batch and the first
  context with the dense FP8 linears as XLA's bf16 dots (``Numerics.dense_kernel="off"`` on bf16-held
  weights, the engine's other form): the A/B of the dense kernel on one machine.
* gatherattn: the decode row at --profile-batch and the first context with the attention's selected
  FP4 rows gathered and decoded by XLA for the bf16 kernel (``Numerics.attention_fp4_rows=
  "gather-decode"``) instead of the FP4 variant: the A/B on one machine (same bits as "never").
* unroll: the decode step at --profile-batch and the first context with the mHC Sinkhorn rounds in
  XLA as a while loop (``kernels`` "sinkhorn=xla", ``sinkhorn_unroll=False``: one host round trip per
  iteration), to compare with the decode section's row for the same shape (on Hopper the rounds run in
  the Sinkhorn kernel since 2026-12-05; before, XLA's unrolled rounds).
* xla: the decode step with ``Numerics.kernels="xla"`` (the model's own XLA code: float32 attention,
  dequantize-and-gather experts) at the small batches where its gathered expert weights fit: the
  XLA-only path, as a ratio to the kernel path.
Each case records compile time (first call) and peak device memory. Results go to $OUT/e2e_gpu.json.
Compiled programs go to jax's persistent cache (``--compile-cache``, default ``.jax_cache`` in the repo):
a later run of the same code on the same machine loads them, and its compile events then say "cache
hit"; time true compiles with ``--compile-cache none``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
# jax's default pool is 75 % of the GPU (104 of 139 GiB on the H200). The 12-layer slice holds 88.7 GiB
# of weights and its 2048-token prefill peaked at 94.1 GiB (2026-12-04, session 12), so a 4096-token
# chunk (~2x the temporaries) would nearly fill that pool. Set before jax starts its backend; the
# environment still overrides it.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from deepinfer_jax.compile_cache import autotune_dir, enable_compile_cache  # noqa: E402
from deepinfer_jax.config import AttnMode  # noqa: E402
from deepinfer_jax.engine.sampling import SamplerPlan, SamplingParams, seed_words, set_row  # noqa: E402
from deepinfer_jax.engine.scheduler import EngineConfig, Request, Scheduler  # noqa: E402
from deepinfer_jax.engine.token_map import compressed_token_map  # noqa: E402
from deepinfer_jax.engine.tokenizer import Tokenizer  # noqa: E402
from deepinfer_jax.model.dense_fp8 import parse_linear_names, prepare_dense_fp8  # noqa: E402
from deepinfer_jax.model.linear import dequantize_dense_fp8  # noqa: E402
from deepinfer_jax.model.mhc import prepare_stream_dots  # noqa: E402
from deepinfer_jax.model.moe import experts_run_kernel, prepare_experts_for_kernel  # noqa: E402
from deepinfer_jax.model.numerics import Numerics  # noqa: E402
from slice_model import (TOKENIZER_DIR, decode_bytes, expected_active_experts, matmul_macs_per_token,  # noqa: E402
                         random_params, slice_config, synthetic_cache, tree_bytes)

RESULTS: dict = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "sections": {}}
TABLE: list[str] = []


def log(*a):
    print(*a, flush=True)


class compile_log:
    """Within ``with compile_log() as events``: jax's compile stages (trace, lowering to MLIR, which
    includes building the Mosaic GPU kernels, and XLA's backend compile with its autotuning) of at least
    ``min_s`` seconds, each logged as it ends. So a call cut off by its time limit in a compile still shows
    which stages finished (chunk 4096's prefill did not compile in 230 s on 2026-12-04)."""

    def __init__(self, min_s: float = 1.0):
        self.min_s, self.events = min_s, []

    def _on(self, event: str, secs: float, **kw):
        if secs >= self.min_s and event.startswith("/jax/core/compile/"):
            stage = event.rsplit("/", 1)[-1].removesuffix("_duration")
            self.events.append(dict(stage=stage, fun=str(kw.get("fun_name", "")), seconds=secs))
            log(f"  compile: {stage} {secs:.1f} s ({kw.get('fun_name', '')})")

    def _on_event(self, event: str, **kw):
        # a hit means the stage times above are a load from --compile-cache, not a compile
        kind = {"/jax/compilation_cache/cache_hits": "hit", "/jax/compilation_cache/cache_misses": "miss"}.get(event)
        if kind:
            self.events.append(dict(stage=f"cache {kind}"))
            log(f"  compile: persistent cache {kind}")

    def __enter__(self) -> list:
        jax.monitoring.register_event_duration_secs_listener(self._on)
        jax.monitoring.register_event_listener(self._on_event)
        return self.events

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on)
        jax.monitoring.unregister_event_listener(self._on_event)
        return False


class python_profile:
    """With ``E2E_PROFILE_COMPILE=1``: cProfile over the block (a program's first call), the top functions
    by own and by cumulative time logged and written to OUT/compile_profile_<name>.txt. Lowering to MLIR
    took ~61-64 s on the GPU hosts at 4 and at 12 layers until 2026-12-05: nearly all of it Mosaic GPU's
    layout inference, which runs once per distinct kernel (14 s of it the Sinkhorn kernel's unrolled
    rounds, since rolled; 30 s on the H200 after). cProfile slows Python ~1.5-2x, so a profiled call's
    compile times are not comparable."""

    def __init__(self, name: str):
        self.name, self.prof = name, None

    def __enter__(self):
        if os.environ.get("E2E_PROFILE_COMPILE") == "1":
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()
        return self

    def __exit__(self, *exc):
        if self.prof is None:
            return False
        import io
        import pstats

        self.prof.disable()
        buf = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(self.prof, stream=buf).sort_stats(key).print_stats(30)
        text = buf.getvalue()
        out = Path(RESULTS.get("out_dir") or ".")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"compile_profile_{self.name}.txt").write_text(text)
        log(text[:6000])
        return False


def with_segment_rows(numerics: Numerics, text: str) -> Numerics:
    """numerics with ``sinkhorn_segment_rows`` from a ``--sinkhorn-segment-rows`` value: an int, 'none'
    (one chain at every size) or 'default' (unchanged)."""
    if text == "default":
        return numerics
    return dataclasses.replace(numerics, sinkhorn_segment_rows=None if text == "none" else int(text))


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def pool_bytes() -> int | None:
    """The device memory jax's allocator may use (XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _count_files(d: Path) -> int:
    return sum(1 for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0


def _copy_autotune(cache: Path, dest: Path, limit: int = 32 << 20) -> int:
    """Copy the cache's autotuning results (not the compiled programs: too large to carry) -> files copied."""
    import shutil

    src = autotune_dir(cache)
    files = [p for p in src.rglob("*") if p.is_file()] if src.is_dir() else []
    if not files or sum(p.stat().st_size for p in files) > limit:
        return 0
    shutil.copytree(src, dest, dirs_exist_ok=True)
    return len(files)


def save(out: Path | None = None):
    """Write RESULTS to out (recorded in RESULTS["out_dir"] at the first call; later calls may omit it)."""
    if out is not None:
        RESULTS["out_dir"] = str(out)
    (Path(RESULTS["out_dir"]) / "e2e_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def section(name, fn, out, *a):
    t = time.time()
    log(f"\n=== {name} ===")
    try:
        RESULTS["sections"][name] = fn(*a)
    except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
        RESULTS["sections"][name] = {"error": f"{type(e).__name__}: {e}"[:3000]}
        traceback.print_exc()
    log(f"--- {name}: {time.time() - t:.1f} s")
    save(out)


def timed_ms(fn, reps: int = 10) -> float:
    """Median ms of ``reps`` calls, each blocked on (fn returns what to block on)."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


# ---- ceilings ------------------------------------------------------------------------------------------

def chained_ms(fn, x, reps: int = 10) -> tuple[float, float]:
    """(slope, single): ms per call of ``x = fn(x)`` queued back to back, as the slope between ``reps``
    and ``2 * reps`` calls (the way the decode rows are timed, so a ceiling and the rows it divides carry
    the same fixed costs: none), and the median of single blocked calls (the ceilings before 2026-12-05,
    which also held each call's dispatch and sync: 3.26-3.84 TB/s of copy on the H200s against
    4.29-4.31 from CUPTI)."""
    single = timed_ms(lambda: fn(x), reps)

    def run(n: int, x):
        x = jax.block_until_ready(fn(x))
        t = time.perf_counter()
        for _ in range(n):
            x = fn(x)
        jax.block_until_ready(x)
        return time.perf_counter() - t, x

    short, x = run(reps, x)
    long, x = run(2 * reps, x)
    return (long - short) * 1e3 / reps, single


def ceilings(tiny: bool):
    """HBM copy (bytes read + written) and a dense bf16 matmul, each timed by ``chained_ms``'s slope."""
    n = (1 << 20) if tiny else (1 << 30)
    a = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    f = jax.jit(lambda v: v + 1.0)   # (a multiply by 1 would be folded away)
    ms, ms_single = chained_ms(f, a)
    copy, copy_single = 2 * a.nbytes / (ms * 1e-3), 2 * a.nbytes / (ms_single * 1e-3)
    m = 512 if tiny else 8192
    x = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    # scaled so a chain of products keeps unit-sized entries (a tensor core's speed does not depend on
    # the values, but the chain should not turn into infinities and NaNs either way)
    y = (jax.random.normal(jax.random.key(2), (m, m), jnp.float32) / np.sqrt(m)).astype(jnp.bfloat16)
    g = jax.jit(lambda p, q: p @ q)   # y an argument, not a constant baked into the program
    ms, ms_single = chained_ms(lambda p: g(p, y), x)
    dense, dense_single = 2 * m ** 3 / (ms * 1e-3), 2 * m ** 3 / (ms_single * 1e-3)
    RESULTS["copy_Bps"], RESULTS["dense_flops"] = copy, dense
    TABLE.append(f"ceilings: copy {copy / 1e12:.2f} TB/s, dense bf16 {dense / 1e12:.0f} TFLOP/s (single blocked "
                 f"calls: {copy_single / 1e12:.2f} TB/s, {dense_single / 1e12:.0f} TFLOP/s)")
    log(TABLE[-1])
    return {"copy_TBps": copy / 1e12, "dense_TFLOPs": dense / 1e12,
            "copy_TBps_single_calls": copy_single / 1e12, "dense_TFLOPs_single_calls": dense_single / 1e12}


# ---- the engine pieces ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Model:
    cfg: object
    params: dict
    tok: Tokenizer
    token_map: np.ndarray
    stored: dict    # the params' shapes and dtypes as the checkpoint stores them (before load-time prep)


def scheduler(m: Model, numerics: Numerics, slots: int, max_len: int, chunk: int, bounded_replay: bool = True,
              xla_options: tuple = ()):
    """The engine's scheduler with this run's XLA options (``--xla-option``) and ``xla_options`` over them."""
    options = {**dict(RESULTS.get("xla_options", ())), **dict(xla_options)}
    return Scheduler(m.params, m.cfg, m.tok, m.token_map, numerics,
                     EngineConfig(max_slots=slots, max_len=max_len, chunk_size=min(chunk, max_len),
                                  bounded_replay=bounded_replay,
                                  excess_precision=bool(RESULTS.get("excess_precision", False)),
                                  xla_options=tuple(sorted(options.items()))))


def decode_inputs(sch: Scheduler, context: int) -> dict:
    """Every slot generating at position ``context`` with a sampled (top-p) row."""
    s = sch.ec.max_slots
    inp = sch._common_inputs(1)
    inp["positions"][:, 0] = context
    inp["take_sample"][:] = True
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95)
    for b in range(s):
        inp["seeds"][b] = seed_words(1000 + b)
        inp["sample_positions"][b] = context + 1
        set_row(inp["sampling"], b, sp)
    return inp


def fill_for_decode(sch: Scheduler, m: Model, numerics: Numerics, ctx: int) -> dict:
    """Give every slot a synthetic cache at context ``ctx`` and return that step's inputs."""
    sch.state["cache"] = None  # free the old cache before the new one is made
    sch.state["cache"] = synthetic_cache(m.cfg, sch.ec.max_slots, sch.ec.max_len, ctx, numerics)
    return decode_inputs(sch, ctx)


def run_decode(m: Model, numerics: Numerics, batches, contexts, max_len: int, label: str, steps: int = 10,
               sampler_plan: SamplerPlan | None = None, xla_options: tuple = ()):
    """sampler_plan: force the sampler's plan (``Scheduler.sampler_plan``; None: the engine's per-step
    choice, which for these rows, top-p, no top-k and no top-n logprobs, skips the top-k search and the
    top-20). xla_options: more XLA options for the engine's programs (``EngineConfig.xla_options``)."""
    rows = []
    copy = RESULTS.get("copy_Bps")
    for b in batches:
        try:
            rows += _decode_batch(m, numerics, b, contexts, max_len, label, steps, copy, sampler_plan, xla_options)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest batch: keep the others
            traceback.print_exc()
            rows.append(dict(batch=b, error=f"{type(e).__name__}: {e}"[:500]))
            TABLE.append(f"{label} decode B={b:4d}: {type(e).__name__} {str(e)[:120]}")
        RESULTS["sections"][f"{label}-decode (partial)"] = rows
        save()  # a device call cut off by its time limit in a later compile keeps these rows (2026-12-04)
    return rows


def engine_loop_ms(step, steps: int) -> dict:
    """ms per step as the engine's loop runs (queue step N+1, then wait for step N), from the slope between
    a run of ``steps`` steps and one of ``2 * steps``: the first launch's fixed latency cancels, and a host
    that cannot queue a step within the GPU's time for the one before shows up as it does in the engine.
    Also the host's own time per step inside the jitted call (``queue_ms``): where it nears the step time,
    the loop is host-bound.

    Session 16's timer queued every step and started its clock when the first one finished; that moment
    is only seen after the queuing loop returns, so every step the GPU ran while the host was still
    queuing fell outside the clock (2026-12-05, H200: 20.4 ms/step from it against 27.1 from an idle GPU)."""

    def run(n: int) -> tuple[float, float]:
        jax.block_until_ready(step())
        queued = 0.0
        t0 = time.perf_counter()
        prev = None
        for _ in range(n):
            t = time.perf_counter()
            cur = step()
            queued += time.perf_counter() - t
            if prev is not None:
                jax.block_until_ready(prev)
            prev = cur
        jax.block_until_ready(prev)
        return time.perf_counter() - t0, queued / n

    short, q_short = run(steps)
    long, q_long = run(2 * steps)
    return dict(ms=(long - short) * 1e3 / steps, queue_ms=(q_short + q_long) / 2 * 1e3)


def _decode_batch(m: Model, numerics: Numerics, b: int, contexts, max_len: int, label: str, steps: int, copy,
                  sampler_plan: SamplerPlan | None = None, xla_options: tuple = ()):
    rows = []
    sch = scheduler(m, numerics, b, max_len, 1, xla_options=xla_options)
    sch.sampler_plan = sampler_plan
    try:
        compile_s = None
        for ctx in contexts:
            inp = fill_for_decode(sch, m, numerics, ctx)

            def step():
                return sch.decode_step(inp)["token"]

            if compile_s is None:
                t = time.time()
                with compile_log() as compile_events, python_profile(f"decode_b{b}"):
                    first = jax.block_until_ready(step())
                compile_s = time.time() - t
            else:
                first = jax.block_until_ready(step())
            # the first step's tokens from the same filled state: an A/B row of a form with the same bits
            # (w13two, pdl) must show the decode row's digest
            first_sha = hashlib.sha1(np.asarray(first).tobytes()).hexdigest()[:16]
            t = time.perf_counter()
            for _ in range(steps):
                tok = step()
            jax.block_until_ready(tok)
            ms_cold = (time.perf_counter() - t) * 1e3 / steps
            loop = engine_loop_ms(step, steps)
            ms = loop["ms"]
            need = decode_bytes(m.cfg, m.stored, b, ctx, numerics.kv_quant)
            rec = dict(batch=b, context=ctx, ms_per_step=ms, ms_per_step_from_idle=ms_cold,
                       host_queue_ms_per_step=loop["queue_ms"],
                       tokens_per_s=b / (ms * 1e-3), compile_s=compile_s,
                       compile_events=compile_events, bytes=need, peak_bytes=peak_bytes(),
                       first_step_tokens_sha1=first_sha)
            if copy:
                rec["hbm_fraction"] = need["total"] / (ms * 1e-3) / copy
            rows.append(rec)
            line = (f"{label} decode B={b:4d} ctx={ctx:6d}: {ms:8.2f} ms/step {rec['tokens_per_s']:9.1f} tok/s "
                    f"bytes {need['total'] / 1e9:6.2f} GB")
            if copy:
                line += f" = {rec['hbm_fraction']:.1%} of copy BW"
            line += f" (from an idle GPU {ms_cold:.2f} ms/step; host queues a step in {loop['queue_ms']:.2f} ms;"
            line += f" first step's tokens {first_sha})"
            log(line + f" (first call {compile_s:.0f} s)")
            TABLE.append(line)
    finally:
        sch.state = None  # the caches go now, not with a traceback that may outlive this call
    return rows


def _hlo_sites(hlo_text: str) -> dict[str, str]:
    """HLO instruction name (dots as underscores, as kernel names spell them) -> its op_name metadata."""
    sites = {}
    for line in hlo_text.splitlines():
        line = line.strip()
        if not line.startswith("%") and " = " not in line:
            continue
        name = line.lstrip("%").split(" ", 1)[0]
        at = line.find('op_name="')
        if at >= 0:
            sites[name.replace(".", "_")] = line[at + 9:line.find('"', at + 9)]
    return sites


def run_profile(m: Model, numerics: Numerics, b: int, ctx: int, max_len: int, top: int = 40):
    """Per-kernel GPU time of one decode step (CUPTI), largest first, each XLA kernel with the jax op it
    came from: where the step's time goes."""
    from jax.experimental.mosaic.gpu import profiler

    sch = scheduler(m, numerics, b, max_len, 1)
    try:
        inp = fill_for_decode(sch, m, numerics, ctx)
        # The engine's decode program donates its state; profiling calls it repeatedly on one state.
        step = jax.jit(sch._decode.__wrapped__, compiler_options=sch.compiler_options or None).lower(
            m.params, sch.state, inp, sch.consts).compile()
        sites = _hlo_sites(step.as_text())
        if jax.devices()[0].platform != "gpu":
            log("profile: CUPTI needs a GPU; compiled the step and traced it only")
            return dict(batch=b, context=ctx, hlo_sites=len(sites), timeline=_timeline(sch, m, inp))
        _, per_iter = profiler.measure(step, aggregate=False, iterations=3)(m.params, sch.state, inp, sch.consts)
        timeline = _timeline(sch, m, inp)
    finally:
        sch.state = None
    by_name: dict[str, float] = {}
    for name, ms in per_iter[-1]:
        by_name[name] = by_name.get(name, 0.0) + ms
    total = sum(by_name.values())
    rows = []
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1]):
        key = name.split("(")[0]
        site = sites.get(key) or next((v for k, v in sites.items() if key.startswith(k) or k.startswith(key)), "")
        rows.append(dict(kernel=name[:120], ms=ms, share=ms / total, site=site[-160:]))
    log(f"decode step B={b} ctx={ctx}: {total:.2f} ms of kernels, {len(by_name)} distinct kernels")
    for r in rows[:top]:
        log(f"  {r['ms']:8.3f} ms {r['share']:6.1%}  {r['kernel'][:60]:60s} {r['site']}")
    TABLE.append(f"profile decode B={b} ctx={ctx}: {total:.2f} ms of kernels; top: "
                 + "; ".join(f"{r['kernel'][:40]} {r['share']:.0%}" for r in rows[:5]))
    return dict(batch=b, context=ctx, total_ms=total, kernels=rows[:200], timeline=timeline)


def run_host(m: Model, numerics: Numerics, b: int, ctx: int, max_len: int, calls: int = 20):
    """Where the host's time in a decode step goes (the engine loop's ``queue_ms``): each call timed
    alone from an idle GPU (median ms of ``calls``): the whole step, the model program, the sampler's
    programs, and a jitted no-op over the model program's arguments (what dispatching those pytrees
    costs); and the largest Python functions of the whole step under cProfile (C++ dispatch shows as
    the time of its Python caller)."""
    import cProfile
    import io
    import pstats

    sch = scheduler(m, numerics, b, max_len, 1)
    try:
        inp = fill_for_decode(sch, m, numerics, ctx)
        for _ in range(2):      # compile every program the step runs
            jax.block_until_ready(sch.decode_step(inp))

        def median_ms(call) -> float:
            times = []
            for _ in range(calls):
                jax.block_until_ready(sch.state)
                t = time.perf_counter()
                out = call()
                times.append(time.perf_counter() - t)
                jax.block_until_ready(out)
            return float(np.median(times) * 1e3)

        def model_only():
            with jax.threefry_partitionable(True):
                sch.state, res = sch._decode(sch.params, sch.state, inp, sch.consts)
            return res

        pre = model_only()["pre"]
        no_logprobs = np.zeros(sch.ec.max_slots, bool)
        noop = jax.jit(lambda p, st, i, c: i["take_sample"])
        jax.block_until_ready(noop(sch.params, sch.state, inp, sch.consts))
        rec = dict(batch=b, context=ctx, calls=calls,
                   leaves=dict(params=len(jax.tree.leaves(sch.params)), state=len(jax.tree.leaves(sch.state)),
                               inputs=len(jax.tree.leaves(inp)), consts=len(jax.tree.leaves(sch.consts))),
                   step_ms=median_ms(lambda: sch.decode_step(inp)["token"]),
                   model_program_ms=median_ms(model_only),
                   sampler_ms=median_ms(lambda: sch._sample(pre, inp, no_logprobs)),
                   noop_same_args_ms=median_ms(lambda: noop(sch.params, sch.state, inp, sch.consts)))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            jax.block_until_ready(sch.decode_step(inp)["token"])
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        rec["profile_top"] = buf.getvalue()[-6000:]
        log(f"host B={b}: step {rec['step_ms']:.2f} ms = model program {rec['model_program_ms']:.2f} + sampler "
            f"{rec['sampler_ms']:.2f}; no-op jit over the same arguments {rec['noop_same_args_ms']:.2f} ms "
            f"({rec['leaves']})")
        TABLE.append(f"host B={b:4d} ctx={ctx:6d}: call {rec['step_ms']:.2f} ms (model {rec['model_program_ms']:.2f}, "
                     f"sampler {rec['sampler_ms']:.2f}, no-op dispatch {rec['noop_same_args_ms']:.2f})")
        return rec
    finally:
        sch.state = None


def run_experts(m: Model, numerics: Numerics, b: int, ctx: int, max_len: int, steps: int = 3):
    """How many distinct routed experts the decode step's own routing touches in each layer, against the
    number uniform routing would (``decode_bytes``' count): the step's routing comes from random router
    weights. A diagnostic compile of the same step with the routed expert ids sent to the host
    (``jax.debug.callback``), run ``steps`` times from the decode section's inputs (the slots' tokens
    move on from the first step); the last step counts. -> per-layer counts and the step's expert bytes
    under its own routing."""
    from deepinfer_jax.engine import scheduler as scheduler_module
    from deepinfer_jax.model import moe as moe_module

    seen: list[np.ndarray] = []
    original = moe_module.routed_experts

    def counted(p_exp, x_md, ids_mk, *args, **kwargs):
        jax.debug.callback(lambda ids: seen.append(np.asarray(ids)), ids_mk, ordered=True)
        return original(p_exp, x_md, ids_mk, *args, **kwargs)

    moe_module.routed_experts = counted
    scheduler_module._compiled_steps.cache_clear()      # trace the step again, with the callback
    try:
        sch = scheduler(m, numerics, b, max_len, 1)
        inp = fill_for_decode(sch, m, numerics, ctx)
        for _ in range(steps):
            seen.clear()
            jax.block_until_ready(sch.decode_step(inp))
        sch.state = None
    finally:
        moe_module.routed_experts = original
        scheduler_module._compiled_steps.cache_clear()   # later sections compile the step without it
    cfg = m.cfg
    per_layer = [int(np.unique(ids).size) for ids in seen]
    uniform = expected_active_experts(cfg.n_routed_experts, b * cfg.num_experts_per_tok)
    need = decode_bytes(cfg, m.stored, b, ctx, numerics.kv_quant)
    own = decode_bytes(cfg, m.stored, b, ctx, numerics.kv_quant, active_experts=per_layer)
    rec = dict(batch=b, context=ctx, distinct_experts_per_layer=per_layer, uniform_expected=uniform,
               expert_bytes_uniform=need["experts"], expert_bytes_own_routing=own["experts"],
               total_bytes_own_routing=own["total"])
    TABLE.append(f"experts B={b:4d} ctx={ctx:6d}: distinct per layer {per_layer} (uniform routing ~{uniform:.0f}); "
                 f"step bytes {rec['total_bytes_own_routing'] / 1e9:.2f} GB on its own routing against "
                 f"{need['total'] / 1e9:.2f} GB on uniform routing")
    log(TABLE[-1])
    return rec


def run_timeline(m: Model, numerics: Numerics, b: int, ctx: int, max_len: int):
    """``_timeline`` alone: the engine's own decode program (compiled once per shape, shared with the
    decode section), no second compile."""
    sch = scheduler(m, numerics, b, max_len, 1)
    try:
        return dict(batch=b, context=ctx, **_timeline(sch, m, fill_for_decode(sch, m, numerics, ctx)))
    finally:
        sch.state = None


def _timeline(sch: Scheduler, m: Model, inp: dict, steps: int = 3) -> dict:
    """The engine's own (donating) decode step under jax.profiler: wall time per step against the time
    the GPU is busy, and the longest idle gaps with the GPU events around them (host-bound waits)."""
    for _ in range(2):  # the first call compiles
        jax.block_until_ready(sch.decode_step(inp))

    def run():
        for _ in range(steps):
            out = sch.decode_step(inp)
        jax.block_until_ready(out)

    return _traced(run, steps, "step", _sites_from_dump(os.environ.get("E2E_HLO_DUMP"), "decode"), "decode")


def _sites_from_dump(dump_dir: str | None, module: str) -> dict[str, str]:
    """Kernel name -> jax op_name, from the optimized HLO that ``--xla_dump_to`` wrote for modules whose
    name holds ``module`` (a trace names XLA's kernels by HLO instruction, not by the jax op). Each
    module read is also kept beside the results (``_keep_hlo``)."""
    if not dump_dir or not Path(dump_dir).is_dir():
        return {}
    sites: dict[str, str] = {}
    for f in sorted(Path(dump_dir).glob(f"*{module}*after_optimizations.txt")):
        text = f.read_text()
        sites.update(_hlo_sites(text))
        _keep_hlo(f.name, text)
    return sites


def _keep_hlo(name: str, text: str, limit: int = 16 << 20):
    """The optimized HLO beside the results (gzipped; the device returns files under 16 MiB), so the
    fusions a trace names can be read after the machine is gone."""
    import gzip

    out = Path(RESULTS.get("out_dir") or ".")
    data = gzip.compress(text.encode(), 6)
    if len(data) <= limit:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"hlo_{name.split('.')[0][:40]}.txt.gz").write_bytes(data)


def _site_of(name: str, sites: dict[str, str]) -> str:
    """The model site of a kernel name from the step's HLO dump; "" for another program's kernel (named
    "... @program": its fusion names repeat the step's, which named the top-p search's reduce a MoE
    site in session 24's table) and for names the dump does not know."""
    if " @" in name:
        return ""
    key = name.split("(")[0]
    return sites.get(key) or next((v for k, v in sites.items() if key.startswith(k + "_")), "")


def _kernel_key(event) -> str:
    """The event's name, with the launch shape for Pallas kernels: every Mosaic GPU kernel is named
    ``entry_mosaic_gpu_kernel``, so the grid and block tell the attention from each expert GEMM."""
    if "mosaic" not in event.name:
        return event.name
    stats = dict(event.stats)
    details = " ".join(str(v) for k, v in stats.items() if "kernel_details" in k or k in ("grid", "block"))
    shape = " ".join(t for t in details.split() if t.startswith(("grid", "block", "dynamic")))
    return f"{event.name} [{shape or details[:80]}]"


def _event_module(event) -> str:
    """The XLA program (HLO module) a GPU event belongs to, where the trace says ('' otherwise)."""
    return str(dict(event.stats).get("hlo_module", ""))


def _traced(run, per: int, unit: str, sites: dict[str, str] | None = None, site_modules: str = "\0") -> dict:
    """run() under jax.profiler -> wall ms and GPU busy ms per ``unit`` (run does ``per`` of them), the
    longest idle gaps between GPU events, the busy time by XLA program, and by kernel name (every launch
    in the trace, unlike the CUPTI list), each with the jax op it came from where ``sites`` knows it.
    site_modules: a substring of the names of the programs whose HLO ``sites`` came from; kernels of
    other programs are listed with their program's name (the default matches none)."""
    import tempfile

    from jax.profiler import ProfileData

    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    with jax.profiler.trace(tmp):
        run()
    wall_ms = (time.perf_counter() - t0) * 1e3 / per
    path = next(Path(tmp).rglob("*.xplane.pb"))
    events = []
    for plane in ProfileData.from_file(str(path)).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            events += [(e.start_ns, e.end_ns, _kernel_key(e), line.name, _event_module(e)) for e in line.events]
    events.sort()
    if not events:
        return dict(wall_ms=wall_ms, note="no GPU events in the trace (not a GPU)")
    busy, gaps, end, prev = 0, [], events[0][0], events[0]
    kinds: dict[str, float] = {}
    by_name: dict[str, list] = {}
    by_module: dict[str, float] = {}
    for ev in events:
        start, stop, name, line, module = ev
        by_module[module] = by_module.get(module, 0.0) + (stop - start) / 1e6 / per
        if module and site_modules not in module:
            name = f"{name} @{module}"   # another program's fusion names repeat the step's: keep them apart
        agg = by_name.setdefault(name.split("(")[0][:160], [0.0, 0])
        agg[0] += (stop - start) / 1e6 / per
        agg[1] += 1
        if start > end:
            gaps.append(((start - end) / 1e6, prev[2][:60], name[:60]))
        busy += max(0, stop - max(start, end))
        if stop > end:
            end, prev = stop, ev
        # (line names list every kind a stream carries, so classify by the event's own name)
        kind = "memcpy/memset" if name.startswith(("Memcpy", "Memset", "memcpy", "memset")) else "kernel"
        kinds[kind] = kinds.get(kind, 0.0) + (stop - start) / 1e6
    span_ms = (end - events[0][0]) / 1e6
    gaps.sort(reverse=True)
    log(f"timeline: {wall_ms:.2f} ms/{unit} wall, GPU span {span_ms / per:.2f} ms/{unit}, busy {busy / 1e6 / per:.2f} "
        f"ms/{unit}, by kind {({k: round(v / per, 2) for k, v in kinds.items()})}; lines "
        f"{sorted({e[3] for e in events})[:8]}")
    for g in gaps[:15]:
        log(f"  gap {g[0]:8.3f} ms after {g[1]!r} before {g[2]!r}")
    log(f"GPU time by XLA program (ms/{unit}): " + ", ".join(
        f"{k or '?'} {v:.3f}" for k, v in sorted(by_module.items(), key=lambda kv: -kv[1])))
    sites = sites or {}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:120]
    busy_unit = busy / 1e6 / per
    log(f"timeline by kernel name (ms/{unit}, launches/{unit}, share of busy; {len(sites)} HLO sites known):")
    for name, (ms, n) in top[:40]:
        log(f"  {ms:8.3f} ms {n / per:6.0f}x {ms / busy_unit:6.1%}  {name[:50]:50s} {_site_of(name, sites)[-110:]}")
    return dict(wall_ms=wall_ms, span_ms=span_ms / per, busy_ms=busy_unit, kinds_ms=kinds,
                gaps=gaps[:40], n_events=len(events), by_module_ms=by_module,
                by_name=[dict(kernel=k, ms=v[0], launches=v[1] / per, site=_site_of(k, sites)[-200:])
                         for k, v in top])


def run_prefill_timeline(m: Model, numerics: Numerics, prompt: int, chunk: int, bounded_replay: bool = False):
    """One prompt's prefill (``Scheduler.run``, max_tokens=1) under jax.profiler, after a warm-up that
    compiles the programs: where a prefill's GPU time goes, per prompt (replay off by default, so every
    chunk runs every layer)."""
    rng = np.random.default_rng(1)
    sch = scheduler(m, numerics, 1, prompt + 16, chunk, bounded_replay=bounded_replay)
    sch.run([Request("warm", [int(x) for x in rng.integers(3, 120000, 2 * chunk + 5)], SamplingParams(max_tokens=1))])
    req = Request("traced", [int(x) for x in rng.integers(3, 120000, prompt)], SamplingParams(max_tokens=1))
    sites = _sites_from_dump(os.environ.get("E2E_HLO_DUMP"), "prefill")
    rec = _traced(lambda: sch.run([req]), 1, "prompt", sites, "prefill")
    return dict(prompt=prompt, chunk=chunk, bounded_replay=bounded_replay, **rec)


def attention_core_flops(cfg, prompt: int, replay_from: int) -> float:
    """FLOPs of q.k and p.v over the rows each prompt token attends to (window + selected), every layer;
    the indexers' scoring is left out (reported separately by the kernel benchmarks)."""
    h, d = cfg.num_attention_heads, cfg.head_dim
    last_source = max(cfg.kv_source_layer_ids, default=-1)
    total = 0.0
    pos = np.arange(prompt)
    for lid in range(cfg.num_hidden_layers):
        plan = cfg.layer_plan(lid)
        p = pos if lid <= last_source else pos[replay_from:]
        rows = np.minimum(p + 1, cfg.sliding_window).astype(np.float64)
        if plan.mode is not AttnMode.SWA:
            r = cfg.compress_ratios[plan.kv_source]
            rows += np.minimum((p + 1) // r, cfg.index_topk)
        total += 4.0 * h * d * rows.sum()
    return total


def run_prefill(m: Model, numerics: Numerics, prompts, chunk: int, replay=(True, False), label: str = ""):
    rows = []
    dense = RESULTS.get("dense_flops")
    max_len = max(prompts) + 16
    macs = matmul_macs_per_token(m.cfg, m.stored)   # the checkpoint's names: load-time prep renames leaves
    last_source = max(m.cfg.kv_source_layer_ids)
    upper_share = sum(1 for i in range(m.cfg.num_hidden_layers) if i > last_source) / m.cfg.num_hidden_layers
    rng = np.random.default_rng(0)
    for br in replay:
        sch = scheduler(m, numerics, 1, max_len, chunk, bounded_replay=br)
        t = time.time()  # warm-up: compiles the prefill programs (and the upper one) at this engine shape
        with compile_log() as compile_events:
            # (two chunks and a bit, or what the context holds: a chunk as long as the prompt)
            warm = min(2 * chunk + 5, max_len - 2)
            sch.run([Request("warm", [int(x) for x in rng.integers(3, 120000, warm)],
                             SamplingParams(max_tokens=1))])
        compile_s = time.time() - t
        for n in prompts:
            req = Request(f"p{n}", [int(x) for x in rng.integers(3, 120000, n)], SamplingParams(max_tokens=1))
            skipped0 = sch.skipped_upper
            t = time.perf_counter()
            sch.run([req])
            s = time.perf_counter() - t
            replay_from = max(0, n - m.cfg.sliding_window) if br else 0
            # matmul FLOPs: lower layers on every token, upper layers on the replayed ones (the head on one)
            layer_macs = macs - m.params["head"]["weight"].size
            flops = 2 * (layer_macs * (1 - upper_share) * n + layer_macs * upper_share * (n - replay_from))
            flops += attention_core_flops(m.cfg, n, replay_from)
            rec = dict(prompt=n, chunk=chunk, bounded_replay=br, seconds=s, tokens_per_s=n / s, flops=flops,
                       tflops=flops / s / 1e12, steps_skipping_upper=sch.skipped_upper - skipped0,
                       compile_s=compile_s, compile_events=compile_events, peak_bytes=peak_bytes())
            if dense:
                rec["dense_fraction"] = flops / s / dense
            rows.append(rec)
            line = (f"prefill{' ' + label if label else ''} {n:6d} tok, chunk {chunk}, "
                    f"replay {'on ' if br else 'off'}: {s:7.2f} s "
                    f"{n / s:9.0f} tok/s {rec['tflops']:6.1f} TFLOP/s")
            if dense:
                line += f" = {rec['dense_fraction']:.1%} of dense"
            line += f" (steps skipping upper layers: {rec['steps_skipping_upper']}; warm-up {compile_s:.0f} s"
            if rec["peak_bytes"] and (pool := pool_bytes()):
                line += f"; peak {rec['peak_bytes'] / 2**30:.0f} of {pool / 2**30:.0f} GiB"
            line += ")"
            log(line)
            TABLE.append(line)
            RESULTS["sections"]["prefill (partial)"] = rows
        del sch
    return rows


def with_y_transposed() -> None:
    """Every expert GEMM config the model picks, with the kernel's earlier y^T output (a benchmark-only
    switch: the library's choice stays ``tuned_config``'s)."""
    from deepinfer_jax.model import moe

    tile_config = moe._tile_config
    moe._tile_config = lambda *a: dataclasses.replace(tile_config(*a), out_rows=False)


def with_prefill_chunk_tiles() -> None:
    """The prefill-phase expert GEMMs (``tile_phase`` "prefill": from 96 rows per expert) with the
    "chunk" phase's tiles (64 rows) instead of 128: a benchmark-only A/B of the switch, which
    ``config.CHUNK_ROWS_PER_GROUP`` puts halfway between two measured points. At a chunk-8192 prefill
    (128 rows an expert) 128-row tiles pad ~1.5x, 64-row ones ~1.25x (benchmarks/NOTES.md item -27).
    Any tile gives the same bits."""
    from deepinfer_jax.model import moe
    from pallas_kernels.grouped_gemm.config import CHUNK_ROWS_PER_GROUP, tile_phase

    tile_config = moe._tile_config

    def patched(p_lin, m_rows, numerics, act_block=32):
        g = moe._weight_shape(p_lin)[0]
        if tile_phase(m_rows, g, moe._expert_format(p_lin)) == "prefill":
            m_rows = (CHUNK_ROWS_PER_GROUP[1] - 1) * g     # a chunk-phase row count: its config
        return tile_config(p_lin, m_rows, numerics, act_block)

    moe._tile_config = patched


def no_prefilter_capacity(*args, **kwargs) -> int:
    """``topk.select.prefilter_capacity`` that gives no row a candidate list: the bisection top-k on
    whole rows (``without_topk_prefilter``, the ``ptopk`` section)."""
    return 0


def without_topk_prefilter() -> None:
    """The indexer's bisection top-k on whole rows, without its block-maximum candidate list
    (``pallas_kernels.topk.select.select_on_candidates``): a benchmark-only A/B of the list, which picks
    the same entries, bit for bit."""
    from pallas_kernels.topk import select

    select.prefilter_capacity = no_prefilter_capacity


@contextlib.contextmanager
def patched(module, name: str, value):
    """``module.name`` set to ``value`` for the block, with the engine's compiled programs cleared before
    and after, so the block's sections compile their own (a benchmark-only A/B of a model function)."""
    from deepinfer_jax.engine import scheduler as scheduler_module

    before = getattr(module, name)
    scheduler_module._compiled_steps.cache_clear()
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)
        scheduler_module._compiled_steps.cache_clear()


def sorted_top_mask(scores: jax.Array, k: int) -> jax.Array:
    """``topk.select.top_mask``'s set the way ``indexer.candidate_mask`` built it before session 32: a
    stable descending sort's first k, scattered into a mask where above -inf (the same blocks; the
    ``pcandsort`` section's A/B)."""
    from pallas_kernels.topk.xla import topk_desc

    vals, idx = topk_desc(scores, min(k, scores.shape[-1]))
    lead = jnp.indices(idx.shape[:-1], sparse=True)
    return jnp.zeros(scores.shape, bool).at[(*[a[..., None] for a in lead], idx)].set(vals > -jnp.inf)


def with_decode_block_m(block_m: int) -> None:
    """The decode-phase expert GEMMs (``tile_phase`` "decode": up to 12 rows per expert) with ``block_m``
    token rows per tile instead of the tuned table's (8 below 2 rows per expert, else 16): a
    benchmark-only A/B of the tile height (any tile gives the same bits). 8 against 16 at B=64 decided
    the table's 8-row tiles (2026-12-05: 26.86 vs 28.76 ms/step)."""
    from deepinfer_jax.model import moe
    from pallas_kernels.grouped_gemm.config import tile_phase

    tile_config = moe._tile_config

    def patched(p_lin, m_rows, numerics, act_block=32):
        cfg = tile_config(p_lin, m_rows, numerics, act_block)
        fmt = moe._expert_format(p_lin)
        if tile_phase(m_rows, moe._weight_shape(p_lin)[0], fmt) == "decode":
            cfg = dataclasses.replace(cfg, block_m=block_m)
        return cfg
    moe._tile_config = patched


# Every --sections name (module docstring); an unknown one is refused rather than silently skipped.
SECTIONS = ("ceil", "decode", "prefill", "host", "timeline", "profile", "experts", "ptimeline", "pattn", "ptopk", "pcandsort",
            "pswiglu", "pswigluq", "decidx", "dectiles", "decfp4", "nographs",
            "bf16experts", "w13two", "expf32", "pexpf32", "pdl", "densexla", "gatherattn", "unroll", "fullsampler", "searchbits", "xla")


def _xla_option(text: str) -> tuple[str, bool | int | str]:
    """"name=value" -> (name, value) with true/false as bools and integers as ints."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--xla-option {text!r}: expected NAME=VALUE")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value)
    except ValueError:
        return name, value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--sections", default="ceil,decode,prefill")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--prompts", default="4096,32768")
    ap.add_argument("--chunk", default="1024", help="prefill chunk(s): the first serves every section; "
                    "the prefill section runs each")
    ap.add_argument("--replay", choices=("both", "on", "off"), default="both",
                    help="prefill section: with bounded replay, without, or both")
    ap.add_argument("--xla-batches", default="1,16")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--kernels", default=None, help='Numerics.kernels for every section, e.g. "indexer=pallas" '
                    "(default: the engine's automatic choice)")
    ap.add_argument("--sinkhorn-segment-rows", default="default",
                    help="Numerics.sinkhorn_segment_rows for every section, for XLA's form of the rounds (with "
                    "--kernels sinkhorn=xla, or off Hopper): an int (512: prefill chunks only), 'none' "
                    "(one chain everywhere), or 'default' (the engine's: every size)")
    ap.add_argument("--y-transposed", action="store_true",
                    help="the expert GEMMs in their earlier y^T output form (GroupedMatmulConfig.out_rows=False): "
                         "an A/B of NOTES item -13(a) in the model")
    ap.add_argument("--prefill-chunk-tiles", action="store_true",
                    help="prefill-phase expert GEMMs (>= 96 rows an expert) on the chunk phase's 64-row tiles "
                    "(with_prefill_chunk_tiles: an A/B of the tile switch; the same bits)")
    ap.add_argument("--swiglu-epilogue", default="on", choices=("on", "off"),
                    help="off: the routed experts' SwiGLU in XLA after the w1/w3 launch, not in its epilogue "
                    "(Numerics.expert_swiglu_epilogue)")
    ap.add_argument("--swiglu-quant", default=None, choices=("on", "off"),
                    help="on: h's activation quantizer in the SwiGLU epilogue (Numerics.expert_swiglu_quant; "
                    "default: the Numerics default)")
    ap.add_argument("--decode-index-kernel", default=None, choices=("on", "off"),
                    help="on: a decode step's index scores on the Pallas decode kernel "
                    "(Numerics.decode_index_kernel; default: the Numerics default); with --sections decidx "
                    "the A/B's other order")
    ap.add_argument("--decode-index-tiles", type=int, default=None,
                    help="Numerics.decode_index_tiles: key tiles a CTA of the decode index-score kernel scores "
                    "(1: the one-tile form; 2-4: the streamed form)")
    ap.add_argument("--decode-index-fp4", default=None, choices=("on", "off"),
                    help="on: the decode index kernel's FP4 form over the index cache as stored "
                    "(Numerics.decode_index_fp4; default: the Numerics default); with --sections decfp4 the "
                    "A/B's other order")
    ap.add_argument("--decode-index-tiles-ab", type=int, default=4,
                    help="with --sections dectiles: the Numerics.decode_index_tiles the A/B row runs")
    ap.add_argument("--w13-launch", default="on", choices=("on", "off"),
                    help="off: the routed experts' w1 and w3 as two kernel launches (Numerics.expert_w13_launch)")
    ap.add_argument("--topk-prefilter", default="on", choices=("on", "off"),
                    help="off: the indexer's bisection top-k on whole rows (without_topk_prefilter; an A/B)")
    ap.add_argument("--decode-block-m", type=int, default=None,
                    help="token rows per tile of the decode-phase expert GEMMs (default: the tuned table's, 8 "
                    "below 2 rows per expert, else 16); an A/B")
    ap.add_argument("--row-major-experts", action="store_true",
                    help="keep the expert weights in the checkpoint's layout instead of the kernel's tile-major "
                    "one (moe.prepare_experts_tile_major): an A/B (same bits)")
    ap.add_argument("--excess-precision", action="store_true",
                    help="compile the engine's programs with XLA's excess precision on (EngineConfig.excess_"
                    "precision=True; the engine's default rounds as the program says): an A/B")
    ap.add_argument("--expert-operands", default=None, choices=("bf16", "e4m3", "e4m3-decode"),
                    help="Numerics.expert_operands: the FP4 experts' kernel operands (default: the Numerics "
                    "default); e4m3-decode = E4M3 in decode programs only (NOTES item -21)")
    ap.add_argument("--dense-kernel", default=None, choices=("off", "on", "decode"),
                    help="Numerics.dense_kernel: the dense FP8 linears on the grouped GEMM kernel (default: the "
                    "Numerics default); with the densexla section, the A/B against XLA's bf16 dots")
    ap.add_argument("--dense-kernel-linears", default=None,
                    help="Numerics.dense_kernel_linears: only these linears (comma-separated "
                    "dense_fp8.DENSE_LINEARS names, e.g. wo_a,wo_b,shared.w13) on the kernel, the rest XLA's dots; "
                    "'all': every one the kernel takes (default: the Numerics default)")
    ap.add_argument("--attention-fp4-rows", default=None, choices=("always", "decode", "never", "gather",
                                                                  "gather-decode"),
                    help="Numerics.attention_fp4_rows: the attention kernel's form for the FP4 compressed cache "
                         "(default: the Numerics default)")
    ap.add_argument("--attention-prefill-split", type=int, default=None,
                    help="Numerics.attention_prefill_split_rows (the attention kernel's split in prefill programs)")
    ap.add_argument("--pattn", default="fp4-rows-split320,fp4-rows,split320,f32-dense",
                    help="the pattn section's variants (comma-separated)")
    ap.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an XLA compile option for the engine's programs in every section (EngineConfig."
                         "xla_options; true/false and integers are typed, the rest are strings), repeatable")
    ap.add_argument("--tiny", action="store_true", help="tiny widths and sizes: a CPU smoke run of this script")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile-cache", default=str(HERE.parent / ".jax_cache"),
                    help="jax's persistent compilation cache (with XLA's per-fusion autotuning results), or "
                    "'none'. Its autotuning part is copied to OUT/autotune_cache (small files) for carrying "
                    "into a later call: see NOTES.md, device plan")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS) - {""})
    if unknown:
        ap.error(f"--sections: unknown {unknown}; known: {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compile_cache != "none":
        RESULTS["compile_cache"] = str(enable_compile_cache(args.compile_cache))
        RESULTS["autotune_entries_at_start"] = _count_files(autotune_dir(RESULTS["compile_cache"]))
    save(out)
    want = set(args.sections.split(","))
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    batches, contexts, prompts = ints(args.batches), ints(args.contexts), ints(args.prompts)
    chunks = ints(args.chunk)
    args.chunk = chunks[0]
    replay = {"both": (True, False), "on": (True,), "off": (False,)}[args.replay]
    if args.tiny:
        batches, contexts, prompts, args.chunk, chunks = [1, 4], [40, 100], [64, 200], 32, [32]
        args.xla_batches, args.profile_batch = "1", 4
    log(f"jax {jax.__version__} on {RESULTS['device']}; slice of {args.layers} layers; "
        f"kernels {args.kernels or 'auto'}")
    RESULTS["kernels"] = args.kernels or "auto"
    RESULTS["excess_precision"] = args.excess_precision   # read by scheduler()
    RESULTS["xla_options"] = [_xla_option(o) for o in args.xla_option]   # read by scheduler()
    if "ceil" in want:
        section("ceilings", ceilings, out, args.tiny)
    t = time.time()
    cfg = slice_config(args.layers, tiny_widths=args.tiny)
    params = random_params(cfg)
    numerics = Numerics.reference()
    if args.kernels:
        numerics = dataclasses.replace(numerics, kernels=args.kernels)
    numerics = with_segment_rows(numerics, args.sinkhorn_segment_rows)
    if args.expert_operands:
        numerics = dataclasses.replace(numerics, expert_operands=args.expert_operands)
    numerics = dataclasses.replace(numerics, expert_w13_launch=args.w13_launch == "on",
                                   expert_swiglu_epilogue=args.swiglu_epilogue == "on")
    if args.swiglu_quant:
        numerics = dataclasses.replace(numerics, expert_swiglu_quant=args.swiglu_quant == "on")
    if args.decode_index_kernel:
        numerics = dataclasses.replace(numerics, decode_index_kernel=args.decode_index_kernel == "on")
    if args.decode_index_tiles is not None:
        numerics = dataclasses.replace(numerics, decode_index_tiles=args.decode_index_tiles)
    if args.decode_index_fp4:
        numerics = dataclasses.replace(numerics, decode_index_fp4=args.decode_index_fp4 == "on")
    if args.dense_kernel:
        numerics = dataclasses.replace(numerics, dense_kernel=args.dense_kernel)
    if args.dense_kernel_linears:
        numerics = dataclasses.replace(numerics, dense_kernel_linears=parse_linear_names(args.dense_kernel_linears))
    if args.attention_fp4_rows:
        numerics = dataclasses.replace(numerics, attention_fp4_rows=args.attention_fp4_rows)
    if args.attention_prefill_split is not None:
        numerics = dataclasses.replace(numerics, attention_prefill_split_rows=args.attention_prefill_split)
    RESULTS["attention"] = dict(fp4_rows=numerics.attention_fp4_rows, split_rows=numerics.attention_split_rows,
                                prefill_split_rows=numerics.attention_prefill_split_rows)
    RESULTS["dense_bf16_out"] = numerics.bf16_out_dense()
    RESULTS["dense_kernel"] = numerics.dense_kernel
    RESULTS["dense_kernel_linears"] = numerics.dense_kernel_linears
    params_dense_xla = None
    RESULTS["expert_operands"] = numerics.expert_operands
    RESULTS["expert_w13_launch"] = numerics.expert_w13_launch
    RESULTS["expert_swiglu_epilogue"] = numerics.expert_swiglu_epilogue
    RESULTS["expert_swiglu_quant"] = numerics.expert_swiglu_quant
    RESULTS["decode_index_kernel"] = numerics.decode_index_kernel
    RESULTS["decode_index_tiles"] = numerics.decode_index_tiles
    RESULTS["decode_index_fp4"] = numerics.decode_index_fp4
    RESULTS["attention_schedule"] = numerics.attention_schedule
    RESULTS["sinkhorn_segment_rows"] = numerics.sinkhorn_segment_rows
    if args.y_transposed:
        with_y_transposed()
    RESULTS["grouped_gemm_out_rows"] = not args.y_transposed
    if args.decode_block_m:
        with_decode_block_m(args.decode_block_m)
    if args.prefill_chunk_tiles:
        with_prefill_chunk_tiles()
    RESULTS["prefill_chunk_tiles"] = args.prefill_chunk_tiles
    if args.topk_prefilter == "off":
        without_topk_prefilter()
    RESULTS["topk_prefilter"] = args.topk_prefilter
    RESULTS["decode_block_m"] = args.decode_block_m
    params_xla = params if "xla" in want else None   # the XLA-only path reads the checkpoint layout
    tile_major = False
    stored = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    if experts_run_kernel(numerics):     # as the engine (LLM) does at load on the GPU path
        # (the XLA-only section reads the stored layout: keep it, and the memory for both, only then)
        tile_major = params_xla is None and not args.row_major_experts
        params, numerics = prepare_experts_for_kernel(params, numerics, tile_major=tile_major,
                                                      donate=params_xla is None)
        if numerics.dense_kernel != "off":    # as the engine: dense FP8 linears held for the kernel
            # (the densexla A/B reads the engine's other form, bf16 copies; only the dense leaves differ)
            params_dense_xla = dequantize_dense_fp8(params) if "densexla" in want else None
            params = prepare_dense_fp8(params, cfg, linears=numerics.dense_kernel_linears)
        params = dequantize_dense_fp8(params)
    if numerics.bf16_stream_dot():       # as the engine does: mHC's bf16 weight parts made once
        params = prepare_stream_dots(params)
    RESULTS["experts_tile_major"] = tile_major
    tok = Tokenizer.from_dir(TOKENIZER_DIR)
    token_map, _ = compressed_token_map(TOKENIZER_DIR / "tokenizer.json", cfg.vocab_size)
    m = Model(cfg, params, tok, token_map, stored)
    RESULTS["slice"] = dict(layers=args.layers, weight_bytes=tree_bytes(params), build_s=time.time() - t,
                            roles=[cfg.layer_plan(i).mode.value for i in range(cfg.num_hidden_layers)],
                            matmul_macs_per_token=matmul_macs_per_token(cfg, stored), pool_bytes=pool_bytes())
    log(f"slice: {RESULTS['slice']}")
    max_len = max(contexts) + 64
    if "decode" in want:
        section("decode", run_decode, out, m, numerics, batches, contexts, max_len, "kernels")
    def decode_ab(name, label, ab_numerics, *extra, model=m):
        """A decode row at --profile-batch and the first context, to set beside the decode section's."""
        section(name, run_decode, out, model, ab_numerics, [args.profile_batch], contexts[:1], max_len, label, *extra)

    if "fullsampler" in want:   # A/B of the sampler's plan against the decode section's row
        decode_ab("full-sampler-decode", "full-sampler", numerics, 10, SamplerPlan())
    if "searchbits" in want:   # A/B of the search's bits per pass: the decode rows' own plan at 4 bits
        decode_ab("search-bits4-decode", "search-bits-4", numerics, 10,
                  SamplerPlan(sampled=True, top_k=False, top_p=True, search_bits=4))
    if "nographs" in want:   # A/B: kernels launched one by one instead of as one CUDA graph per program
        decode_ab("no-graphs-decode", "no-graphs", numerics, 10, None, (("xla_gpu_enable_command_buffer", ""),))
    if "bf16experts" in want:   # A/B of Numerics.expert_operands on the same machine as the decode row
        decode_ab("bf16-experts-decode", "bf16-experts", dataclasses.replace(numerics, expert_operands="bf16"))
    if "w13two" in want:   # A/B of Numerics.expert_w13_launch against the decode section's row
        decode_ab("w13-two-launches-decode", "w13-two-launches",
                  dataclasses.replace(numerics, expert_w13_launch=False))
    if "decidx" in want:   # A/B of Numerics.decode_index_kernel against the decode section's row
        decode_ab("decode-index-kernel", "decode-index-kernel",
                  dataclasses.replace(numerics, decode_index_kernel=not numerics.decode_index_kernel))
    if "dectiles" in want:   # A/B of Numerics.decode_index_tiles against the decode section's row
        decode_ab("decode-index-tiles", f"decode-index-tiles-{args.decode_index_tiles_ab}",
                  dataclasses.replace(numerics, decode_index_tiles=args.decode_index_tiles_ab))
    if "decfp4" in want:   # A/B of Numerics.decode_index_fp4 against the decode section's row
        decode_ab("decode-index-fp4", "decode-index-fp4",
                  dataclasses.replace(numerics, decode_index_fp4=not numerics.decode_index_fp4))
    if "expf32" in want:   # A/B of Numerics.expert_outputs_f32 against the decode section's row
        decode_ab("expert-outputs-f32-decode", "expert-outputs-f32",
                  dataclasses.replace(numerics, expert_outputs_f32=not numerics.expert_outputs_f32))
    if "pdl" in want:   # A/B of Numerics.kernel_pdl against the decode section's row
        decode_ab("pdl-decode", "kernel-pdl", dataclasses.replace(numerics, kernel_pdl=True))
    if "densexla" in want and params_dense_xla is not None:   # A/B of Numerics.dense_kernel: XLA's bf16 dots
        decode_ab("dense-xla-decode", "dense-xla", dataclasses.replace(numerics, dense_kernel="off"),
                  model=dataclasses.replace(m, params=params_dense_xla))
    if "gatherattn" in want:   # A/B of the attention's decode form against the decode section's row
        decode_ab("gather-attn-decode", "gather-attn",
                  dataclasses.replace(numerics, attention_fp4_rows="gather-decode"))
    if "unroll" in want:   # A/B of Numerics.sinkhorn_unroll against the decode section's row
        decode_ab("unroll-decode", "sinkhorn-loop",
                  dataclasses.replace(numerics, sinkhorn_unroll=False, kernels=f"{numerics.kernels},sinkhorn=xla"))
    if "host" in want:
        section("host", run_host, out, m, numerics, args.profile_batch, contexts[0], max_len)
    if "timeline" in want:
        section("timeline", run_timeline, out, m, numerics, args.profile_batch, contexts[0], max_len)
    if "profile" in want:
        section("profile", run_profile, out, m, numerics, args.profile_batch, contexts[0], max_len)
    if "experts" in want:   # after the timed decode sections: it clears the compiled-step cache
        section("experts", run_experts, out, m, numerics, args.profile_batch, contexts[0], max_len)
    if "prefill" in want:
        for i, c in enumerate(chunks):
            section("prefill" if i == 0 else f"prefill-chunk{c}", run_prefill, out, m, numerics, prompts, c, replay)
    if "pattn" in want:   # A/B of the attention kernel's prefill form against the prefill section's rows
        variants = {"fp4-rows-split320": dict(attention_fp4_rows="always", attention_prefill_split_rows=0,
                                              attention_schedule="halves"),
                    "fp4-rows": dict(attention_fp4_rows="always"),
                    "split320": dict(attention_prefill_split_rows=0, attention_schedule="halves"),
                    "f32-dense": dict(dense_bf16_out=False),
                    "seesaw": dict(attention_schedule="seesaw-prefill"),
                    "halves": dict(attention_schedule="halves")}
        for label in args.pattn.split(","):
            change = variants[label]
            section(f"prefill-attn-{label}", run_prefill, out, m, dataclasses.replace(numerics, **change),
                    prompts[-1:], args.chunk, (False,), label)
    if "ptopk" in want:   # A/B of the indexer's candidate list against the prefill section's rows
        from pallas_kernels.topk import select as topk_select

        with patched(topk_select, "prefilter_capacity", no_prefilter_capacity):
            section("prefill-topk-rows", run_prefill, out, m, numerics, prompts[-1:], chunks[0], (False,),
                    "topk-rows")
    if "pcandsort" in want:   # A/B of the candidate pool's bisection mask against the prefill section's rows
        from deepinfer_jax.model import indexer as indexer_module

        with patched(indexer_module, "top_mask", sorted_top_mask):
            section("prefill-candidate-sort", run_prefill, out, m, numerics, prompts[-1:], chunks[0], (False,),
                    "candidate-sort")
    if "pswiglu" in want:   # A/B of the SwiGLU epilogue against the prefill section's rows
        other = not numerics.expert_swiglu_epilogue
        label = "swiglu-epilogue" if other else "swiglu-xla"
        section(f"prefill-{label}", run_prefill, out, m, dataclasses.replace(numerics, expert_swiglu_epilogue=other),
                prompts[-1:], chunks[0], (False,), label)
    if "pswigluq" in want:   # A/B of h's quantizer in the SwiGLU epilogue against the prefill section's rows
        other = not numerics.expert_swiglu_quant
        label = "swiglu-quant-kernel" if other else "swiglu-quant-xla"
        section(f"prefill-{label}", run_prefill, out, m, dataclasses.replace(numerics, expert_swiglu_quant=other),
                prompts[-1:], chunks[0], (False,), label)
    if "pexpf32" in want:   # A/B of Numerics.expert_outputs_f32 against the prefill section's rows
        section("prefill-expert-outputs-f32", run_prefill, out, m,
                dataclasses.replace(numerics, expert_outputs_f32=not numerics.expert_outputs_f32),
                prompts[-1:], chunks[0], (False,), "expert-outputs-f32")
    if "ptimeline" in want:
        section("prefill-timeline", run_prefill_timeline, out, m, numerics, prompts[-1], args.chunk)
    if "xla" in want:
        section("xla-decode", run_decode, out, dataclasses.replace(m, params=params_xla),
                dataclasses.replace(numerics, kernels="xla"),
                ints(args.xla_batches), contexts[:1], max_len, "xla-only")
    RESULTS["peak_bytes"] = peak_bytes()
    if "compile_cache" in RESULTS:
        RESULTS["autotune_cache_copied"] = _copy_autotune(Path(RESULTS["compile_cache"]), out / "autotune_cache")
    save(out)
    log("\n==== e2e summary ====")
    for line in TABLE:
        log(line)
    errors = [k for k, v in RESULTS["sections"].items() if isinstance(v, dict) and "error" in v]
    log("errors:", errors)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
