"""Compile the decode index-score kernel for the H200 on a CPU machine (deviceless), in each form.

    MOSAIC_GPU_DUMP_PTXAS=1 ../aotenv/bin/python benchmarks/indexer_compile.py
    MOSAIC_GPU_DUMP_PTXAS=1 ../aotenv/bin/python benchmarks/indexer_compile.py --forms 1,4x128x3 --keys 33024

Needs a jax with CUDA (the ../aotenv of benchmarks/NOTES.md). The kernel runs at V4.1's decode shape
(B = 64 queries, 32 index heads of 128, --keys index entries); ptxas prints each form's registers and
spills. Forms as in ``indexer_gpu.py --decode-forms``: tiles[x tile_keys x stages], or "fp4" (the
FP4 form over the index cache as stored, ``decode_fp4``).
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
    from pallas_kernels.indexer.config import DecodeIndexConfig
    from pallas_kernels.indexer.decode import index_scores_decode_pallas

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forms", default="1,2x256x2,4x256x2,4x128x3,fp4")
    ap.add_argument("--keys", type=int, default=4352)
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args(argv)
    sh = compile_probe.compile_only_sharding(compile_probe.TARGET_CONFIG)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)   # noqa: E731
    operands = (spec((64, args.heads, 128), jnp.bfloat16), spec((64, args.keys, 128), jnp.bfloat16),
                spec((64, args.heads), jnp.float32), spec((64,), jnp.int32))
    for form in args.forms.split(","):
        if form == "fp4":
            from pallas_kernels.indexer.decode_fp4 import index_scores_decode_fp4_pallas

            print("== fp4: the index cache as stored", flush=True)
            stored = (spec((64, args.keys, 64), jnp.uint8), spec((64, args.keys, 4), jnp.float8_e8m0fnu))
            index_scores_decode_fp4_pallas.trace(operands[0], *stored, *operands[2:]).lower().compile()
            continue
        cfg = DecodeIndexConfig.parse(form)
        print(f"== {form}: {cfg}", flush=True)
        jax.jit(lambda *a, cfg=cfg: index_scores_decode_pallas(*a, config=cfg)).trace(*operands).lower().compile()
    return 0


if __name__ == "__main__":
    sys.exit(main())
