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

This script measures that before anything is wired into the model. For V4.1-Flash's shapes at each
--tokens rows (wq_b, wo_a as 8 groups, wo_b, the shared expert's w1+w3 and w2): the current path (XLA
einsum on the bf16 weights) against the kernel at each split S and tile config: CUPTI device time (the
wall clock where CUPTI is missing), bytes read over time, the ratio to the current path, the largest
difference from it relative to its largest value, and whether row 0 is bitwise the same when the other
rows change. Results: $OUT/dense_fp8_gpu.json.
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

from timing import cupti_ms, median_ms  # noqa: E402
from deepinfer_jax.model.linear import dequant_fp8  # noqa: E402
from deepinfer_jax.model.numerics import fake_quant_fp8  # noqa: E402
from pallas_kernels.grouped_gemm.config import (GroupedMatmulConfig, WeightFormat, fit_stages,  # noqa: E402
                                                kernel_unsupported_reason, uses_e4m3_rows)
from pallas_kernels.grouped_gemm.fp8_operands import e4m3_rows  # noqa: E402
from pallas_kernels.grouped_gemm.kernel import grouped_matmul_tiles  # noqa: E402
from pallas_kernels.grouped_gemm.plan import TilePlan  # noqa: E402
from pallas_kernels.grouped_gemm.scales import kernel_scales  # noqa: E402

# (name, groups G, N, K): V4.1-Flash's dense FP8 linears that read the most bytes at decode. The shared
# expert's w1 and w3 (two [2304, 5120] linears on the same rows) are timed as one [4608, 5120] on both
# sides.
SHAPES = (("wq_b", 1, 32768, 1280), ("wo_a", 8, 1024, 4096), ("wo_b", 1, 5120, 8192),
          ("shared_w13", 1, 4608, 5120), ("shared_w2", 1, 5120, 2304))
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


def split_weights(w_gnk: jax.Array, s_gnk: jax.Array, splits: int) -> tuple[jax.Array, jax.Array]:
    """[G, N, K] FP8 + [G, N/32, K/32] scales -> [G*S, N, K/S] + kernel-layout scales [G*S, K/(32S), N]:
    group g*S + s holds K columns s*K/S .. (s+1)*K/S of linear g. A load-time copy."""
    g, n, k = w_gnk.shape
    w = w_gnk.reshape(g, n, splits, k // splits).transpose(0, 2, 1, 3).reshape(g * splits, n, k // splits)
    s = s_gnk.reshape(g, n // 32, splits, k // 32 // splits).transpose(0, 2, 1, 3)
    s = s.reshape(g * splits, n // 32, k // 32 // splits)
    return w, kernel_scales(s, WeightFormat.FP8, n)


def static_plan(groups: int, rows_per_group: int, block_m: int) -> TilePlan:
    """The tile plan of G groups of rows_per_group rows each, laid out group after group: all constants."""
    t = groups * rows_per_group // block_m
    z = np.zeros((0,), np.int32)
    return TilePlan(row_src=jnp.asarray(np.arange(t * block_m, dtype=np.int32)),
                    tile_group=jnp.asarray(np.repeat(np.arange(groups, dtype=np.int32), rows_per_group // block_m)),
                    dest_m=jnp.asarray(z), valid_m=jnp.asarray(z.astype(bool)), sorted_pos=jnp.asarray(z),
                    sorted_m=jnp.asarray(z))


def kernel_linear(x_mgk, w_split, s_split, *, splits: int, cfg: GroupedMatmulConfig):
    """x [M, G, K] bf16 -> [M, G, N] bf16 through the kernel: rows [G*S*Mp, K/S], the partials summed in
    split order."""
    m, g, k = x_mgk.shape
    mp = -(-m // cfg.block_m) * cfg.block_m
    x = x_mgk.reshape(m, g, splits, k // splits).transpose(1, 2, 0, 3)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, mp - m), (0, 0))).reshape(g * splits * mp, k // splits)
    if uses_e4m3_rows(cfg, WeightFormat.FP8):
        x = e4m3_rows(x)
    y = grouped_matmul_tiles(static_plan(g * splits, mp, cfg.block_m), x, w_split, s_split, out_dtype=jnp.float32,
                             config=cfg, scales_prepared=True)
    y = y.reshape(g, splits, mp, -1)
    acc = y[:, 0]
    for s in range(1, splits):
        acc = acc + y[:, s]
    return acc[:, :m].transpose(1, 0, 2).astype(jnp.bfloat16)


def xla_linear(x_mgk, w_bf16_gnk):
    """The current path: the bf16-held weights in the model's einsum (a plain 2-D dot for one group, as
    ``linear.dense``; attention's grouped ``wo_a`` einsum otherwise), float32 accumulation."""
    if x_mgk.shape[1] == 1:
        y = jnp.einsum("mk,nk->mn", x_mgk[:, 0], w_bf16_gnk[0], preferred_element_type=jnp.float32)[:, None]
    else:
        y = jnp.einsum("mgk,gnk->mgn", x_mgk, w_bf16_gnk, preferred_element_type=jnp.float32)
    return y.astype(jnp.bfloat16)


def time_ms(fn, *args, reps: int) -> tuple[float, str]:
    got = cupti_ms(fn, *args, iters=reps)
    if got is not None:
        return got[0], "cupti"
    return median_ms(fn, *args, reps=reps), "wall"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--splits", default="1,2,4,8,16", help="K splits to try (those that divide K into 128s)")
    ap.add_argument("--shapes", default=None, help="comma-separated names from SHAPES (default: all)")
    ap.add_argument("--operands", default="bf16,e4m3", help="the kernel's fp8_operands forms to time")
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
            for splits in splits_asked:
                if k % (splits * 64) or (k % (splits * 128) and not args.tiny):
                    continue
                w_s, s_s = jax.jit(split_weights, static_argnums=2)(w8, s8, splits)
                for (bm, bn, bk, st, pers), form in ((c, f) for c in configs for f in args.operands.split(",")):
                    cfg = fit_stages(GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, stages=st,
                                                         persistent=pers, a_from_registers=interp is None,
                                                         fp8_operands=form),
                                     WeightFormat.FP8, jnp.float32)
                    if kernel_unsupported_reason(n, k // splits, WeightFormat.FP8, cfg, jnp.float32):
                        continue
                    fn = jax.jit(lambda x_, w_, s_, _s=splits, _c=cfg: kernel_linear(x_, w_, s_, splits=_s, cfg=_c))
                    if interp is not None:
                        with interp():
                            y, y_other = fn(x, w_s, s_s), fn(x_other, w_s, s_s)
                        ms = float("nan")
                    else:
                        y, y_other = fn(x, w_s, s_s), fn(x_other, w_s, s_s)
                        ms, _ = time_ms(fn, x, w_s, s_s, reps=args.reps)
                    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32)))
                                / jnp.max(jnp.abs(ref.astype(jnp.float32))))
                    same_row0 = bool(jnp.array_equal(y[0], y_other[0]))
                    mp = -(-tokens // cfg.block_m) * cfg.block_m
                    fp8_bytes = g * n * k + g * n * k // 32 + (2 * g * splits * mp * n * 4 if splits > 1 else 0)
                    row = {"shape": name, "groups": g, "n": n, "k": k, "tokens": tokens, "splits": splits,
                           "operands": form,
                           "config": dataclasses.asdict(cfg), "ms": ms, "xla_ms": ref_ms, "timer": how,
                           "ratio_to_xla": ref_ms / ms if ms == ms else None, "bytes": fp8_bytes,
                           "tb_s": fp8_bytes / ms / 1e9 if ms == ms else None, "max_rel_diff": err,
                           "row0_invariant": same_row0}
                    rows.append(row)
                    print(f"  S={splits:2d} {bm}x{bn}x{bk}x{cfg.stages}{' pers' if pers else ''} {form}: {ms:.4f} ms, "
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
