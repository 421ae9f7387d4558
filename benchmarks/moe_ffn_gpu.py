"""The routed-expert FFN (w1, w3, swiglu, w2) on the grouped-GEMM kernel: a tile plan per GEMM against
one plan shared by the three (``moe._routed_experts_tiled``), at V4.1-Flash's expert shape.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/moe_ffn_gpu.py      # ~1-2 min on the H200

Prints, per token count (decode 64 and 512, prefill chunks 1024 and 2048; top-6 of 384 FP4 experts,
hidden 5120, width 2304): the jitted FFN's time both ways, their ratio, and whether the outputs are
bitwise equal (they must be: the shared plan changes the work around the kernel, not a row's bits).
Random weights in the checkpoint's FP4 format with E8M0 scale bytes <= 127 (so the "subnormal" decoder
runs, as on the slice); uniform random routing.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from timing import median_ms   # benchmarks/timing.py (the script's folder is on sys.path)
from deepinfer_jax.model.moe import prepare_experts_for_kernel, routed_experts_grouped
from deepinfer_jax.model.numerics import Numerics
from pallas_kernels.registry import PALLAS_MOSAIC_GPU

HIDDEN, WIDTH, EXPERTS, TOP_K = 5120, 2304, 384, 6


def fp4_linear(key, n: int, k: int, experts: int) -> dict:
    kw, ks = jax.random.split(key)
    w = jax.random.randint(kw, (experts, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.randint(ks, (experts, n, k // 32), 118, 128, jnp.int32).astype(jnp.uint8)
    return {"weight": w, "scale": s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,512,1024,2048")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 8 experts of 128 x 128 in the interpreter")
    args = ap.parse_args(argv)
    hidden, width, experts, impl = HIDDEN, WIDTH, EXPERTS, PALLAS_MOSAIC_GPU
    if args.tiny:
        hidden, width, experts, impl, args.tokens, args.reps = 128, 128, 8, "interpret", "5", 1
    keys = jax.random.split(jax.random.key(0), 3)
    params, numerics = prepare_experts_for_kernel({"experts": {   # as the engine does at load
        "w1": fp4_linear(keys[0], width, hidden, experts), "w3": fp4_linear(keys[1], width, hidden, experts),
        "w2": fp4_linear(keys[2], hidden, width, experts)}}, Numerics.reference())
    p_exp = params["experts"]
    print(f"{jax.devices()[0]}; jax {jax.__version__}; FP4 scale max {numerics.fp4_scale_max}", flush=True)
    rows = []
    for tokens in (int(v) for v in args.tokens.split(",")):
        kx, kr, kw = jax.random.split(jax.random.key(tokens), 3)
        x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
        ids = jnp.argsort(jax.random.uniform(kr, (tokens, experts)), axis=1)[:, :TOP_K].astype(jnp.int32)
        w = jax.nn.softmax(jax.random.normal(kw, (tokens, TOP_K)), axis=-1)
        outs, ms = {}, {}
        for tiled in (False, True):
            # The weights are an argument: closed over, 7 GB of constants make the compile take minutes.
            fn = jax.jit(lambda p, x, ids, w, tiled=tiled: routed_experts_grouped(
                p, x, ids, w, 10.0, numerics, 32, impl, tiled=tiled))
            outs[tiled] = fn(p_exp, x, ids, w)
            ms[tiled] = median_ms(fn, p_exp, x, ids, w, reps=args.reps)
        same = bool(jnp.array_equal(jax.lax.bitcast_convert_type(outs[False], jnp.uint32),
                                    jax.lax.bitcast_convert_type(outs[True], jnp.uint32)))
        rows.append(dict(tokens=tokens, per_gemm_ms=ms[False], shared_plan_ms=ms[True],
                         speedup=ms[False] / ms[True], bitwise_equal=same))
        print(f"{tokens:5d} x {TOP_K}: plan per GEMM {ms[False]:7.3f} ms, shared plan {ms[True]:7.3f} ms "
              f"= {ms[False] / ms[True]:.2f}x; bitwise equal: {same}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_ffn_gpu.json").write_text(json.dumps(dict(jax=jax.__version__, device=str(jax.devices()[0]),
                                                         rows=rows), indent=1))
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
