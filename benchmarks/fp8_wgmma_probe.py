"""Probe for NOTES item -21: an FP8 wgmma with the weights as its register operand, at the decode shape.

    PYTHONPATH=. python3 benchmarks/fp8_wgmma_probe.py              # GPU: the product against numpy
    ../aotenv/bin/python benchmarks/fp8_wgmma_probe.py --deviceless  # CPU: lower + compile for the H200

Item -21 would feed the FP4 expert weights to wgmma as E4M3 bytes made by bit moves (nibble ``s e1 e0 m``
-> byte ``s 0 0 e1 e0 m 0 0``, the E2M1 value times 2^-6) instead of decoding them to bf16. This builds
the smallest kernel of that shape: A = 64 weight rows x K in registers (``Layout.WGMMA_8BIT``), B = 8
token rows x K in shared memory with K contiguous (as the grouped GEMM holds x), one wgmma, f32
accumulator. On the GPU it checks the result against float64 numpy: the products are exact, so what
differs is the tensor core's FP8 accumulation, which this measures. Deviceless (session 21, jax 0.12 in
../aotenv) it lowered and compiled at K = 32, 64 and 128. Results: $OUT/fp8_wgmma_probe.json.
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
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

WEIGHT_ROWS, TOKENS = 64, 8


def e2m1_codes_as_e4m3(codes: np.ndarray) -> np.ndarray:
    """4-bit E2M1 codes (sign in bit 3) -> E4M3 bytes holding the same value times 2^-6."""
    s, e, m = (codes >> 3) & 1, (codes >> 1) & 3, codes & 1
    return ((s << 7) | (e << 3) | (m << 2)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)


def build(k: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.mosaic import tiled

    f8 = jnp.float8_e4m3fn

    def body(w_ref, x_ref, o_ref, x_smem, w_smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, x_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(w_ref, w_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        a = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA_8BIT, optimized=False)

        def scope(acc_ref):
            plgpu.wgmma(acc_ref, a, x_smem.T)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        o_ref[...] = pl.run_scoped(scope, plgpu.ACC((WEIGHT_ROWS, TOKENS), jnp.float32))

    def entry(w_ref, x_ref, o_ref):
        pl.run_scoped(lambda xs, ws, bar: body(w_ref, x_ref, o_ref, xs, ws, bar),
                      plgpu.SMEM((TOKENS, k), f8, transforms=tiled(k, 1)),
                      plgpu.SMEM((WEIGHT_ROWS, k), f8, transforms=tiled(k, 1)),
                      plgpu.Barrier(num_arrivals=2, num_barriers=1))

    return jax.jit(plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((WEIGHT_ROWS, TOKENS), jnp.float32)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deviceless", action="store_true", help="lower and compile for the H200 on a CPU machine")
    ap.add_argument("--k", default="32,64,128", help="contraction lengths (bytes of an FP8 row: 32, 64 or 128)")
    args = ap.parse_args(argv)
    out = {}
    rng = np.random.default_rng(0)
    for k in (int(v) for v in args.k.split(",")):
        kern = build(k)
        if args.deviceless:
            import compile_probe

            sh = compile_probe.compile_only_sharding(compile_probe.TARGET_CONFIG)
            spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn, sharding=sh)   # noqa: E731
            kern.lower(spec((WEIGHT_ROWS, k)), spec((TOKENS, k))).compile()
            out[f"k{k}"] = "compiled"
        else:
            codes = rng.integers(0, 16, (WEIGHT_ROWS, k)).astype(np.uint8)
            x = rng.standard_normal((TOKENS, k)).astype(ml_dtypes.float8_e4m3fn)
            got = np.asarray(kern(jnp.asarray(e2m1_codes_as_e4m3(codes)), jnp.asarray(x)), np.float64)
            e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
            want = e2m1 @ x.astype(np.float64).T * 2.0 ** -6
            out[f"k{k}"] = {"max_abs_error": float(np.abs(got - want).max()),
                            "max_abs_value": float(np.abs(want).max()),
                            "exact_fraction": float(np.mean(got == want))}
        print(f"K={k}: {out[f'k{k}']}", flush=True)
    dest = Path(os.environ.get("OUT", "."))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "fp8_wgmma_probe.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
