"""GPU check and benchmark of ``pallas_kernels.grouped_gemm`` on a Hopper GPU (H200), in one process.

    PYTHONUNBUFFERED=1 python3 benchmarks/grouped_gemm_gpu.py        # writes $OUT/grouped_gemm_gpu.json

Sections, in this order, each time-boxed (GG_BUDGET_S, default 170 s in all) and isolated (an error
is recorded and the next section runs):
1. ceilings: device-to-device copy bandwidth (bytes read + written) and a dense bf16 matmul rate;
2. correctness at the V4.1-Flash expert shape (K=5120 hidden, N=2304 width, G=384): a sample of rows
   against the float32 reference, every weight format, decode and prefill tilings;
3. speed: decode (64 and 512 tokens x top-6) and prefill (8k and 32k tokens x top-6) per format, as
   TFLOP/s of useful work, the ratio to a dense bf16 matmul of the same FLOPs, the kernel's share of
   the op's time (the rest is the XLA plan / gather / transpose), and for decode the weight bytes per
   second as a fraction of the measured copy bandwidth; then the FP4 rows again with the engine's own
   configs (tile-major weights, E4M3 operands at decode, bf16 at prefill: ``engine_fp4_cfg``);
4. bitwise batch invariance of a probe row (M in {1,2,3,5,8,33,64}; group sizes alone / uniform /
   all in one expert / uneven) for the kernel, and the same check on ``jax.lax.ragged_dot`` and on a
   plain dense dot as negative controls (they should report DIFFERS);
5. jax's ``ragged_dot_mgpu`` example as a baseline where it imports and compiles in time.
A compact table is printed last.

    PYTHONUNBUFFERED=1 python3 benchmarks/grouped_gemm_gpu.py --w13           # ~1-2 min

runs the copy ceiling and the routed experts' w1 and w3 (FP4, the engine's configs) as one kernel launch
against two, at decode 64 and 512 tokens x 6 and a prefill of 8k x 6: kernel ms of each and whether
they give the same bits (``Numerics.expert_w13_launch``).

    PYTHONUNBUFFERED=1 python3 benchmarks/grouped_gemm_gpu.py --swiglu        # ~1-2 min

runs the copy ceiling and an expert FFN's gate/up half at prefill (8k and 32k tokens x 6, FP4, the engine's
prefill config): w1 and w3 with the SwiGLU and routing weight in the kernel's epilogue
(``kernel.swiglu_tiles``) against the one-launch w1/w3 kernel followed by XLA's elementwise SwiGLU, each
giving h [rows, 2304] float32: ms of each (all kernels of the call), the w13 launch alone (what the
epilogue launch costs over it), and the largest difference between the two h, relative to the largest
|h| (0 where exp rounds alike); then h as w2 reads it (bf16, FP8-quantized, FP4 K order) with the quantizer
in the epilogue against the float32 epilogue + XLA's quantizer: ms of each and whether the bits agree.

    PYTHONUNBUFFERED=1 python3 benchmarks/grouped_gemm_gpu.py --dequant-ab     # ~2-3 min on an H200

runs only the copy ceiling and an A/B of the quantized kernels' dequantization (section 6): FP4 with the
old float polynomial ("arith"), bit placement ("bits") or packed inline PTX ("packed"), each with and
without the wgmma overlap, and FP8
with and without the overlap, at decode 64 and 512 tokens x 6 and prefill 32k x 6; it prints kernel ms,
weight TB/s and the fraction of copy bandwidth, and whether each variant's output is bitwise the old
kernel's (it should be: the variants feed wgmma the same bf16 values in the same order).

    PYTHONUNBUFFERED=1 GG_BUDGET_S=280 python3 benchmarks/grouped_gemm_gpu.py --sweep   # ~4-5 min

runs the copy ceiling and a sweep of tile configs (block_m x block_n x block_k x stages) at the
model's float32 output: FP4 decode at 64 and 512 tokens x 6, FP4 prefill at 32k x 6, FP8 decode; per
config the kernel time, weight TB/s and fraction of copy bandwidth, TFLOP/s, and whether the output
is bitwise the first (the model's current) config's. The model's per-phase choice
(``pallas_kernels.grouped_gemm.config.tuned_config``) is read off this table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.grouped_gemm.config import (TILE_MAJOR_TILE, GroupedMatmulConfig, WeightFormat, fit_stages,  # noqa: E402
                                                tile_major_weights, tuned_config)
from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas  # noqa: E402
from pallas_kernels.grouped_gemm.reference import grouped_matmul_reference  # noqa: E402
from timing import cupti_ms  # noqa: E402  (benchmarks/timing.py: the script's folder is on sys.path)

# GG_SHAPE="K,N,G" and GG_TOKENS="d1,d2,p1,p2" shrink the problem and GG_INTERPRET=1 runs the kernel in
# the Mosaic GPU interpreter: a CPU smoke test of this script before spending device time.
K_HIDDEN, N_WIDTH, G_EXPERTS = (int(v) for v in os.environ.get("GG_SHAPE", "5120,2304,384").split(","))
TOP_K = 6
TOKENS = tuple(int(v) for v in os.environ.get("GG_TOKENS", "64,512,8192,32768").split(","))
PROBE_G = 11 % G_EXPERTS
OUT = Path(os.environ.get("OUT", "/tmp"))
DEQUANT_AB = "--dequant-ab" in sys.argv[1:]
SWEEP = "--sweep" in sys.argv[1:]
BUDGET_S = float(os.environ.get("GG_BUDGET_S", "210" if (DEQUANT_AB or SWEEP) else "170"))
T0 = time.time()
RESULTS: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "sections": {}}
TABLE: list[str] = []


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "grouped_gemm_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))


_MODE_SECTIONS = {"--dequant-ab": ("ceilings", "dequant_ab"), "--sweep": ("ceilings", "sweep"),
                  "--invariance": ("correctness", "invariance"), "--w13": ("ceilings", "w13"),
                  "--swiglu": ("ceilings", "swiglu")}
_MODE = next((m for m in _MODE_SECTIONS if m in sys.argv[1:]), None)


def section(name: str, need_s: float):
    def deco(fn):
        wanted = name in _MODE_SECTIONS[_MODE] if _MODE else name not in ("dequant_ab", "sweep", "w13", "swiglu")
        if not wanted:
            if _MODE:
                RESULTS["sections"][name] = f"skipped: {_MODE}"
            return None
        if left() < need_s:
            RESULTS["sections"][name] = f"skipped: {left():.0f} s left, needs {need_s:.0f}"
            print(f"[{name}] skipped ({left():.0f} s left)", flush=True)
            return None
        t = time.time()
        try:
            RESULTS["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
            RESULTS["sections"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        print(f"[{name}] {time.time() - t:.1f} s: {str(RESULTS['sections'][name])[:600]}", flush=True)
        save()
        return None
    return deco


def kernel_times_ms(f, *args, iters: int = 10):
    """(total GPU ms per call, largest kernel's ms) by CUPTI; wall-clock fallback (total only)."""
    if (got := cupti_ms(f, *args, iters=iters)) is not None:
        return got
    t = time.perf_counter()
    for _ in range(iters):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters * 1e3, None


def fit(cfg: GroupedMatmulConfig, fmt: WeightFormat, out_dtype=jnp.bfloat16) -> GroupedMatmulConfig:
    """The same tiles with as many stages (<= cfg.stages) as fit in shared memory."""
    return fit_stages(cfg, fmt, out_dtype)


INTERPRET = os.environ.get("GG_INTERPRET") == "1"


def decode_cfg(fmt):
    """``tuned_config`` at decode, 64 tokens x top-6, on row-major weights with the default FP4 decoder
    (the form the correctness, invariance and A/B sections share; ``engine_fp4_cfg`` is the engine's)."""
    return tuned_config(64 * TOP_K, G_EXPERTS, N_WIDTH, K_HIDDEN, fmt, jnp.bfloat16,
                        GroupedMatmulConfig(a_from_registers=not INTERPRET))


def engine_fp4_cfg(tokens: int, operands: str) -> GroupedMatmulConfig:
    """The config the engine's MoE runs for FP4 experts at ``tokens`` x top-6 (as ``moe._tile_config``
    builds it for weights ``prepare_experts_for_kernel`` laid out): tile-major 256 x 128 weights, the
    "subnormal" decoder (this script's scales allow it), float32 out, the given operand form (the
    engine's default: "e4m3" in decode programs, "bf16" in prefill programs)."""
    bn, bk = TILE_MAJOR_TILE     # the layout prepare_experts_for_kernel holds; every engine config reads it
    base = GroupedMatmulConfig(fp4_dequant="subnormal", fp4_operands=operands, block_n=bn, block_k=bk,
                               weights_tile_major=True, a_from_registers=not INTERPRET)
    return tuned_config(tokens * TOP_K, G_EXPERTS, N_WIDTH, K_HIDDEN, WeightFormat.FP4, jnp.float32, base=base)


def prefill_cfg(fmt, variant: str = "a"):
    """variant "a": the model's config (``tuned_config``) at prefill, 32k tokens x top-6; "b": 64x256 tiles."""
    if variant == "a":
        return tuned_config(32768 * TOP_K, G_EXPERTS, N_WIDTH, K_HIDDEN, fmt, jnp.bfloat16,
                            GroupedMatmulConfig(a_from_registers=not INTERPRET))
    bk = 64 if fmt is WeightFormat.BF16 else 128
    return fit(GroupedMatmulConfig(block_m=64, block_n=256, block_k=bk, stages=4, a_from_registers=not INTERPRET), fmt)


# ---- data -------------------------------------------------------------------------------------------

def make_weights(fmt: WeightFormat, key, g=G_EXPERTS, n=N_WIDTH, k=K_HIDDEN):
    kw, ks = jax.random.split(key)
    if fmt is WeightFormat.BF16:
        return (jax.random.normal(kw, (g, n, k), jnp.bfloat16) * 0.05).astype(jnp.bfloat16), None
    if fmt is WeightFormat.FP8:
        w = (jax.random.normal(kw, (g, n, k), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
        return w, jax.random.randint(ks, (g, n // 32, k // 32), 118, 122).astype(jnp.uint8)
    w = jax.random.bits(kw, (g, n, k // 2), jnp.uint8)
    return w, jax.random.randint(ks, (g, n, k // 32), 118, 122).astype(jnp.uint8)


def routing(key, tokens: int, g=G_EXPERTS, top_k=TOP_K):
    """Distinct top-k experts per token from random scores -> group id per (token, k) pair [tokens*k]."""
    return jnp.argsort(jax.random.uniform(key, (tokens, g)), axis=1)[:, :top_k].reshape(-1).astype(jnp.int32)


def rows(key, m, k=K_HIDDEN):
    return jax.random.normal(key, (m, k), jnp.bfloat16)


def fp8_per_32(x):
    """x rounded to E4M3 values with a power-of-two scale per 32 columns (the form of the model's expert
    inputs), as bf16. Eager on purpose: inside one jit XLA:GPU may drop the f8 -> f32 convert pair."""
    from pallas_kernels.grouped_gemm.fp8_operands import e4m3_rows

    q = e4m3_rows(x)
    return (q.values.astype(jnp.float32) * jnp.repeat(q.scale, 32, axis=1)).astype(jnp.bfloat16)


WEIGHTS: dict = {}


def weights(fmt):
    if fmt not in WEIGHTS:       # all three stay resident: 2.3 + 4.5 + 9 GB
        WEIGHTS[fmt] = jax.block_until_ready(make_weights(fmt, jax.random.key(1)))
    return WEIGHTS[fmt]


def wbytes(fmt, n_experts):
    per = N_WIDTH * K_HIDDEN * fmt.weight_bits // 8
    if fmt is not WeightFormat.BF16:
        per += N_WIDTH * K_HIDDEN // 32
    return per * n_experts


def bits(a):
    a = np.asarray(jax.device_get(a))
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _interpret_context():
    import contextlib
    if os.environ.get("GG_INTERPRET") != "1":
        return contextlib.nullcontext()
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh
    stack = contextlib.ExitStack()
    stack.enter_context(jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=8))))
    stack.enter_context(plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()))
    return stack


# ---- sections ---------------------------------------------------------------------------------------

_INTERPRET_STACK = _interpret_context()   # kept referenced: a collected context manager would exit
_INTERPRET_STACK.__enter__()              # (CPU smoke test: every kernel call below is interpreted)

CEIL: dict = {}


@section("ceilings", 20)
def _():
    a = jnp.ones((1 << 30,), jnp.float32)                  # 4 GiB
    ms, _ = kernel_times_ms(jax.jit(lambda v: v + 1.0), a)
    CEIL["copy_tb_s"] = 2 * a.nbytes / (ms * 1e-3) / 1e12
    del a
    if _MODE:
        TABLE.append(f"copy bandwidth {CEIL['copy_tb_s']:.2f} TB/s")
        return dict(CEIL)
    m = TOKENS[3] * TOP_K
    x = rows(jax.random.key(2), m)
    wt = jax.random.normal(jax.random.key(3), (K_HIDDEN, N_WIDTH), jnp.bfloat16)
    ms, _ = kernel_times_ms(jax.jit(lambda p, q: p @ q), x, wt)
    CEIL["dense_tflops_prefill32k"] = 2 * m * K_HIDDEN * N_WIDTH / (ms * 1e-3) / 1e12
    TABLE.append(f"copy bandwidth {CEIL['copy_tb_s']:.2f} TB/s; dense bf16 [{m}x{K_HIDDEN}]x[{K_HIDDEN}x{N_WIDTH}] "
                 f"{CEIL['dense_tflops_prefill32k']:.0f} TFLOP/s")
    return dict(CEIL)


def dense_tflops(m):
    x = rows(jax.random.key(2), m)
    wt = jax.random.normal(jax.random.key(3), (K_HIDDEN, N_WIDTH), jnp.bfloat16)
    ms, _ = kernel_times_ms(jax.jit(lambda p, q: p @ q), x, wt)
    return 2 * m * K_HIDDEN * N_WIDTH / (ms * 1e-3) / 1e12


def check_rows(fmt, y, x, gid, sample):
    w, s = weights(fmt)
    want = grouped_matmul_reference(x[sample], w, gid[sample], s)
    got = y[sample].astype(jnp.float32)
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    worst = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    return rel, worst


@section("correctness", 30)
def _():
    out = {}
    m = TOKENS[1] * TOP_K
    x = rows(jax.random.key(4), m)
    gid = routing(jax.random.key(5), TOKENS[1])
    gid = gid.at[:7].set(-1)                                  # dropped rows must come back as zeros
    sample = jnp.arange(0, m, max(1, m // 40))
    for fmt in (WeightFormat.FP4, WeightFormat.FP8, WeightFormat.BF16):
        w, s = weights(fmt)
        for name, cfg in (("decode_cfg", decode_cfg(fmt)), ("prefill_cfg", prefill_cfg(fmt))):
            y = grouped_matmul_pallas(x, w, gid, s, config=cfg)
            rel, worst = check_rows(fmt, y, x, gid, sample)
            zeros_ok = bool(jnp.all(y[:7] == 0))
            out[f"{fmt.value}/{name}"] = dict(rel_fro=rel, max_rel=worst, dropped_rows_zero=zeros_ok)
            TABLE.append(f"correct {fmt.value:4s} {name:11s} rel.fro {rel:.2e} max {worst:.2e} dropped->0 {zeros_ok}")
        if fmt is WeightFormat.FP4:      # the E4M3 operand form (decode programs), on FP8 rows as the model's
            x8 = fp8_per_32(x)
            y = grouped_matmul_pallas(x8, w, gid, s, config=dataclasses.replace(decode_cfg(fmt), fp4_operands="e4m3"))
            rel, worst = check_rows(fmt, y, x8, gid, sample)
            zeros_ok = bool(jnp.all(y[:7] == 0))
            out["fp4/decode_cfg_e4m3"] = dict(rel_fro=rel, max_rel=worst, dropped_rows_zero=zeros_ok)
            TABLE.append(f"correct fp4  decode e4m3 rel.fro {rel:.2e} max {worst:.2e} dropped->0 {zeros_ok}")
    return out


def invariance_cases(key, probe_x, probe_g):
    """(name, x, gid, probe position) with the probe row among different neighbours and group sizes."""
    cases = []
    for i, m in enumerate((2, 3, 5, 8, 33, 64)):
        kx, kg = jax.random.split(jax.random.fold_in(key, i))
        x = rows(kx, m)
        gid = jax.random.randint(kg, (m,), 0, G_EXPERTS).astype(jnp.int32)
        p = m // 2
        cases.append((f"M={m}", x.at[p].set(probe_x), gid.at[p].set(probe_g), p))
    kx = jax.random.fold_in(key, 100)
    m = 4 * G_EXPERTS
    cases.append(("uniform 4/expert", rows(kx, m).at[5].set(probe_x),
                   (jnp.arange(m, dtype=jnp.int32) % G_EXPERTS).at[5].set(probe_g), 5))
    cases.append(("all 64 in one", rows(kx, 64).at[40].set(probe_x), jnp.full((64,), probe_g, jnp.int32), 40))
    gid = jnp.concatenate([jnp.full((150,), probe_g, jnp.int32),
                           jax.random.randint(kx, (150,), 0, 5).astype(jnp.int32)])
    cases.append(("uneven 150+150", rows(kx, 300).at[77].set(probe_x), gid, 77))
    return cases


def timing_record(label: str, fmt, cfg, m: int, active: int, total_ms: float, kern_ms, ceil_copy, ref_name: str,
                  same, **extra) -> dict:
    """One timed config: kernel (else op) time, weight TB/s (and its share of copy bandwidth), TFLOP/s,
    and whether its output is bitwise the reference config's (ref_name None: no such check); printed and
    added to the table."""
    t = (kern_ms or total_ms) * 1e-3
    rec = dict(config=str(cfg), op_ms=total_ms, kernel_ms=kern_ms, active_experts=active, **extra,
               weight_tb_s=wbytes(fmt, active) / t / 1e12, kernel_tflops=2 * m * N_WIDTH * K_HIDDEN / t / 1e12)
    if ref_name is not None:
        rec[f"bitwise_equal_{ref_name}"] = same
    line = (f"{label} kernel {t * 1e3:7.3f} ms (op {total_ms:7.3f}) {rec['kernel_tflops']:6.1f} TF/s | "
            f"weights {rec['weight_tb_s']:.2f} TB/s")
    if ceil_copy:
        rec["copy_fraction"] = rec["weight_tb_s"] / ceil_copy
        line += f" = {rec['copy_fraction']:.2f} of copy"
    if ref_name is not None:
        line += " | reference" if same is None else f" | bits == {ref_name}: {same}"
    TABLE.append(line)
    print(line, flush=True)
    save()
    return rec


def _speed_engine_fp4(w, s, ceil_copy) -> dict:
    """The FP4 rows again with the engine's own configs (``engine_fp4_cfg``): E4M3 operands at the
    decode token counts (a decode program's batch), bf16 operands at the prefill ones; x is FP8 per 32
    columns, as the model's activation quantizer leaves it. The rows above keep the row-major form."""
    out = {}
    w_tm = tile_major_weights(w, *TILE_MAJOR_TILE)    # as the engine holds them, for every config
    for phase, tokens in zip(("decode", "decode", "prefill", "prefill"), TOKENS):
        key = f"fp4/{phase}{tokens}/engine"
        if left() < 15:
            out[key] = "skipped (time)"
            continue
        m = tokens * TOP_K
        cfg = engine_fp4_cfg(tokens, "e4m3" if phase == "decode" else "bf16")
        gid = routing(jax.random.key(tokens), tokens)
        x = fp8_per_32(rows(jax.random.key(tokens + 1), m))
        f = lambda x, g, w, s, cfg=cfg: grouped_matmul_pallas(x, w, g, s, out_dtype=jnp.float32, config=cfg)  # noqa: E731
        total_ms, kern_ms = kernel_times_ms(f, x, gid, w_tm, s, iters=1 if INTERPRET else 10)
        out[key] = timing_record(f"fp4  {phase:7s} {tokens:6d}x6  engine ({cfg.fp4_operands} operands, "
                                 f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}x{cfg.stages} c{cfg.consumers})",
                                 WeightFormat.FP4, cfg, m, int(jnp.unique(gid).shape[0]), total_ms, kern_ms,
                                 ceil_copy, None, None)
        if phase == "prefill" and kern_ms and not INTERPRET:
            dense = dense_tflops(m)
            out[key]["dense_tflops"] = dense
            out[key]["kernel_vs_dense"] = out[key].get("kernel_tflops", 0) / dense
            TABLE.append(f"  = {out[key]['kernel_vs_dense']:.2f} of the dense bf16 rate ({dense:.0f} TF/s)")
    return out


@section("speed", 40)
def _():
    out = {}
    ceil_copy = CEIL.get("copy_tb_s")
    for fmt in (WeightFormat.FP4, WeightFormat.BF16, WeightFormat.FP8):
        w, s = weights(fmt)
        for phase, tokens in zip(("decode", "decode", "prefill", "prefill"), TOKENS):
            if left() < 15:
                out[f"{fmt.value}/{phase}{tokens}"] = "skipped (time)"
                continue
            m = tokens * TOP_K
            gid = routing(jax.random.key(tokens), tokens)
            x = rows(jax.random.key(tokens + 1), m)
            cfg = decode_cfg(fmt) if phase == "decode" else prefill_cfg(fmt)
            # The weights go in as arguments: profiler.measure jits f, and a closure would bake the
            # 2.4-9 GB expert stack into the program as constants (that segfaulted the 2026-12-03 run).
            f = lambda x, g, w, s, cfg=cfg: grouped_matmul_pallas(x, w, g, s, config=cfg)  # noqa: E731
            total_ms, kern_ms = kernel_times_ms(f, x, gid, w, s)
            flops = 2 * m * N_WIDTH * K_HIDDEN
            dense = dense_tflops(m)
            rec = dict(config=str(cfg), op_ms=total_ms, kernel_ms=kern_ms,
                       op_tflops=flops / (total_ms * 1e-3) / 1e12, dense_tflops=dense)
            line = f"{fmt.value:4s} {phase:7s} {tokens:6d}x6  op {total_ms:7.3f} ms {rec['op_tflops']:6.1f} TF/s"
            if kern_ms:
                rec["kernel_tflops"] = flops / (kern_ms * 1e-3) / 1e12
                rec["kernel_vs_dense"] = rec["kernel_tflops"] / dense
                line += f" | kernel {kern_ms:7.3f} ms {rec['kernel_tflops']:6.1f} TF/s = {rec['kernel_vs_dense']:.2f} of dense"
            if phase == "decode":
                active = int(jnp.unique(gid).shape[0])
                rec["active_experts"] = active
                t = (kern_ms or total_ms) * 1e-3
                rec["weight_tb_s"] = wbytes(fmt, active) / t / 1e12
                if ceil_copy:
                    rec["hbm_fraction"] = rec["weight_tb_s"] / ceil_copy
                    line += f" | weights {rec['weight_tb_s']:.2f} TB/s = {rec['hbm_fraction']:.2f} of copy"
            out[f"{fmt.value}/{phase}{tokens}"] = rec
            TABLE.append(line)
            save()
        if fmt is WeightFormat.FP4:
            out.update(_speed_engine_fp4(w, s, ceil_copy))
        if fmt is WeightFormat.FP4 and left() > 30:     # a second prefill tiling, for the record
            tokens = TOKENS[2]
            m = tokens * TOP_K
            gid = routing(jax.random.key(tokens), tokens)
            x = rows(jax.random.key(tokens + 1), m)
            for fm in (WeightFormat.FP4,):
                cfg = prefill_cfg(fm, "b")
                f = lambda x, g, w, s, cfg=cfg: grouped_matmul_pallas(x, w, g, s, config=cfg)  # noqa: E731
                total_ms, kern_ms = kernel_times_ms(f, x, gid, w, s)
                out[f"{fm.value}/prefill{tokens}/variant_b"] = dict(config=str(cfg), op_ms=total_ms, kernel_ms=kern_ms)
                TABLE.append(f"{fm.value:4s} prefill {tokens:6d}x6  variant b ({cfg.block_m}x{cfg.block_n}x{cfg.block_k}) "
                             f"op {total_ms:.3f} ms kernel {kern_ms} ms")
    return out


def _ragged_dot_rows(x, g, w_gnk):
    order = jnp.argsort(g, stable=True)
    sizes = jnp.zeros((w_gnk.shape[0],), jnp.int32).at[g].add(1)
    y = jax.lax.ragged_dot(x[order], jnp.swapaxes(w_gnk, 1, 2), sizes)
    return jnp.zeros_like(y).at[order].set(y)


@section("invariance", 60)
def _():
    out = {}
    key = jax.random.key(6)
    probe_x = rows(jax.random.key(7), 1)[0]
    probe_g = jnp.int32(PROBE_G)
    cases = invariance_cases(key, probe_x, probe_g)
    few = [c for c in cases if c[0] in ("M=5", "all 64 in one", "uneven 150+150")]   # fewer compiles

    def run_check(label, fn, cases=cases):
        alone = bits(fn(probe_x[None], probe_g[None])[0])
        bad = [name for name, x, gid, p in cases if not np.array_equal(bits(fn(x, gid)[p]), alone)]
        out[label] = "bitwise identical in all cases" if not bad else f"DIFFERS in {bad}"
        TABLE.append(f"invariance {label:34s} {out[label]}")
        RESULTS["sections"]["invariance (partial)"] = dict(out)
        save()
        return alone

    for fmt in (WeightFormat.FP4, WeightFormat.BF16, WeightFormat.FP8):
        if left() < 25:
            out[fmt.value] = "skipped (time)"
            continue
        w, s = weights(fmt)
        cfg = decode_cfg(fmt)
        alone = run_check(f"kernel {fmt.value} decode_cfg",
                          lambda x, g, w=w, s=s, cfg=cfg: grouped_matmul_pallas(x, w, g, s, config=cfg),
                          cases if fmt is WeightFormat.FP4 else few)
        if fmt is WeightFormat.FP4:      # the decoder the model picks when the scales allow it
            sub = dataclasses.replace(cfg, fp4_dequant="subnormal")
            sub_alone = run_check("kernel fp4 decode_cfg subnormal",
                                  lambda x, g, w=w, s=s, cfg=sub: grouped_matmul_pallas(x, w, g, s, config=cfg), few)
            out["fp4 subnormal == packed"] = bool(np.array_equal(sub_alone, alone))
            TABLE.append(f"invariance fp4 subnormal == packed (probe row): {out['fp4 subnormal == packed']}")
            e4 = dataclasses.replace(cfg, fp4_operands="e4m3")     # x rounded to FP8 row by row: still row-local
            run_check("kernel fp4 decode_cfg e4m3",
                      lambda x, g, w=w, s=s, cfg=e4: grouped_matmul_pallas(x, w, g, s, config=cfg), few)
        other = bits(grouped_matmul_pallas(probe_x[None], w, probe_g[None], s, config=prefill_cfg(fmt))[0])
        out[f"{fmt.value} decode_cfg vs prefill_cfg"] = bool(np.array_equal(alone, other))
        TABLE.append(f"invariance kernel {fmt.value} decode vs prefill config bitwise equal: {out[f'{fmt.value} decode_cfg vs prefill_cfg']}")
        if fmt is WeightFormat.BF16 and left() > 20:
            # The weights go in as arguments: a closure would bake 9 GB of constants into the HLO
            # (that stalled the first H200 run in lowering).
            ragged = jax.jit(_ragged_dot_rows)
            run_check("negative control lax.ragged_dot", lambda x, g: ragged(x, g, w), few)
            dense = jax.jit(lambda x, w_nk: (x @ w_nk.T).astype(jnp.bfloat16))
            run_check("negative control dense x@W[probe]", lambda x, g: dense(x, w[PROBE_G]))
    return out


@section("ragged_dot_mgpu", 40)
def _():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    out = {}
    w, _ = weights(WeightFormat.BF16)
    for tokens in TOKENS[1:3]:
        if left() < 20:
            break
        m = tokens * TOP_K
        gid = jnp.sort(routing(jax.random.key(tokens), tokens))
        sizes = jnp.zeros((G_EXPERTS,), jnp.int32).at[gid].add(1)
        x = rows(jax.random.key(tokens + 1), m)
        f = jax.jit(lambda x, w, s: ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=s, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2,
            transpose_rhs=True))
        t = time.time()
        total_ms, kern_ms = kernel_times_ms(f, x, w, sizes, iters=5)
        tf = 2 * m * N_WIDTH * K_HIDDEN / (total_ms * 1e-3) / 1e12
        out[f"bf16/{tokens}"] = dict(ms=total_ms, tflops=tf, first_call_s=time.time() - t)
        TABLE.append(f"jax ragged_dot_mgpu bf16 {tokens:6d}x6  {total_ms:7.3f} ms {tf:6.1f} TF/s "
                     f"(first call {time.time() - t:.0f} s)")
    return out


# The old kernel first: the others are compared with its output bit for bit. Then the most telling ones,
# in case the time budget cuts the list.
_AB_VARIANTS = {
    WeightFormat.FP4: (("arith/wait0 (old)", dict(fp4_dequant="arith", overlap_wgmma=False)),
                       ("bits/overlap (new)", dict(fp4_dequant="bits", overlap_wgmma=True)),
                       ("packed/overlap", dict(fp4_dequant="packed", overlap_wgmma=True)),
                       ("arith/overlap", dict(fp4_dequant="arith", overlap_wgmma=True)),
                       ("bits/wait0", dict(fp4_dequant="bits", overlap_wgmma=False)),
                       ("packed/wait0", dict(fp4_dequant="packed", overlap_wgmma=False))),
    WeightFormat.FP8: (("wait0 (old)", dict(overlap_wgmma=False)),
                       ("overlap (new)", dict(overlap_wgmma=True))),
}


@section("dequant_ab", 30)
def _():
    import dataclasses
    out = {}
    ceil_copy = CEIL.get("copy_tb_s")
    iters = 1 if INTERPRET else 10
    for fmt in (WeightFormat.FP4, WeightFormat.FP8):
        w, s = weights(fmt)
        for phase, tokens in (("decode", TOKENS[0]), ("decode", TOKENS[1]), ("prefill", TOKENS[3])):
            m = tokens * TOP_K
            gid = routing(jax.random.key(tokens), tokens)
            x = rows(jax.random.key(tokens + 1), m)
            active = int(jnp.unique(gid).shape[0])
            base = decode_cfg(fmt) if phase == "decode" else prefill_cfg(fmt)
            y_old = None
            for name, extra in _AB_VARIANTS[fmt]:
                key = f"{fmt.value}/{phase}{tokens}/{name}"
                if left() < 10:
                    out[key] = "skipped (time)"
                    continue
                cfg = dataclasses.replace(base, **extra)
                f = lambda x, g, w, s, cfg=cfg: grouped_matmul_pallas(x, w, g, s, config=cfg)  # noqa: E731
                try:    # one variant failing to compile (inline PTX is only assembled here) must not end the A/B
                    y = jax.block_until_ready(f(x, gid, w, s))
                    same = None if y_old is None else bool(jnp.array_equal(   # on the device: prefill y is 0.9 GB
                        jax.lax.bitcast_convert_type(y, jnp.uint16), jax.lax.bitcast_convert_type(y_old, jnp.uint16)))
                    if y_old is None:
                        y_old = y
                    total_ms, kern_ms = kernel_times_ms(f, x, gid, w, s, iters=iters)
                except Exception as e:  # noqa: BLE001
                    out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                    TABLE.append(f"AB {fmt.value:4s} {phase:7s} {tokens:6d}x6 {name:20s} ERROR {type(e).__name__}")
                    traceback.print_exc()
                    continue
                out[key] = timing_record(f"AB {fmt.value:4s} {phase:7s} {tokens:6d}x6 {name:20s}", fmt, cfg, m,
                                         active, total_ms, kern_ms, ceil_copy, "old", same)
            del y_old
    return out


def _cfg(bm, bn, bk, stages, **extra):
    return GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, stages=stages, a_from_registers=not INTERPRET,
                               **extra)


_SUB, _PERS, _NOSW = dict(fp4_dequant="subnormal"), dict(persistent=True), dict(swizzle_weights=False)
_PS = {**_PERS, **_SUB}
_TM = dict(weights_tile_major=True)


# (format, phase, tokens, configs): the first config of each case is the reference for the bitwise
# check (rows must not change with the tiles: only speed may). Round 1 (2026-12-03) compared the old
# default 64x128x128x4 with smaller / wider tiles (results/grouped_gemm_sweep_2026-12-03.json); round 2
# starts from round 1's winners (the model's tuned_config) and tries deeper weight pipelines for FP4 decode.
_SWEEP_ROUNDS = {
    "1": (
        (WeightFormat.FP4, "decode", 64, (_cfg(64, 128, 128, 4), _cfg(32, 128, 128, 4), _cfg(16, 128, 128, 8),
                                        _cfg(16, 128, 256, 8), _cfg(8, 128, 256, 8), _cfg(16, 256, 128, 6),
                                        _cfg(16, 128, 512, 4))),
        (WeightFormat.FP4, "decode", 512, (_cfg(64, 128, 128, 4), _cfg(32, 128, 128, 4), _cfg(16, 128, 256, 8),
                                        _cfg(32, 128, 256, 6), _cfg(16, 256, 128, 6))),
        (WeightFormat.FP4, "prefill", 32768, (_cfg(64, 128, 128, 4), _cfg(128, 128, 128, 4), _cfg(128, 128, 64, 6),
                                         _cfg(64, 256, 128, 4), _cfg(128, 256, 64, 3))),
        (WeightFormat.FP8, "decode", 512, (_cfg(64, 128, 128, 4), _cfg(16, 128, 256, 6), _cfg(16, 128, 128, 8))),
    ),
    "2": (
        (WeightFormat.FP4, "decode", 64, (_cfg(16, 256, 128, 6), _cfg(16, 256, 128, 8), _cfg(16, 256, 256, 4),
                                        _cfg(16, 256, 128, 10), _cfg(16, 256, 64, 12), _cfg(16, 256, 128, 4),
                                        _cfg(16, 128, 128, 6), _cfg(8, 256, 128, 8))),
        (WeightFormat.FP4, "decode", 512, (_cfg(16, 256, 128, 6), _cfg(16, 256, 128, 8), _cfg(16, 256, 256, 4),
                                        _cfg(16, 256, 128, 10), _cfg(32, 256, 128, 6))),
        (WeightFormat.FP4, "mid", 8192, (_cfg(64, 256, 128, 4), _cfg(128, 256, 64, 3), _cfg(64, 256, 64, 6),
                                     _cfg(32, 256, 128, 6))),
        (WeightFormat.FP8, "decode", 512, (_cfg(16, 128, 256, 5), _cfg(16, 256, 128, 6), _cfg(16, 128, 128, 10))),
    ),
    # Round 3 (2026-12-04): the tuned tiles with the "subnormal" FP4 decoder (2.5 ALU ops per element
    # instead of 3.75: does the decode rate follow the ALU work?) and with the persistent launch (one CTA
    # per SM, the TMA ring kept full across items: does it follow the per-CTA fill and drain?).
    "3": (
        (WeightFormat.FP4, "decode", 64, (_cfg(16, 256, 128, 8), _cfg(16, 256, 128, 8, **_SUB),
                                        _cfg(16, 256, 128, 8, **_PERS), _cfg(16, 256, 128, 8, **_SUB, **_PERS),
                                        _cfg(16, 128, 128, 8, **_SUB, **_PERS))),
        (WeightFormat.FP4, "decode", 512, (_cfg(16, 256, 128, 8), _cfg(16, 256, 128, 8, **_SUB),
                                        _cfg(16, 256, 128, 8, **_PERS), _cfg(16, 256, 128, 8, **_SUB, **_PERS))),
        (WeightFormat.FP4, "prefill", 32768, (_cfg(128, 256, 64, 3), _cfg(128, 256, 64, 3, **_SUB),
                                         _cfg(128, 256, 64, 3, **_PERS), _cfg(128, 256, 64, 3, **_SUB, **_PERS))),
        (WeightFormat.FP8, "decode", 512, (_cfg(16, 256, 128, 5), _cfg(16, 256, 128, 5, **_PERS))),
    ),
    # Round 4 (2026-12-04): ncu on round 3's FP4 decode kernel showed the producer waiting on the ring
    # (consumer-bound), the consumers stalled on shared-memory loads (short scoreboard) and those loads
    # 4-way bank-conflicted (60 % excess wavefronts). Swizzled weight tiles (``swizzle_weights``) vs
    # the unswizzled ones (the first of each case, round 3's best).
    "4": (
        (WeightFormat.FP4, "decode", 64, (_cfg(16, 256, 128, 8, **_PERS, **_NOSW), _cfg(16, 256, 128, 8, **_PERS),
                                        _cfg(16, 256, 128, 8, **_PERS, **_SUB))),
        (WeightFormat.FP4, "decode", 512, (_cfg(16, 256, 128, 8, **_PERS, **_NOSW), _cfg(16, 256, 128, 8, **_PERS),
                                        _cfg(16, 256, 128, 8, **_PERS, **_SUB))),
        (WeightFormat.FP4, "prefill", 32768, (_cfg(128, 256, 64, 3, **_PERS, **_NOSW), _cfg(128, 256, 64, 3, **_PERS),
                                         _cfg(128, 256, 64, 3, **_PERS, **_SUB))),
        (WeightFormat.FP8, "decode", 512, (_cfg(16, 256, 128, 5, **_NOSW), _cfg(16, 256, 128, 5),
                                        _cfg(16, 256, 128, 5, **_PERS))),
    ),
    # Round 5 (2026-12-04): prefill chunks of 1024-2048 tokens put 16-32 rows on each expert. A 32k prefill
    # spent 2.5 of its 5.3 s in Mosaic kernels: with 16-row tiles an expert of 17-32 rows takes two tiles,
    # so its weights are read and dequantized twice, and the kernel is dequant-bound. Wider M tiles.
    "5": (
        (WeightFormat.FP4, "chunk", 1024, (_cfg(16, 256, 128, 8, **_PS), _cfg(32, 256, 128, 8, **_PS),
                                          _cfg(64, 256, 128, 6, **_PS), _cfg(32, 128, 128, 8, **_PS),
                                          _cfg(64, 128, 128, 6, **_PS))),
        (WeightFormat.FP4, "chunk", 2048, (_cfg(128, 256, 64, 3, **_PS), _cfg(32, 256, 128, 8, **_PS),
                                          _cfg(64, 256, 128, 6, **_PS), _cfg(64, 128, 128, 6, **_PS),
                                          _cfg(16, 256, 128, 8, **_PS))),
    ),
    # Round 6 (2026-12-04): where the 64-row tiles stop paying: 64 rows per expert (4096-token chunks).
    "6": (
        (WeightFormat.FP4, "chunk", 4096, (_cfg(128, 256, 64, 3, **_PS), _cfg(64, 256, 128, 6, **_PS))),
    ),
    # Round 7 (2026-12-05; results/grouped_gemm_sweep7_2026-12-05.json, NOTES.md): y written as rows
    # from the registers (``out_rows``, the default since) vs the y^T tile through shared memory and
    # TMA. The op times include the un-permute: a row gather for the first config of each case, the
    # compaction + transpose or transposed gather for the second. Predicted: kernels within 2 %, the op 0.1-0.3 ms faster per call (the un-permute of y^T
    # cost 1.2 ms a decode step of 12 w2 calls, 77 ms of the 32k prefill's 192 layer-chunks). The third
    # config spends the shared memory the y^T tile held (64-128 KB at these tiles) on deeper TMA rings
    # (``fit`` trims the stages to what fits): the chunk GEMMs run at ~2.5x their weight-read time.
    # Decode also tries 8-row tiles again: round 2 (grid launch, y^T) timed 8x256x128x8 at 0.790 ms
    # against 0.830 for 16 rows; they halve the padded rows the XLA work around the kernel touches.
    "7": tuple(
        (WeightFormat.FP4, phase, tokens, (_cfg(*tiles, **_PS), _cfg(*tiles, **_PS, out_rows=False),
                                           _cfg(*tiles[:3], deeper, **_PS)) + extra)
        for phase, tokens, tiles, deeper, extra in (
            ("decode", 64, (16, 256, 128, 8), 10, (_cfg(8, 256, 128, 8, **_PS), _cfg(8, 256, 128, 10, **_PS))),
            ("chunk", 2048, (64, 256, 128, 4), 6, ()),
            ("chunk", 4096, (64, 256, 128, 4), 6, ()),
            ("prefill", 32768, (128, 256, 64, 3), 8, ()))
    ),
    # Round 8 (2026-12-05): four consumer warpgroups (``consumers=4``, 64 weight rows each, 96-112
    # registers a thread where 2 take 168-232) at the decode tiles. ncu (2026-12-04) found the FP4 decode
    # consumer-bound with 2 consumer warps per scheduler issuing 0.67 instructions a cycle: 4 warps per
    # scheduler should hide more of the dequantization's latency. ptxas (deviceless): 96 registers, no
    # spills. Also at 8 rows per expert (512 tokens), where 16-row tiles are the table's choice.
    "8": (
        (WeightFormat.FP4, "decode", 64, (_cfg(8, 256, 128, 8, **_PS), _cfg(8, 256, 128, 8, **_PS, consumers=4),
                                        _cfg(16, 256, 128, 8, **_PS), _cfg(16, 256, 128, 8, **_PS, consumers=4),
                                        _cfg(8, 512, 128, 4, **_PS, consumers=4))),
        (WeightFormat.FP4, "decode", 512, (_cfg(16, 256, 128, 8, **_PS), _cfg(16, 256, 128, 8, **_PS, consumers=4))),
        (WeightFormat.FP4, "chunk", 2048, (_cfg(64, 256, 128, 4, **_PS), _cfg(64, 256, 128, 4, **_PS, consumers=4))),
    ),
    # Round 9 (2026-12-05, session 17): ncu (H100) on the FP4 decode kernel: DRAM 62 % of peak, L2 72 %,
    # issue slots 53 % busy with 2 consumers and 60 % with 4, at the same 0.775 ms: not the consumers. Each
    # K step reads 256 row pieces of 64 bytes, 2,560 bytes apart; FP8 (128-byte pieces) and bf16 (256)
    # reached 81-82 % of copy. Tile-major weights (``weights_tile_major``, "-tm": each step one contiguous
    # 16 KB run) and 128-byte pieces (block_k 256) against the stored layout.
    "9": (
        (WeightFormat.FP4, "decode", 64, (_cfg(8, 256, 128, 8, **_PS), _cfg(8, 256, 128, 8, **_PS, **_TM),
                                        _cfg(8, 256, 256, 5, **_PS), _cfg(8, 256, 256, 5, **_PS, **_TM),
                                        _cfg(8, 256, 128, 8, **_PS, **_TM, consumers=4),
                                        _cfg(8, 256, 128, 12, **_PS, **_TM))),
        (WeightFormat.FP4, "decode", 512, (_cfg(16, 256, 128, 8, **_PS), _cfg(16, 256, 128, 8, **_PS, **_TM))),
        (WeightFormat.FP4, "chunk", 2048, (_cfg(64, 256, 128, 4, **_PS), _cfg(64, 256, 128, 4, **_PS, **_TM))),
        (WeightFormat.FP4, "prefill", 32768, (_cfg(128, 256, 64, 8, **_PS), _cfg(128, 256, 64, 8, **_PS, **_TM))),
    ),
    # Round 10 (2026-12-06, session 21): round 9 on the H200 had 4 consumers best at 64 x 6 (0.560 against
    # 0.594 ms, tile-major), now the table's choice. Its ring depth, and 4 consumers at the other
    # tile-major phases the engine runs.
    "10": (
        (WeightFormat.FP4, "decode", 64, (_cfg(8, 256, 128, 8, **_PS, **_TM, consumers=4),
                                        _cfg(8, 256, 128, 6, **_PS, **_TM, consumers=4),
                                        _cfg(8, 256, 128, 10, **_PS, **_TM, consumers=4),
                                        _cfg(8, 256, 128, 8, **_PS, **_TM))),
        (WeightFormat.FP4, "decode", 512, (_cfg(16, 256, 128, 8, **_PS, **_TM),
                                         _cfg(16, 256, 128, 8, **_PS, **_TM, consumers=4),
                                         _cfg(8, 256, 128, 8, **_PS, **_TM, consumers=4))),
        (WeightFormat.FP4, "chunk", 2048, (_cfg(64, 256, 128, 4, **_PS, **_TM),
                                         _cfg(64, 256, 128, 4, **_PS, **_TM, consumers=4))),
    ),
    # Round 11 (2026-12-06, session 22; NOTES item -21): the FP4 decode kernel is issue-bound at ~20 weight
    # elements a cycle per SM. FP8 wgmmas on bit-moved weights (``fp4_operands="e4m3"``, "-e4m3": 7 ALU
    # ops per 8 elements instead of ~20, K=32 a wgmma instead of 16, plus a scaled add per 32 K) against
    # the table's bf16 form at the same tiles. Predicted: 64 x 6 0.556 -> ~0.45 ms. The e4m3 rows are
    # bitwise checked against the first e4m3 config, and their largest difference from the first (bf16)
    # config is recorded relative to its largest |y| (x is FP8 per 32 columns here, so both forms
    # compute the same products; only the rounding of the partial sums differs). Measured on an H100
    # (results/grouped_gemm_sweep11_h100_2026-12-06_s22.json): decode 0.573 -> 0.551 ms at 64 x 6, 0.956 ->
    # 0.897 at 512 x 6; chunk and prefill lost (ptxas spills at 64- and 128-row tiles); 3.1e-5 apart.
    "11": (_ROUND_11 := tuple(
        (WeightFormat.FP4, phase, tokens, (_cfg(*tiles, **_PS, **_TM, consumers=4),
                                           _cfg(*tiles, **_PS, **_TM, consumers=4, fp4_operands="e4m3")) + extra)
        for phase, tokens, tiles, extra in (
            ("decode", 64, (8, 256, 128, 8), (_cfg(8, 256, 128, 6, **_PS, **_TM, consumers=4, fp4_operands="e4m3"),
                                              _cfg(8, 256, 128, 8, **_PS, **_TM, fp4_operands="e4m3"),
                                              _cfg(16, 256, 128, 8, **_PS, **_TM, consumers=4, fp4_operands="e4m3"))),
            ("decode", 512, (16, 256, 128, 8), (_cfg(8, 256, 128, 8, **_PS, **_TM, consumers=4,
                                                     fp4_operands="e4m3"),)),
            ("chunk", 2048, (64, 256, 128, 4), ()),
            ("prefill", 32768, (128, 256, 64, 8), ()))
    )),
    # Round 12: round 11's decode cases, and the chunk case at the E4M3 form's spill-free 32-row tile
    # (the form lost at the 64- and 128-row tiles on the H100, 1.232 -> 1.513 ms and 7.8 -> 143 ms,
    # where ptxas spills), for a short call on the H200.
    # "-ov": ``e4m3_overlap`` (block c's bit moves while block c-1's wgmma runs; same bits).
    "12": tuple((f, p, t, cfgs + (dataclasses.replace(cfgs[1], e4m3_overlap=True),))
                for f, p, t, cfgs in _ROUND_11 if p == "decode") + (
        (WeightFormat.FP4, "chunk", 2048, (_cfg(64, 256, 128, 4, **_PS, **_TM, consumers=4),
                                         _cfg(32, 256, 128, 6, **_PS, **_TM, consumers=4, fp4_operands="e4m3"))),),
    # Round 13 (session 23, after round 12 on the H200: the E4M3 form with overlapped blocks is the decode
    # default): its tile at each decode size, the first config the tuned table's pick. The B=256 step
    # (256 x 6: 4 rows per expert) takes 16-row tiles by FEW_ROWS_PER_GROUP = 2, a switch set on the bf16
    # form at 1 row per expert and never measured at 4; and 2 consumers, even with 4 at 64 x 6 without
    # the overlap (0.395 vs 0.405 ms), is untried with it.
    "13": tuple(
        (WeightFormat.FP4, "decode", tokens, tuple(
            _cfg(bm, 256, 128, 8, **_PS, **_TM, consumers=c, fp4_operands="e4m3", e4m3_overlap=True)
            for bm, c in ((first, 4),) + tuple(t for t in ((8, 4), (8, 2), (16, 4), (16, 2)) if t != (first, 4))))
        for tokens, first in ((64, 8), (256, 16), (512, 16))),
}
SWEEP_ROUND = os.environ.get("GG_SWEEP_ROUND", "5")


@section("sweep", 30)
def _():
    """Tile configs at the model's output dtype (float32): kernel time, weight bandwidth, TFLOP/s."""
    out = {}
    ceil_copy = CEIL.get("copy_tb_s")
    iters = 1 if INTERPRET else 10
    for fmt, phase, tokens, cfgs in _SWEEP_ROUNDS[SWEEP_ROUND]:
        w, s = weights(fmt)
        m = tokens * TOP_K
        gid = routing(jax.random.key(tokens), tokens)
        x = rows(jax.random.key(tokens + 1), m)
        if any(c.fp4_operands == "e4m3" for c in cfgs):
            x = fp8_per_32(x)
        active = int(jnp.unique(gid).shape[0])
        y_refs, y_first = {}, None      # the first output of each operand form, and of the case
        w_cfg = None                    # (bound even when the time runs out before the case's first config)
        for cfg in cfgs:
            cfg = fit(cfg, fmt, jnp.float32)
            name = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}x{cfg.stages}"
            name += "-sub" * (cfg.fp4_dequant == "subnormal" and fmt is WeightFormat.FP4) + "-pers" * cfg.persistent
            name += "-nosw" * (not cfg.swizzle_weights) + "-yT" * (not cfg.out_rows) + "-c4" * (cfg.consumers == 4)
            name += "-tm" * cfg.weights_tile_major + "-e4m3" * (cfg.fp4_operands == "e4m3") + "-ov" * cfg.e4m3_overlap
            key = f"{fmt.value}/{phase}{tokens}/{name}"
            if left() < 10:
                out[key] = "skipped (time)"
                continue
            w_cfg = tile_major_weights(w, cfg.block_n, cfg.block_k) if cfg.weights_tile_major else w
            f = lambda x, g, w, s, cfg=cfg: grouped_matmul_pallas(x, w, g, s, out_dtype=jnp.float32, config=cfg)  # noqa: E731
            t_first = time.time()
            try:
                y = jax.block_until_ready(f(x, gid, w_cfg, s))
                first_s = time.time() - t_first
                y_ref = y_refs.get(cfg.fp4_operands)
                same = None if y_ref is None else bool(jnp.array_equal(
                    jax.lax.bitcast_convert_type(y, jnp.uint32), jax.lax.bitcast_convert_type(y_ref, jnp.uint32)))
                extra = {}
                if y_first is None:
                    y_first = y
                elif y_ref is None:     # another operand form: how far from the case's first output
                    extra["max_diff_vs_first_rel"] = float(jnp.max(jnp.abs(y - y_first)) / jnp.max(jnp.abs(y_first)))
                    print(f"  {name}: max |y - first| / max |first| = {extra['max_diff_vs_first_rel']:.3e}")
                if y_ref is None:
                    y_refs[cfg.fp4_operands] = y
                del y
                total_ms, kern_ms = kernel_times_ms(f, x, gid, w_cfg, s, iters=iters)
            except Exception as e:  # noqa: BLE001 - one config failing must not end the sweep
                out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                TABLE.append(f"sweep {fmt.value:4s} {phase:7s} {tokens:6d}x6 {name:23s} ERROR {type(e).__name__}")
                traceback.print_exc()
                continue
            out[key] = timing_record(f"sweep {fmt.value:4s} {phase:7s} {tokens:6d}x6 {name:23s}", fmt, cfg, m,
                                     active, total_ms, kern_ms, ceil_copy, "first", same, first_call_s=first_s,
                                     **extra)
            RESULTS["sections"]["sweep (partial)"] = out      # kept if a later config hangs the call
            save()
        del y_refs, y_first, w_cfg
        if phase != "decode" and left() > 15 and not INTERPRET:
            dense = dense_tflops(m)
            out[f"dense_bf16_tflops/{tokens}"] = dense
            TABLE.append(f"sweep dense bf16 matmul of the same FLOPs ({m}x{K_HIDDEN}x{N_WIDTH}): {dense:.0f} TF/s")
    return out


def w13_pairs():
    """An expert FFN's (w1, w3) as the engine holds them: FP4 tile-major weights and kernel-layout scales."""
    from pallas_kernels.grouped_gemm.scales import kernel_scales

    fmt = WeightFormat.FP4
    w1, s1 = weights(fmt)
    w3, s3 = make_weights(fmt, jax.random.key(5))
    return [(tile_major_weights(w, *TILE_MAJOR_TILE), kernel_scales(s, fmt, N_WIDTH)) for w, s in ((w1, s1), (w3, s3))]


def w13_rows(tokens: int, cfg: GroupedMatmulConfig):
    """(plan, x_pk, routed rows): ``tokens`` x top-6 routed rows of E4M3-valued activations in tile order
    for cfg (E4M3 rows where cfg takes them)."""
    from pallas_kernels.grouped_gemm.config import uses_e4m3_rows
    from pallas_kernels.grouped_gemm.kernel import tile_rows

    gid = routing(jax.random.key(tokens), tokens)
    x = fp8_per_32(rows(jax.random.key(tokens + 1), tokens))
    plan, x_pk = tile_rows(x, gid, num_groups=G_EXPERTS, block_m=cfg.block_m, fp4=True,
                           e4m3=uses_e4m3_rows(cfg, WeightFormat.FP4), rows_per_source=TOP_K)
    return plan, x_pk, gid.shape[0]


@section("w13", 30)
def _():
    """An expert FFN's w1 and w3 (FP4, the engine's configs and tile-major layout) as one launch
    (``grouped_matmul_tiles(..., more=)``) against two launches on the same tile rows: kernel ms of
    each and whether the outputs are the same bits (they should be)."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_tiles

    out, pairs = {}, w13_pairs()
    iters = 1 if INTERPRET else 10
    for phase, tokens in zip(("decode", "decode", "prefill"), TOKENS[:3]):
        key = f"{phase}{tokens}"
        if left() < 15:
            out[key] = "skipped (time)"
            continue
        cfg = engine_fp4_cfg(tokens, "e4m3" if phase == "decode" else "bf16")
        plan, x_pk, _ = w13_rows(tokens, cfg)
        # (the weights are arguments: closed over, jit would embed their 4.8 GB as constants, which on the
        # H100 of 2026-12-07 did not finish lowering within the call's 150 s)
        run = lambda xp, w, s, more=(), cfg=cfg, plan=plan: grouped_matmul_tiles(  # noqa: E731
            plan, xp, w, s, config=cfg, scales_prepared=True, more=more)
        one = jax.jit(lambda xp, p1, p3: run(xp, *p1, more=(p3,)))
        two = jax.jit(lambda xp, p1, p3: (run(xp, *p1), run(xp, *p3)))
        used = np.repeat(np.asarray(plan.tile_group) >= 0, cfg.block_m)
        y_two = jnp.concatenate(two(x_pk, *pairs), axis=1)
        same = bool(np.array_equal(bits(one(x_pk, *pairs))[used], bits(y_two)[used]))
        del y_two
        one_ms, _ = kernel_times_ms(one, x_pk, *pairs, iters=iters)
        two_ms, _ = kernel_times_ms(two, x_pk, *pairs, iters=iters)
        out[key] = dict(one_launch_ms=one_ms, two_launches_ms=two_ms, same_bits=same,
                        config=f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}x{cfg.stages} c{cfg.consumers} "
                               f"{cfg.fp4_operands}")
        TABLE.append(f"w13 {phase:7s} {tokens:6d}x6: one launch {one_ms:.3f} ms, two {two_ms:.3f} ms "
                     f"({one_ms / two_ms:.3f}x), same bits: {same}")
    return out


def swiglu_quant_ab(tokens, cfg, plan, x_pk, pairs, row_w, limit, iters, used) -> dict:
    """The h that w2 reads (bf16, FP8-quantized per 32 columns, in the FP4 K order) made two ways: the
    float32 epilogue + the model's quantizer in XLA (``Numerics.expert_swiglu_quant`` off), and the
    quantizer in the epilogue (``swiglu_tiles(out_dtype=bf16, act_block=32)``, on): the same bits
    expected, and ms of each."""
    from deepinfer_jax.model.numerics import fake_quant_fp8
    from pallas_kernels.grouped_gemm.config import WeightFormat
    from pallas_kernels.grouped_gemm.kernel import swiglu_config, swiglu_tiles, to_fp4_k_order

    q_cfg = swiglu_config(cfg, WeightFormat.FP4, jnp.bfloat16, 32)
    if q_cfg is None:
        return dict(quant="not supported by this config")

    def xla_quant(xp, p1, p3, rw):
        h = swiglu_tiles(plan, xp, *p1, *p3, rw, limit=limit, config=cfg, scales_prepared=True)
        return to_fp4_k_order(fake_quant_fp8(h.astype(jnp.bfloat16), 32))

    def in_kernel(xp, p1, p3, rw):
        return to_fp4_k_order(swiglu_tiles(plan, xp, *p1, *p3, rw, limit=limit, config=q_cfg, scales_prepared=True,
                                           out_dtype=jnp.bfloat16, act_block=32))

    a, b = jax.jit(xla_quant), jax.jit(in_kernel)
    same = bool(np.array_equal(np.asarray(a(x_pk, *pairs, row_w)).view(np.uint16)[used],
                               np.asarray(b(x_pk, *pairs, row_w)).view(np.uint16)[used]))
    a_ms, _ = kernel_times_ms(a, x_pk, *pairs, row_w, iters=iters)
    b_ms, _ = kernel_times_ms(b, x_pk, *pairs, row_w, iters=iters)
    TABLE.append(f"swiglu+quant {tokens:6d}x6: quantizer in the epilogue {b_ms:.3f} ms ({q_cfg.stages} stages), "
                 f"float32 epilogue + XLA quantizer {a_ms:.3f} ms ({b_ms / a_ms:.3f}x), same bits: {same}")
    return dict(quant_in_kernel_ms=b_ms, quant_xla_ms=a_ms, quant_same_bits=same, quant_stages=q_cfg.stages)


@section("swiglu", 30)
def _():
    """w1/w3 + SwiGLU in one launch (``swiglu_tiles``) against w1/w3 in one launch + XLA's SwiGLU, at the
    prefill rows; both write h float32 in tile order."""
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_tiles, swiglu_tiles

    out, limit, pairs = {}, 10.0, w13_pairs()
    iters = 1 if INTERPRET else 10
    for tokens in TOKENS[2:]:
        key = f"prefill{tokens}"
        if left() < 20:
            out[key] = "skipped (time)"
            continue
        cfg = engine_fp4_cfg(tokens, "bf16")
        plan, x_pk, routed = w13_rows(tokens, cfg)
        row_w = jnp.where(plan.row_src < routed, jax.random.uniform(jax.random.key(9), plan.row_src.shape), 0.0)

        def w13(xp, p1, p3, cfg=cfg, plan=plan):
            return grouped_matmul_tiles(plan, xp, *p1, config=cfg, scales_prepared=True, more=(p3,))

        def xla_tail(xp, p1, p3, rw):
            y13 = w13(xp, p1, p3)
            g, u = y13[:, :N_WIDTH], y13[:, N_WIDTH:]
            return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit) * rw[:, None]

        fused = jax.jit(lambda xp, p1, p3, rw, cfg=cfg, plan=plan: swiglu_tiles(
            plan, xp, *p1, *p3, rw, limit=limit, config=cfg, scales_prepared=True))
        unfused, w13_alone = jax.jit(xla_tail), jax.jit(w13)
        used = np.repeat(np.asarray(plan.tile_group) >= 0, cfg.block_m)
        h_f, h_x = (np.asarray(f(x_pk, *pairs, row_w))[used] for f in (fused, unfused))
        rel = float(np.abs(h_f - h_x).max() / max(np.abs(h_x).max(), 1e-30))
        del h_f, h_x
        fused_ms, _ = kernel_times_ms(fused, x_pk, *pairs, row_w, iters=iters)
        unfused_ms, _ = kernel_times_ms(unfused, x_pk, *pairs, row_w, iters=iters)
        w13_ms, _ = kernel_times_ms(w13_alone, x_pk, *pairs, iters=iters)    # the launch without its tail
        out[key] = dict(fused_ms=fused_ms, unfused_ms=unfused_ms, w13_launch_ms=w13_ms, max_rel_diff=rel,
                        config=f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}x{cfg.stages} c{cfg.consumers}")
        TABLE.append(f"swiglu prefill {tokens:6d}x6: epilogue {fused_ms:.3f} ms, w13 launch + XLA {unfused_ms:.3f} ms "
                     f"({fused_ms / unfused_ms:.3f}x; the w13 launch alone {w13_ms:.3f}), "
                     f"max |diff| / max |h| {rel:.2e}")
        out[key].update(swiglu_quant_ab(tokens, cfg, plan, x_pk, pairs, row_w, limit, iters, used))
    return out


save()
print("\n==== grouped_gemm_gpu summary ({:.0f} s) ====".format(time.time() - T0))
print(RESULTS["device"], "jax", RESULTS["jax"])
for line in TABLE:
    print(line)
_INTERPRET_STACK.__exit__(None, None, None)  # (a nullcontext on the GPU: no close())
