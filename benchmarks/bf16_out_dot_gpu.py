"""May ``linear.dense`` ask XLA:GPU for a bf16-output dot instead of a float32 dot + convert? (GPU, ~1 min.)

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bf16_out_dot_gpu.py
    PYTHONPATH=. python3 benchmarks/bf16_out_dot_gpu.py --tokens 8 --tiny    # CPU smoke run

``linear.dense`` computes ``einsum(..., preferred_element_type=float32)`` and rounds the result to bf16.
At prefill XLA keeps the two apart: cuBLAS writes the float32 product and a separate convert kernel reads
it back (the chunk-8192 trace: wq_b's [8192, 32768] float32 written, then ``wrapped_convert_1`` 12.4 ms;
~25-30 ms a 12-layer chunk in all; NOTES item -24(3)(e)). A bf16-output dot rounds once inside the GEMM's
epilogue. It is only the same model if the GEMM still accumulates in float32 and rounds once: then every
value is bitwise the float32 dot's, rounded. This script checks exactly that on the GPU at V4.1-Flash's
dense shapes (decode and prefill rows), and times both forms; it exits 1 if any value differs.
Results: $OUT/bf16_out_dot_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from timing import device_ms as time_ms  # noqa: E402
from deepinfer_jax.model.numerics import fake_quant_fp8  # noqa: E402

# (name, groups G, N, K, decode_only): V4.1-Flash's dense linears (text_config of the official config);
# wo_a is attention's grouped einsum over o_groups; the head runs on one row a sequence, so decode rows only.
SHAPES = (("wq_a", 1, 1280, 5120, False), ("wq_b", 1, 32768, 1280, False), ("wkv", 1, 512, 5120, False),
          ("index_wq_b", 1, 4096, 1280, False), ("wo_a", 8, 1024, 4096, False), ("wo_b", 1, 5120, 8192, False),
          ("shared_w1", 1, 2304, 5120, False), ("shared_w2", 1, 5120, 2304, False),
          ("head", 1, 129280, 5120, True))
TINY_SHAPES = (("tiny", 1, 96, 256, False), ("tiny_grouped", 2, 64, 128, False))


def dot(x_mgk, w_gnk, out_dtype):
    """The model's einsum (a 2-D dot for one group, attention's grouped wo_a einsum otherwise)."""
    if x_mgk.shape[1] == 1:
        return jnp.einsum("mk,nk->mn", x_mgk[:, 0], w_gnk[0], preferred_element_type=out_dtype)
    return jnp.einsum("mgk,gnk->mgn", x_mgk, w_gnk, preferred_element_type=out_dtype)


def f32_then_convert(x, w):
    return dot(x, w, jnp.float32).astype(jnp.bfloat16)


def bf16_out(x, w):
    return dot(x, w, jnp.bfloat16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    print(f"{jax.devices()[0]}; jax {jax.__version__}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    f32_fn, bf16_fn = jax.jit(f32_then_convert), jax.jit(bf16_out)
    tokens_all = [int(t) for t in args.tokens.split(",")]
    for name, g, n, k, decode_only in TINY_SHAPES if args.tiny else SHAPES:
        w = (jax.random.normal(jax.random.key(n + k), (g, n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        for m in tokens_all:
            if decode_only and m > min(tokens_all):
                continue
            # act-quantized rows, as the FP8 linears see them (the plain bf16 ones see any bf16 rows)
            x = fake_quant_fp8(jax.random.normal(jax.random.key(m), (m, g, k), jnp.float32), 32).astype(jnp.bfloat16)
            a, b = f32_fn(x, w), bf16_fn(x, w)
            differ = int(jnp.sum(a.view(jnp.uint16) != b.view(jnp.uint16)))
            rel = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                        / jnp.max(jnp.abs(a.astype(jnp.float32))))
            ms_f32, how = time_ms(f32_fn, x, w, reps=args.reps)
            ms_bf16, _ = time_ms(bf16_fn, x, w, reps=args.reps)
            row = {"shape": name, "groups": g, "n": n, "k": k, "tokens": m, "values": int(a.size),
                   "values_differ": differ, "max_rel_diff": rel, "ms_f32_convert": ms_f32, "ms_bf16_out": ms_bf16,
                   "timer": how, "speedup": ms_f32 / ms_bf16}
            rows.append(row)
            print(f"{name:10s} G={g} N={n:6d} K={k:5d} M={m:5d}: {differ}/{a.size} values differ "
                  f"(max rel {rel:.2e}); f32+convert {ms_f32:.4f} ms, bf16-out {ms_bf16:.4f} ms "
                  f"({ms_f32 / ms_bf16:.2f}x, {how})", flush=True)
    (out / "bf16_out_dot_gpu.json").write_text(json.dumps(
        {"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": rows}, indent=1))
    total = sum(r["values_differ"] for r in rows)
    print(f"all shapes: {total} values differ; bitwise the same: {total == 0}")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
