"""FP4 experts as FP8 wgmma operands (the kernel's ``fp4_operands="e4m3"``; NOTES item -21).

Why: at decode the FP4 kernel is capped by instruction issue (~20 weight elements a cycle per SM on
the H100 and the H200), not by HBM; decoding a nibble to bf16 costs ~2.5 ALU ops an element and a bf16
wgmma takes K=16 an instruction. Here a nibble becomes an E4M3 byte by bit moves (7 ops per 8 elements)
and an FP8 wgmma takes K=32 an instruction.

The bit move: the E2M1 nibble ``s e1 e0 m`` becomes the E4M3 byte ``s 0 0 e1 e0 m 0 0`` (exponent field
``0 0 e1 e0``, top mantissa bit m), whose value is the E2M1 value times 2^-6 for all 16 codes (e = 0 gives
the E4M3 subnormal m * 2^-7 for the E2M1 subnormal m * 2^-1). The 2^-6 goes back in with the scales.

Layout. A thread of the WGMMA_8BIT layout holds 4 consecutive bytes of a row per register. For the FP4
bytes [rows, 16] of one 32-element scale block that is bytes 4q..4q+3 (elements 8q..8q+7); the 4 low
nibbles make the register for E4M3 columns 4q..4q+3 of the [rows, 32] operand and the 4 high nibbles
the one for columns 16+4q..16+4q+3. So operand column p*16 + j holds element 2j + p: the kernel's FP4 K
order (``kernel.fp4_k_permutation``), the one x already enters in.

The activations: the wgmma's B operand must be FP8 too, so x enters as E4M3 values with one power-of-two
scale per 32 columns (``E4m3Rows``). The model's activation quantizer already made every expert input
such values (FP8 E4M3, power-of-two scale per 1 x 32 for V4.1, per 1 x 128 for V4), so re-expressing a
row this way is exact (``e4m3_rows``); other bf16 inputs would be rounded to FP8.

Per 32 columns the kernel runs one wgmma into a zeroed accumulator and adds it, times weight scale x
2^6 x activation scale (powers of two: an exact product), into a float32 accumulator in registers. The
products are exact either way; what differs from the bf16 form is where the partial sums round, so the
bits differ from ``fp4_operands="bf16"`` (a choice the model makes per program, never per batch).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.grouped_gemm.plan import take_rows

SCALE_BLOCK = 32
E2M1_TO_E4M3_LOG2 = -6     # the bit move's value factor, 2^-6
_E4M3_MAX = 448.0

# One input register ($2: 4 FP4 bytes of a row) -> low-nibble E4M3 bytes ($0), high-nibble ones ($1).
# lop3 0xEA is (a & b) | c.
FP4_TO_E4M3_PTX = """{
.reg .b32 a, s;
shl.b32 a, $2, 2;
shl.b32 s, $2, 4;
and.b32 s, s, 0x80808080;
lop3.b32 $0, a, 0x1C1C1C1C, s, 0xEA;
shr.u32 a, $2, 2;
and.b32 s, $2, 0x80808080;
lop3.b32 $1, a, 0x1C1C1C1C, s, 0xEA;
}"""


class E4m3Rows(NamedTuple):
    """Kernel rows as FP8: values float8_e4m3fn [R, K] and scale float32 [R, K/32] (powers of two),
    row r's column c standing for values[r, c] * scale[r, c // 32]."""

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The values' shape: rows and columns, as a bf16 row array's."""
        return self.values.shape


def e4m3_rows(x_rk: jax.Array) -> E4m3Rows:
    """bf16/f32 rows [R, K] -> ``E4m3Rows`` with the smallest power-of-two scale per 32 columns that
    keeps every |value| <= 448 (1 for an all-zero block).

    Exact for rows an FP8 quantizer with power-of-two scales per 32 (or a multiple of 32) columns made:
    such a block is q * s with q on the E4M3 grid, |q| <= 448; the scale chosen here is s' <= s, and
    q * s / s' = q * 2^k stays on the grid up to 448. The scale is found from the exponent bits (no
    log2 or division), so it is exact on every backend."""
    r, k = x_rk.shape
    if k % SCALE_BLOCK:
        raise ValueError(f"E4M3 kernel rows need K a multiple of {SCALE_BLOCK}, got K={k}")
    xb = x_rk.astype(jnp.float32).reshape(r, k // SCALE_BLOCK, SCALE_BLOCK)
    j = row_scale_exponent(jnp.max(jnp.abs(xb), axis=-1))
    values = (xb * jnp.ldexp(jnp.float32(1), -j)[..., None]).astype(jnp.float8_e4m3fn).reshape(r, k)
    return E4m3Rows(values, jnp.ldexp(jnp.float32(1), j))


def row_scale_exponent(amax: jax.Array) -> jax.Array:
    """int32: the least j with amax <= 448 * 2^j (0 where amax is 0): ``e4m3_rows``' scale 2^j of a
    32-column block whose largest |value| is amax. From the exponent bits: exact on every backend."""
    mant, exp = jnp.frexp(amax)          # amax = mant * 2^exp, mant in [0.5, 1)
    # amax <= 448 * 2^j  <=>  mant * 2^(exp - j) <= 0.875 * 2^9
    j = jnp.where(mant <= 0.875, exp - 9, exp - 8)
    return jnp.where(amax > 0, j, 0)


def gather(rows: E4m3Rows, row_src: jax.Array) -> E4m3Rows:
    """Rows ``row_src`` of ``rows`` (out-of-range: zero rows, scale 0), as ``plan.take_rows`` gives them."""
    return E4m3Rows(take_rows(rows.values, row_src), take_rows(rows.scale, row_src))


def fp4_bytes_to_e4m3(q):
    """Packed FP4 bytes uint8 [R, 16 * n] in the WGMMA_8BIT layout -> float8_e4m3fn [R, 32 * n] in the
    WGMMA_8BIT layout, per 16-byte block [16 low nibbles' bytes, 16 high nibbles' bytes] (the kernel's
    K order), each the E2M1 value times 2^-6. Inline PTX: GPU only (``fp4_bytes_to_e4m3_jnp`` is the
    interpreter's form, with the same values)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    rows, cols = q.shape
    layout = plgpu.Layout.WGMMA_8BIT

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * cols), jnp.float8_e4m3fn, layout))
    def fp4_to_e4m3(_, q_fa):
        i32 = ir.IntegerType.get_signless(32)
        f8x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        out = np.empty(q_fa.layout.registers_shape((rows, 2 * cols)), dtype=object)
        # register axis 1 walks 16-byte column tiles: tile b's low nibbles -> output tile 2b, high -> 2b + 1
        for idx, reg in np.ndenumerate(q_fa.registers):
            res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [mgpu_utils.bitcast(reg, i32)],
                                  FP4_TO_E4M3_PTX, "=r,=r,r")
            for half in range(2):
                out[idx[:1] + (2 * idx[1] + half,) + idx[2:]] = mgpu_utils.bitcast(
                    llvm.extractvalue(i32, res, [half]), f8x4)
        return mgpu.FragmentedArray(_registers=out, _layout=q_fa.layout, _is_signed=None)

    return fp4_to_e4m3(q)


def fp4_bytes_to_e4m3_jnp(q):
    """``fp4_bytes_to_e4m3`` with jnp integer ops (the Mosaic GPU interpreter; any layout)."""
    rows, cols = q.shape
    qi = q.astype(jnp.int32).reshape(rows, cols // 16, 16)
    lo = ((qi & 7) << 2) | ((qi & 8) << 4)
    hi = ((qi >> 2) & 0x1C) | (qi & 0x80)
    out = jnp.concatenate([lo, hi], axis=-1).reshape(rows, 2 * cols).astype(jnp.uint8)
    return lax.bitcast_convert_type(out, jnp.float8_e4m3fn)


def emulate_fp4_to_e4m3(word):
    """``FP4_TO_E4M3_PTX`` on uint32 numpy words (4 FP4 bytes each) -> (low, high) words of E4M3 bytes."""
    w = np.asarray(word, np.uint64)
    mask = lambda v: v & 0xFFFFFFFF   # noqa: E731
    lo = (mask(w << 2) & 0x1C1C1C1C) | (mask(w << 4) & 0x80808080)
    hi = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    return lo.astype(np.uint32), hi.astype(np.uint32)
