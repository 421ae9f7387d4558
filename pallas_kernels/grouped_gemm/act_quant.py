"""The model's FP8 activation quantizer, in ops Mosaic GPU lowers: for the SwiGLU epilogue's output
(``kernel.swiglu_tiles(..., out_dtype=bfloat16, act_block=32)``), so that h leaves the kernel as the
bf16 values the next GEMM reads instead of float32 that XLA quantizes in another pass.

The quantizer (``deepinfer_jax.model.numerics.fake_quant_fp8``, the reference's ``act_quant``): per
block of ``act_block`` values of a row, s = 2^ceil(log2(max(amax, 1e-4) / 448)) and
x -> e4m3(clip(x / s, +-448)) * s. Written here so that every step is exact or correctly rounded the
same way on both sides (tests/test_grouped_gemm.py checks the bits against the model's form):

* s and 1/s come from amax's exponent bits (both powers of two), and x * (1/s) is x / s: scaling by a
  power of two rounds once, to the same value, whichever way it is written;
* the E4M3 rounding is a cast (``cvt.rn.satfinite.e4m3x2.f32`` on Hopper, nearest-even like XLA's; the
  clip keeps it in range) and back through float16, both exact;
* q * s is exact in bf16 (3 mantissa bits, a power-of-two factor inside bf16's exponent range).

No package import from ``deepinfer_jax``: the kernels stand alone; the test ties the two forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def pow2_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """amax float32 [...] >= 0 -> (s, 1/s): s = 2^ceil(log2(max(amax, 1e-4) / 448)), from the exponent
    bits (``numerics.fp8_scale``'s arithmetic: the same multiply by the float32 1/448, then the bits)."""
    bits = lax.bitcast_convert_type(jnp.maximum(amax, AMAX_FLOOR) * jnp.float32(1.0 / FP8_MAX), jnp.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + jnp.where((bits & 0x7FFFFF) != 0, 1, 0)
    # exp is in [105, 248] for float32 amax (floored at 1e-4): 254 - exp is a normal exponent too
    return (lax.bitcast_convert_type(exp << 23, jnp.float32),
            lax.bitcast_convert_type((254 - exp) << 23, jnp.float32))


def fake_quant_rows(x_rc: jax.Array) -> jax.Array:
    """x float32 [R, C] (one quantizer block a row: C = act_block values) -> the quantized values,
    float32. In a kernel x is in the WGMMA layout: a row's block is 4 lanes' registers, so its maximum
    is register maxima and two shuffles."""
    rows, cols = x_rc.shape
    s, inv_s = pow2_scale(jnp.max(jnp.abs(x_rc), axis=1))
    y = jnp.clip(x_rc * lax.broadcast_in_dim(inv_s, (rows, cols), [0]), -FP8_MAX, FP8_MAX)
    q = y.astype(jnp.float8_e4m3fn).astype(jnp.float16).astype(jnp.float32)
    return q * lax.broadcast_in_dim(s, (rows, cols), [0])


def fake_quant_blocks(x_rc: jax.Array, act_block: int) -> jax.Array:
    """x float32 [R, C] -> bf16 [R, C]: ``fake_quant_rows`` on each block of act_block columns (C a
    multiple of it; act_block a multiple of 8, the WGMMA layout's column granule)."""
    cols = x_rc.shape[1]
    if cols % act_block or act_block % 8:
        raise ValueError(f"{cols} columns do not split into quantizer blocks of {act_block} (a multiple of 8)")
    parts = [fake_quant_rows(x_rc[:, j:j + act_block]).astype(jnp.bfloat16) for j in range(0, cols, act_block)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
