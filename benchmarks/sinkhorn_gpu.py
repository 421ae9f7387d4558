"""The Sinkhorn-rounds kernel on the GPU: correctness, batch invariance and cost against the XLA forms.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/sinkhorn_gpu.py          # ~1-2 min on the H200
    python benchmarks/sinkhorn_gpu.py --rows 64 --calls 2                        # CPU: the interpreter

mHC runs 19 Sinkhorn rounds on a 4 x 4 matrix per token, twice a layer: 24 calls in a step of the
12-layer slice. Each timing is a jitted program of ``--calls`` calls in a row (a barrier between them,
as layers have), at each row count (decode B, prefill chunk), for the kernel and for XLA's unrolled
forms: cut into segments (the engine's XLA default), one chain, and the while loop. Printed per call:
the wall-clock us (launch gaps included: what a step pays), the GPU kernels per call and their CUPTI
time, and the compile time of the program. The rounds are ~10 KFLOP a matrix, so every form is
latency-bound; the roofline is the launch count.

Checks (exit 1 on a failure): the kernel within 2e-6 of the float64 oracle (the XLA forms' ~1.7 ulp
plus ``div.full.f32``'s 2 ulp per division); one matrix's bits the same alone and in a batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from timing import cupti_kernels_ms, median_ms   # benchmarks/timing.py (the script's folder is on sys.path)
from pallas_kernels.sinkhorn import SEGMENT_ROUNDS, sinkhorn_rounds_reference, sinkhorn_rounds_xla
from pallas_kernels.sinkhorn.kernel import sinkhorn_rounds_pallas
from pallas_kernels.sinkhorn.reference import example_comb

ROUNDS, EPS = 19, 1e-6
FORMS = {
    "kernel": lambda c: sinkhorn_rounds_pallas(c, rounds=ROUNDS, eps=EPS),
    "xla_segments": lambda c: sinkhorn_rounds_xla(c, rounds=ROUNDS, eps=EPS, segment=SEGMENT_ROUNDS),
    "xla_one_chain": lambda c: sinkhorn_rounds_xla(c, rounds=ROUNDS, eps=EPS, segment=None),
    "xla_loop": lambda c: sinkhorn_rounds_xla(c, rounds=ROUNDS, eps=EPS, unroll=False),
}


def comb(seed: int, rows: int) -> jax.Array:
    return jnp.asarray(example_comb(seed, rows, 1, eps=EPS))


def chained(form, calls: int):
    """``calls`` calls in a row, each fed the last one's output (a barrier between them, so XLA does
    not fuse one call's rounds into the next)."""
    def run(c):
        for _ in range(calls):
            c = jax.lax.optimization_barrier(form(c))
        return c
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,256,2048,4096", help="matrices per call (decode B or prefill chunk)")
    ap.add_argument("--calls", type=int, default=24, help="calls per timed program (the slice's decode step: 24)")
    ap.add_argument("--forms", default="kernel,xla_segments,xla_loop",
                    help=f"of {list(FORMS)}; xla_one_chain compiles for minutes at 24 calls")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    interpreter = None
    if jax.default_backend() != "gpu":   # a smoke run of this script: the kernel in the interpreter
        from pallas_kernels.interpret import gpu_interpreter

        interpreter = gpu_interpreter()
    rows_list = [int(v) for v in args.rows.split(",")]
    res = dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=[], checks={})
    print(f"{res['device']}; jax {res['jax']}", flush=True)

    c = comb(0, max(rows_list))
    kern = jax.jit(FORMS["kernel"])
    full = np.asarray(kern(c))
    err = float(np.abs(full - sinkhorn_rounds_reference(c, rounds=ROUNDS, eps=EPS)).max())
    part = np.asarray(kern(c[3:3 + min(rows_list)]))
    res["checks"] = dict(max_abs_err_vs_float64=err,
                         batch_invariant=bool(np.array_equal(part, full[3:3 + min(rows_list)])))
    print(f"checks: {res['checks']}", flush=True)

    for rows in rows_list:
        c = comb(rows, rows)
        for name in args.forms.split(","):
            prog = chained(FORMS[name], args.calls)
            t = time.perf_counter()
            prog.lower(c).compile()
            compile_s = time.perf_counter() - t
            wall_us = median_ms(prog, c) * 1e3 / args.calls
            per_iter = cupti_kernels_ms(prog, c)
            kernels = gpu_us = None
            if per_iter:
                kernels = float(np.median([len(it) for it in per_iter])) / args.calls
                gpu_us = float(np.median([sum(ms for _, ms in it) for it in per_iter])) * 1e3 / args.calls
            row = dict(rows=rows, form=name, wall_us_per_call=wall_us, kernels_per_call=kernels,
                       gpu_us_per_call=gpu_us, compile_s=compile_s)
            res["rows"].append(row)
            extra = "" if gpu_us is None else f", {kernels:.1f} kernels, {gpu_us:7.1f} us of GPU time"
            print(f"rows {rows:5d} {name:14s}: {wall_us:7.1f} us a call{extra}; compile {compile_s:5.1f} s",
                  flush=True)
    for rows in rows_list:
        base = next(r for r in res["rows"] if r["rows"] == rows and r["form"] == "xla_segments")
        for r in res["rows"]:
            if r["rows"] == rows and r["form"] != "xla_segments":
                r["wall_vs_xla_segments"] = r["wall_us_per_call"] / base["wall_us_per_call"]
                print(f"rows {rows:5d} {r['form']:14s}: {r['wall_vs_xla_segments']:.2f}x the XLA segments' time")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sinkhorn_gpu.json").write_text(json.dumps(res, indent=1))
    if interpreter is not None:
        interpreter.close()
    return 0 if err < 2e-6 and res["checks"]["batch_invariant"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
