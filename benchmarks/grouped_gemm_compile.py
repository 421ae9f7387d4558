"""Compile one grouped-GEMM kernel config for the H200 on a CPU machine (deviceless), at the V4.1 expert shape.

    MOSAIC_GPU_DUMP_PTXAS=1 ../aotenv/bin/python benchmarks/grouped_gemm_compile.py --tokens 64 \\
        --block-m 8 --stages 8 --consumers 4 --operands e4m3          # ptxas: registers, spills
    MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTX=1 ... (same)      # the kernel's PTX in /tmp/ptx

    MOSAIC_GPU_DUMP_PTXAS=1 ../aotenv/bin/python benchmarks/grouped_gemm_compile.py --tokens 16384 \
        --block-m 128 --block-k 64 --stages 8 --consumers 2 --operands bf16 --swiglu    # the w1/w3 + SwiGLU launch
        (... --swiglu --swiglu-out bf16-quant: with h's FP8 quantizer in the epilogue)

Needs a jax with CUDA (the ../aotenv of benchmarks/NOTES.md). The FP4 weights are tile-major 256 x 128
with kernel-layout scales and the "subnormal" decoder, as the engine holds them; the launch is persistent.
Where NOTES item -22's register and spill counts come from (8-, 16-, 32- and 64-row tiles, both forms).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

G_EXPERTS, N_WIDTH, K_HIDDEN, TOP_K = 384, 2304, 5120, 6


def main(argv=None) -> float:
    import compile_probe
    from pallas_kernels.grouped_gemm import GroupedMatmulConfig
    from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens (x top-6 rows)")
    ap.add_argument("--block-m", type=int, default=8)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--consumers", type=int, default=4, choices=(2, 4))
    ap.add_argument("--operands", default="e4m3", choices=("bf16", "e4m3"), help="GroupedMatmulConfig.fp4_operands")
    ap.add_argument("--overlap", action="store_true", help="GroupedMatmulConfig.e4m3_overlap")
    ap.add_argument("--swiglu", action="store_true",
                    help="compile kernel.swiglu_tiles (w1 and w3 with the SwiGLU epilogue) instead")
    ap.add_argument("--swiglu-out", default="float32", choices=("float32", "bf16", "bf16-quant"),
                    help="with --swiglu: h as float32 rows, bf16 rows, or bf16 rows through the FP8 quantizer "
                         "(act_block 32) as the model's h takes them")
    args = ap.parse_args(argv)

    sh = compile_probe.compile_only_sharding(compile_probe.TARGET_CONFIG)
    m = args.tokens * TOP_K
    cfg = GroupedMatmulConfig(block_m=args.block_m, block_n=256, block_k=args.block_k, stages=args.stages,
                              consumers=args.consumers, persistent=True, fp4_dequant="subnormal",
                              weights_tile_major=True, fp4_operands=args.operands, e4m3_overlap=args.overlap)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)   # noqa: E731
    args_in = (spec((m, K_HIDDEN), jnp.bfloat16), spec((G_EXPERTS, N_WIDTH // 256, K_HIDDEN // 128, 256, 64), jnp.uint8),
               spec((m,), jnp.int32), spec((G_EXPERTS, K_HIDDEN // 32, N_WIDTH), jnp.uint8))
    t = time.time()
    if args.swiglu:
        from pallas_kernels.grouped_gemm.kernel import swiglu_tiles, tile_rows

        def run(x, w, g, s):
            plan, x_pk = tile_rows(x, g, num_groups=G_EXPERTS, block_m=cfg.block_m, fp4=True)
            row_w = jnp.ones(x_pk.shape[0], jnp.float32)
            return swiglu_tiles(plan, x_pk, w, s, w, s, row_w, limit=10.0, config=cfg, scales_prepared=True,
                                out_dtype=jnp.float32 if args.swiglu_out == "float32" else jnp.bfloat16,
                                act_block=32 if args.swiglu_out == "bf16-quant" else None)
        jax.jit(run).trace(*args_in).lower().compile()
    else:
        jax.jit(lambda x, w, g, s: grouped_matmul_pallas(x, w, g, s, out_dtype=jnp.float32, config=cfg,
                                                        scales_prepared=True)).trace(*args_in).lower().compile()
    seconds = time.time() - t
    print(f"{cfg}: compiled in {seconds:.1f} s", flush=True)
    return seconds


if __name__ == "__main__":
    main()
