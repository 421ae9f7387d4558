"""Should the decode step's dense FP8 linears read FP8 through the grouped-GEMM kernel? (GPU, ~1-2 min.)

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/dense_fp8_gpu.py
    PYTHONPATH=. python3 benchmarks/dense_fp8_gpu.py --tiny      # CPU smoke run in the Mosaic GPU interpreter

The engine holds every dense FP8 linear as its bf16 dequantized weight (``linear.dequantize_dense_fp8``),
so XLA's GEMMs read 2 bytes a weight where the checkpoint stores 1 (plus 1/1024 of scales). At decode
those GEMMs are bound by their weight reads: on the H100 4-layer slice, attention's projections and the
shared expert took ~0.7 ms of a 9.8 ms step (session 19's timeline), ~2 TB/s on bf16 bytes. The
grouped-GEMM kernel already reads FP8 32x32-block weights (82 % of copy bandwidth for the experts). A
dense linear is one group; K is split into S groups so that enough CTAs run at 64 rows (a fixed split,
chosen by K only, so a row's bits still depend on nothing but the row), the S float32 partials then
summed in a fixed order.

Each kernel config runs in both operand forms (``--operands``): "bf16" dequantizes the weights to bf16 in
registers (item -20's form, 1.15-1.37x XLA on an H100), "e4m3" gives the stored E4M3 bytes to FP8
wgmmas with x as E4M3 rows (``GroupedMatmulConfig.fp8_operands``; no per-weight ALU work; NOTES item
-24(b)). x is FP8-quantized per 1 x 32 first, as the model's activation quantizer does in front of
these linears, so the E4M3 rows are exact and both paths sum the same products.

The kernel form is the model's (``pallas_kernels.grouped_gemm.dense``, behind ``Numerics.dense_kernel``).
For V4.1-Flash's shapes at each --tokens rows (wq_b, wo_a as 8 groups, wo_b, the shared expert's w1+w3
and w2, wq_a, wkv): XLA's einsum on the bf16 weights (the engine's default) against the kernel at each
split S and tile config, the model's own choice (``dense.split_for``, ``dense.dense_config``) marked
"engine": CUPTI device time (the wall clock where CUPTI is missing), bytes read over time, the ratio to
XLA, the largest difference from it relative to its largest value, and whether row 0 is bitwise the
same when the other rows change (for the engine's choice: also when M is 8, a 16-row tile). Results:
$OUT/dense_fp8_gpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from timing import device_ms as time_ms  # noqa: E402
from deepinfer_jax.model.linear import dequant_fp8  # noqa: E402
from deepinfer_jax.model.numerics import fake_quant_fp8  # noqa: E402
from pallas_kernels.grouped_gemm import dense  # noqa: E402
from pallas_kernels.grouped_gemm.config import (GroupedMatmulConfig, WeightFormat, fit_stages,  # noqa: E402
                                                kernel_unsupported_reason)

# (name, groups G, N, K): V4.1-Flash's dense FP8 linears that read the most bytes at decode. The shared
# expert's w1 and w3 (two [2304, 5120] linears on the same rows) are timed as one [4608, 5120] on both
# sides.
SHAPES = (("wq_b", 1, 32768, 1280), ("wo_a", 8, 1024, 4096), ("wo_b", 1, 5120, 8192),
          ("shared_w13", 1, 4608, 5120), ("shared_w2", 1, 5120, 2304), ("wq_a", 1, 1280, 5120),
          ("wkv", 1, 512, 5120))
TINY_SHAPES = (("tiny_a", 1, 256, 512), ("tiny_grouped", 2, 128, 256))
# (block_m, block_n, block_k, stages, persistent)
CONFIGS = ((64, 128, 128, 4, False), (64, 128, 128, 4, True), (64, 256, 128, 4, True), (16, 256, 128, 5, True))
TINY_CONFIGS = ((16, 128, 64, 2, False),)


def fp8_weight(key, g: int, n: int, k: int) -> tuple[jax.Array, jax.Array]:
    """Random E4M3 weights [G, N, K] and E8M0 scales [G, N/32, K/32] from 2^-10 to 2^-6, as the checkpoint
    stores them."""
    kw, ks = jax.random.split(key)
    w = jnp.clip(jax.random.normal(kw, (g, n, k), jnp.float32) * 64.0, -448, 448).astype(jnp.float8_e4m3fn)
    s = jax.random.randint(ks, (g, n // 32, k // 32), 117, 122, jnp.int32).astype(jnp.uint8)
    return w, jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)


def kernel_linear(x_mgk, p: dense.DenseFp8Weights, *, cfg: GroupedMatmulConfig):
    """x [M, G, K] bf16 -> [M, G, N] bf16 through the kernel (``dense.dense_fp8_matmul``, the model's
    form): rows [G*S*Mp, K/S], the partials summed in split order."""
    return dense.dense_fp8_matmul(x_mgk, p, config=cfg).astype(jnp.bfloat16)


def xla_linear(x_mgk, w_bf16_gnk):
    """The current path: the bf16-held weights in the model's einsum (a plain 2-D dot for one group, as
    ``linear.dense``; attention's grouped ``wo_a`` einsum otherwise), float32 accumulation."""
    if x_mgk.shape[1] == 1:
        y = jnp.einsum("mk,nk->mn", x_mgk[:, 0], w_bf16_gnk[0], preferred_element_type=jnp.float32)[:, None]
    else:
        y = jnp.einsum("mgk,gnk->mgn", x_mgk, w_bf16_gnk, preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--splits", default="1,2,4,8,16", help="K splits to try (those that divide K into 128s)")
    ap.add_argument("--shapes", default=None, help="comma-separated names from SHAPES (default: all)")
    ap.add_argument("--operands", default="bf16,e4m3", help="the kernel's fp8_operands forms to time")
    ap.add_argument("--engine-only", action="store_true",
                    help="time only the model's own split and tile per shape (and XLA): a short call")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes in the Mosaic GPU interpreter (CPU)")
    args = ap.parse_args(argv)
    shapes, configs, interp = SHAPES, CONFIGS, None
    if args.tiny:
        from pallas_kernels.interpret import gpu_interpreter

        shapes, configs, args.tokens, args.reps, interp = TINY_SHAPES, TINY_CONFIGS, "8", 1, gpu_interpreter
    if args.shapes and not args.tiny:
        shapes = tuple(s for s in shapes if s[0] in args.shapes.split(","))
    print(f"{jax.devices()[0]}; jax {jax.__version__}", flush=True)
    splits_asked = tuple(int(s) for s in args.splits.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows_):
        (out / "dense_fp8_gpu.json").write_text(json.dumps(
            {"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": rows_}, indent=1))

    rows = []
    save(rows)
    for name, g, n, k in shapes:
        w8, s8 = fp8_weight(jax.random.key(n + k), g, n, k)
        w_bf16 = jax.jit(lambda w, s: dequant_fp8(w, s).astype(jnp.bfloat16))(w8, s8)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = fake_quant_fp8(jax.random.normal(jax.random.key(tokens), (tokens, g, k), jnp.float32),
                               32).astype(jnp.bfloat16)
            x_other = x.at[1:].set(-x[1:])      # same row 0, every other row changed
            ref_fn = jax.jit(xla_linear)
            ref = ref_fn(x, w_bf16)
            ref_ms, how = time_ms(ref_fn, x, w_bf16, reps=args.reps) if interp is None else (float("nan"), "-")
            bf16_bytes = 2 * g * n * k
            print(f"{name} G={g} N={n} K={k} M={tokens}: XLA on bf16 weights {ref_ms:.4f} ms ({how}), "
                  f"{bf16_bytes / ref_ms / 1e9:.2f} TB/s", flush=True)
            # the model's choice (dense.split_for, dense.dense_config) is timed whatever --splits says
            eng = dense.dense_config(tokens, "e4m3")
            eng_tile = (eng.block_m, eng.block_n, eng.block_k, eng.stages, eng.persistent)
            eng_splits = dense.split_for(n, k, groups=g)
            split_set = {eng_splits} if args.engine_only else set(splits_asked)
            for splits in sorted(split_set | ({eng_splits} if interp is None else set())):
                if k % (splits * 64) or (k % (splits * 128) and not args.tiny):
                    continue
                p_split = jax.jit(dense.split_weights, static_argnums=2)(w8, s8, splits)
                tiles = configs + ((eng_tile,) if splits == eng_splits and eng_tile not in configs and interp is None
                                   else ())
                tiles = (eng_tile,) if args.engine_only else tiles
                for (bm, bn, bk, st, pers), form in ((c, f) for c in tiles for f in args.operands.split(",")):
                    cfg = fit_stages(GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, stages=st,
                                                         persistent=pers, a_from_registers=interp is None,
                                                         fp8_operands=form),
                                     WeightFormat.FP8, jnp.float32)
                    if kernel_unsupported_reason(n, k // splits, WeightFormat.FP8, cfg, jnp.float32):
                        continue
                    fn = jax.jit(lambda x_, p_, _c=cfg: kernel_linear(x_, p_, cfg=_c))
                    if interp is not None:
                        with interp():
                            y, y_other = fn(x, p_split), fn(x_other, p_split)
                        ms = float("nan")
                    else:
                        y, y_other = fn(x, p_split), fn(x_other, p_split)
                        ms, _ = time_ms(fn, x, p_split, reps=args.reps)
                    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32)))
                                / jnp.max(jnp.abs(ref.astype(jnp.float32))))
                    same_row0 = bool(jnp.array_equal(y[0], y_other[0]))
                    engine = splits == eng_splits and (bm, bn, bk, st, pers) == eng_tile
                    if engine and interp is None:   # and at 8 rows, whose 16-row tiles the model then takes
                        few = dataclasses.replace(dense.dense_config(8, form), a_from_registers=True)
                        y8 = jax.jit(lambda x_, p_, _c=few: kernel_linear(x_, p_, cfg=_c))(x[:8], p_split)
                        same_row0 = same_row0 and bool(jnp.array_equal(y[0], y8[0]))
                    mp = -(-tokens // cfg.block_m) * cfg.block_m
                    fp8_bytes = g * n * k + g * n * k // 32 + (2 * g * splits * mp * n * 4 if splits > 1 else 0)
                    row = {"shape": name, "groups": g, "n": n, "k": k, "tokens": tokens, "splits": splits,
                           "operands": form,
                           "config": dataclasses.asdict(cfg), "ms": ms, "xla_ms": ref_ms, "timer": how,
                           "ratio_to_xla": ref_ms / ms if ms == ms else None, "bytes": fp8_bytes,
                           "tb_s": fp8_bytes / ms / 1e9 if ms == ms else None, "max_rel_diff": err,
                           "row0_invariant": same_row0,
                           "engine": engine}
                    rows.append(row)
                    print(f"  S={splits:2d} {bm}x{bn}x{bk}x{cfg.stages}{' pers' if pers else ''} {form}"
                          f"{' (engine)' if row['engine'] else ''}: {ms:.4f} ms, "
                          f"x{ref_ms / ms:.2f} vs XLA, {fp8_bytes / ms / 1e9:.2f} TB/s; rel diff {err:.2e}, "
                          f"row 0 invariant {same_row0}", flush=True)
                    save(rows)   # after every row: a device call that runs out of time keeps what it has
    # Both paths sum the same exact products in float32 (other orders) and round the output to bf16, so
    # they may differ by one bf16 step of the output (2^-8 of a value <= the largest): 2^-7 of the largest
    # output leaves room for that and catches any wrong block, split or scale.
    bad = [r for r in rows if not r["row0_invariant"] or r["max_rel_diff"] > 2.0**-7]
    for r in bad:
        print(f"FAILED: {r['shape']} M={r['tokens']} S={r['splits']}: rel diff {r['max_rel_diff']:.2e}, "
              f"row 0 invariant {r['row0_invariant']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
