"""Does the compiled program round to FP8 / FP4 where the model asks it to? (GPU check, seconds.)

    PYTHONPATH=. python3 benchmarks/quant_rounding_gpu.py

XLA:GPU, under its default ``--xla_allow_excess_precision``, deletes a float32 -> fp8 -> float32 cast
pair as a no-op (seen in the deviceless H200 compile, 2026-12-05), so a fake-quantizer written as that
pair rounds nothing there. The model's quantizers use ``numerics.round_to_e4m3`` / ``round_to_e2m1``
instead. For each form this jits "scale, round, scale back" (a cast pair alone is not a fusion XLA
simplifies the same way) on this machine's default backend and counts the values whose bits differ
from ml_dtypes' rounding (an independent CPU implementation); then the model's fake-quantizers against
the numpy reference of tests/reference. Expected on a GPU: the cast pairs miss most values, every
other row 0 except ``*_div_by_scalar``. On the CPU every row but that one is 0.

The scale is a power of two, as the model's act-quant scales are, so scaling and scaling back are exact
however the backend divides. The first H100 run (2026-12-05) used 448 / max|x|: its e4m3 round-to-grid
row then missed 232,209 of 327,680 values while the model's three quantizers missed none. XLA:CPU
divides by a broadcast scalar as a multiply by its reciprocal (``a / t`` for that t differed from numpy
in 158,885 values, exactly those of the reciprocal multiply), and that row did not isolate the rounding.
``*_div_by_scalar`` records such a division on this backend (informational: the model's quantizers
divide by powers of two, or by per-block scales). The H200 (2026-12-06, results/quant_rounding_gpu_h200_
2026-12-06_s21.json): every row as expected; e4m3's division row 232,224, so XLA:GPU does not divide by a
broadcast scalar with correct rounding either, and the first H100 run's 232,209 came from the division.
Results: $OUT/quant_rounding_gpu.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from deepinfer_jax.model import numerics  # noqa: E402
from reference import numpy_v41 as ref  # noqa: E402


def _mismatches(got, want) -> int:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return int((got.view(np.uint32) != want.view(np.uint32)).sum())


def main() -> dict:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 5120)) * np.exp2(rng.uniform(-8, 8, (64, 1)))).astype(np.float32)
    out = {"device": str(jax.devices()[0].device_kind), "values": x.size}
    for name, limit, narrow, ours in [("e4m3", 448.0, jnp.float8_e4m3fn, numerics.round_to_e4m3),
                                      ("e2m1", 6.0, jnp.float4_e2m1fn, numerics.round_to_e2m1)]:
        scale = np.float32(2.0 ** np.floor(np.log2(limit / np.abs(x).max())))
        y = np.clip(x * scale, -limit, limit).astype(np.float32)
        q = y.astype(getattr(ml_dtypes, narrow.dtype.name)).astype(np.float32)
        want = q / scale
        pair = jax.jit(lambda v, s, t=narrow: jnp.clip(v * s, -limit, limit).astype(t).astype(jnp.float32) / s)
        grid = jax.jit(lambda v, s, f=ours: f(jnp.clip(v * s, -limit, limit)) / s)
        out[f"{name}_cast_pair_mismatches"] = _mismatches(pair(x, scale), want)
        out[f"{name}_round_to_grid_mismatches"] = _mismatches(grid(x, scale), want)
        out[f"{name}_round_to_grid_unscaled_mismatches"] = _mismatches(jax.jit(ours)(y), q)
        odd = np.float32(limit / np.abs(x).max())
        out[f"{name}_div_by_scalar_mismatches"] = _mismatches(jax.jit(lambda a, s: a / s)(q, odd), q / odd)
    for name, ours, theirs in [("fake_quant_fp8", numerics.fake_quant_fp8, ref.fake_quant_fp8),
                               ("fake_quant_fp4_pow2", numerics.fake_quant_fp4_pow2, ref.fake_quant_fp4_pow2),
                               ("fake_quant_fp4_e4m3", numerics.fake_quant_fp4_e4m3, ref.fake_quant_fp4_e4m3)]:
        out[f"{name}_vs_numpy_mismatches"] = _mismatches(jax.jit(ours)(x), theirs(x).astype(np.float32))
    for k, v in out.items():
        print(f"{k:40s} {v}")
    dest = Path(os.environ.get("OUT", "."))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "quant_rounding_gpu.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
