"""One grouped-GEMM launch per config, for Nsight Compute (ncu) on the GPU machine: where a kernel's warps stall.

    ncu --clock-control none -k regex:mosaic --launch-skip 0 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
        -o $OUT/gg python3 benchmarks/grouped_gemm_ncu.py fp4-decode fp8-decode
    ncu --import $OUT/gg.ncu-rep --page details > $OUT/gg_details.txt
    ncu --import $OUT/gg.ncu-rep --launch-skip 1 --launch-count 1 --page source --print-source sass --csv \
        > $OUT/fp4_sass.csv
    python3 benchmarks/grouped_gemm_ncu.py --summarize $OUT/fp4_sass.csv [weight elements]

``--summarize`` reads a source-page CSV, or its .gz (any machine): instructions and stall samples by opcode, stall
reasons, the samples' share per 100-instruction window of the code, shared-memory wavefronts against the ideal, the hottest instruction's share of the samples
(on 2026-12-04 the producer's barrier-wait branch), and, given the kernel's weight element count,
thread-instructions per weight element.

Cases (argv, in launch order): fp4-decode / fp8-decode (64 tokens x top-6), fp4-decode-c4 (4 consumer
warpgroups) and fp4-prefill (8k x 6)
at the V4.1-Flash expert shape (hidden 5120 -> width 2304, 384 experts), each with the model's tile
config (``tuned_config``). Each case compiles, runs once to warm up (outside the profiled kernel
count only if --launch-skip says so: the warm-up is the case's first Mosaic launch) and once more.
Random weights and routing, as in ``grouped_gemm_gpu.py``; no timing here (ncu replays each kernel).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.grouped_gemm.config import GroupedMatmulConfig, WeightFormat, tuned_config  # noqa: E402
from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas  # noqa: E402

K, N, G, TOP_K = 5120, 2304, 384, 6
CASES = {"fp4-decode": (WeightFormat.FP4, 64), "fp8-decode": (WeightFormat.FP8, 64),
         "fp4-prefill": (WeightFormat.FP4, 8192), "fp4-decode-c4": (WeightFormat.FP4, 64)}
# The model decodes FP4 with "subnormal" when the scales allow it (these do: bytes 118-121), as moe does.
BASES = {"fp4-decode-c4": GroupedMatmulConfig(block_n=256, fp4_dequant="subnormal", consumers=4)}
_MODEL_BASE = GroupedMatmulConfig(fp4_dequant="subnormal")


def weights(fmt: WeightFormat):
    kw, ks = jax.random.split(jax.random.key(1))
    if fmt is WeightFormat.FP8:
        w = (jax.random.normal(kw, (G, N, K), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
        return w, jax.random.randint(ks, (G, N // 32, K // 32), 118, 122).astype(jnp.uint8)
    return (jax.random.bits(kw, (G, N, K // 2), jnp.uint8),
            jax.random.randint(ks, (G, N, K // 32), 118, 122).astype(jnp.uint8))


def main(names: list[str]) -> None:
    for name in names:
        fmt, tokens = CASES[name]
        w, s = weights(fmt)
        m = tokens * TOP_K
        gid = jnp.argsort(jax.random.uniform(jax.random.key(tokens), (tokens, G)), axis=1)[:, :TOP_K]
        gid = gid.reshape(-1).astype(jnp.int32)
        x = jax.random.normal(jax.random.key(tokens + 1), (m, K), jnp.bfloat16)
        cfg = tuned_config(m, G, N, K, fmt, jnp.float32, base=BASES.get(name, _MODEL_BASE))
        print(name, cfg, flush=True)
        for _ in range(2):
            jax.block_until_ready(grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=cfg))
        del w, s


def summarize(csv_path: str, weight_elements: float | None = None) -> None:
    import collections
    import csv

    import gzip

    opener = gzip.open if csv_path.endswith(".gz") else open
    with opener(csv_path, "rt") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    col = {h: i for i, h in enumerate(hdr)}

    def num(r, key):
        try:
            return float(r[col[key]].replace(",", ""))
        except (KeyError, ValueError, IndexError):
            return 0.0

    data = rows[2:]
    def op_of(r):
        words = r[col["Source"]].split()
        return (words[1] if words and words[0].startswith("@") else words[0] if words else "").split(".")[0]

    inst, samp = collections.Counter(), collections.Counter()
    for r in data:
        op = op_of(r)
        inst[op] += num(r, "Instructions Executed")
        samp[op] += num(r, "Warp Stall Sampling (All Samples)")
    n_inst, n_samp = sum(inst.values()), sum(samp.values())
    print(f"warp instructions {n_inst:.0f}, stall samples {n_samp:.0f}")
    for op, c in inst.most_common(15):
        print(f"  {op:10s} {c / n_inst:6.1%} of instructions  {samp[op] / n_samp:6.1%} of samples")
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    totals = sorted(((sum(num(r, h) for r in data), h) for h in stalls), reverse=True)
    print("stall reasons: " + ", ".join(f"{h[6:]} {v / n_samp:.1%}" for v, h in totals[:8]))
    wf, ideal = (sum(num(r, k) for r in data) for k in ("L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"))
    print(f"shared wavefronts {wf:.0f} vs ideal {ideal:.0f} ({1 - ideal / wf if wf else 0:.0%} excess)")
    hot = max(data, key=lambda r: num(r, "Warp Stall Sampling (All Samples)"))
    print(f"hottest instruction: {hot[col['Source']].strip()} "
          f"{num(hot, 'Warp Stall Sampling (All Samples)') / n_samp:.1%} of samples")
    if weight_elements:
        print(f"thread-instructions per weight element: {n_inst * 32 / weight_elements:.2f}")
    # Where in the code the samples fall: the share of each 100-instruction window (SASS order), with the
    # launch count of its most executed instructions (per-block code, per-CTA code) and its main opcodes.
    print("stall samples by 100-instruction window (share, executions, opcodes):")
    for w0 in range(0, len(data), 100):
        seg = data[w0:w0 + 100]
        share = sum(num(r, "Warp Stall Sampling (All Samples)") for r in seg) / n_samp
        execs = collections.Counter(int(num(r, "Instructions Executed")) for r in seg).most_common(1)[0][0]
        ops = collections.Counter(op_of(r) for r in seg).most_common(4)
        print(f"  {w0:5d} {share:6.1%} {execs:7d}x  " + " ".join(f"{o}:{c}" for o, c in ops))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        summarize(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else None)
    else:
        main(sys.argv[1:] or ["fp4-decode"])
