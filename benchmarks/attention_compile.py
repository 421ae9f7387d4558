"""Compile the attention kernel (bf16 form) or the swizzle probe for the H200 on a CPU machine (deviceless).

    MOSAIC_GPU_DUMP_PTXAS=1 ../aotenv/bin/python benchmarks/attention_compile.py --split-rows 640
    MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTX=1 ../aotenv/bin/python benchmarks/attention_compile.py
    MOSAIC_GPU_DUMP_PTXAS=1 ../aotenv/bin/python benchmarks/attention_compile.py --swizzle-probe
    MOSAIC_GPU_DUMP_PTXAS=1 ../aotenv/bin/python benchmarks/attention_compile.py --schedule seesaw --pv-in-place

Needs a jax with CUDA (the ../aotenv of benchmarks/NOTES.md). The kernel runs at a 1,024-query prefill
over the V4.1 shape (64 heads, D = 512, 640 selected rows a query); ptxas prints registers and spills,
the PTX dump shows the wgmma schedule (NOTES item -32(f)).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def main(argv=None) -> int:
    import compile_probe

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split-rows", type=int, default=640)
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--schedule", default="halves", help="SparseAttentionConfig.schedule")
    ap.add_argument("--pv-in-place", action="store_true", help="SparseAttentionConfig(pv_cols=256, pv_in_place=True)")
    ap.add_argument("--swizzle-probe", action="store_true",
                    help="compile benchmarks/attention_swizzle_probe.py's kernel (both swizzles) instead")
    args = ap.parse_args(argv)
    sh = compile_probe.compile_only_sharding(compile_probe.TARGET_CONFIG)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)   # noqa: E731
    if args.swizzle_probe:
        import attention_swizzle_probe as probe

        for swizzle in (64, 128):
            jax.jit(probe.build(swizzle)).trace(spec((4096, probe.D), jnp.bfloat16),
                                                spec((probe.ROWS,), jnp.int32)).lower().compile()
            print(f"swizzle probe, swizzle {swizzle}: compiled", flush=True)
        return 0
    from pallas_kernels.attention import SparseAttentionConfig
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas

    cfg = SparseAttentionConfig(args.split_rows, schedule=args.schedule,
                                **(dict(pv_cols=256, pv_in_place=True) if args.pv_in_place else {}))
    q = spec((1, args.queries, 64, 512), jnp.bfloat16)
    kv, idx, sink = spec((1, 8320, 512), jnp.bfloat16), spec((1, args.queries, 640), jnp.int32), spec((64,), jnp.float32)
    jax.jit(lambda *a: sparse_sink_attention_pallas(*a, 512 ** -0.5, cfg)).trace(q, kv, idx, sink).lower().compile()
    print(f"{cfg}: compiled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
