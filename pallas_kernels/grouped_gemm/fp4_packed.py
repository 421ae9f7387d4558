"""FP4 -> bf16 on packed 32-bit words with inline PTX (the grouped GEMM's and the attention kernel's
``fp4_dequant="packed"``; ``dequant`` takes E8M0 row scales, ``dequant_scaled`` bf16 ones).

Why: the jnp-level decoders ("arith", "bits") give every element its own 32-bit lane, so each integer or
float op serves one element. Here one 32-bit register holds two bf16 results and every op serves both.

Per 16-bit input register (bytes B0, B1 of one row: columns 2c and 2c+1 of the WGMMA fragment):

1. ``prmt`` spreads the bytes 16 bits apart: w = [0, B0, 0, B1], so one shift moves a nibble of each byte
   into the same place of its half (and the high nibbles' signs are already at bits 15 and 31).
2. Magnitude: the 3 bits of the low (high) nibbles go to bf16 bits 6-8, under a fixed exponent field of
   124: v = g(c) * 2^-3 with g = 1, 1.5, 2, 3, 4, 6, 8, 12 for the codes c = 0..7. All normal numbers.
3. E2M1 value = min(g/2, g-1) (codes 0 and 1 are the subnormal ones), computed as
   g/2 - relu(1 - g/2) with two bf16x2 fmas, the scale S = 2^(b-127) folded into their constants:
   t = relu(v * -T + S), d = v * T - t with T = 4S. Every intermediate is exact and normal for
   E8M0 bytes b in [3, 251]; b = 0 gives 0 as the other modes do.
4. Sign: the nibble's bit 3 is shifted to bit 15 of its half and or-ed in.

About 4 integer and 3 bf16x2 ops per two elements (the negation may fold into the fma), plus 3 ops
per row and scale block for the constants: ~3.5 ops per element against ~7 in "bits". No float32 or
bf16 subnormal is produced for b in [3, 251], so flush-to-zero cannot change a result.

Mode "subnormal" (``SUBNORMAL_PTX``) trades range for ops. prmt copies each byte into both bytes of its
half, w = [B0, B0, B1, B1], so one shift puts a nibble's 3 magnitude bits at bf16 bits 6-8 (exponent
bits 0-1 and the top mantissa bit) with a zero exponent above them: that bf16 is exactly the E2M1 value
* 2^-126 (codes 0 and 1 are bf16 subnormals, which bf16 arithmetic keeps). One bf16x2 multiply by
C = 2^(b-1) gives value * 2^(b-127) exactly, and the sign is or-ed in from the other copy of the byte:
10 ops per 4 elements (2.5 per element) against 15 in "packed". C must be a bf16, so the mode is exact
for E8M0 bytes b in [0, 128] only (scales up to 2^1, weights up to 12), where "packed" covers [3, 251]:
the caller checks the scales before choosing it (``scales_fit_subnormal``).

The Mosaic GPU interpreter cannot run inline PTX: under it the kernel uses the "bits" decoder, which
gives the same values. ``emulate`` and ``emulate_subnormal`` replay the PTX in numpy, op for op, for
the tests.
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

# One input register ($2) and the row's constants ($3 = -T, $4 = T, $5 = S) -> low-nibble pair ($0) and
# high-nibble pair ($1). prmt makes w = [0, B0, 0, B1]: the high nibbles' signs are then already at bits
# 15 and 31. lop3 0xEA is (a & b) | c; 0xF8 is a | (b & c).
_MAG_MASK, _EXP_124, _SIGN = 0x01C001C0, 0x3E003E00, 0x80008000
_SHIFTS = ((-2, 4), (-6, 0))   # (magnitude, sign) shifts of w for the low and the high nibble (< 0: right)


def _shift_ptx(dst: str, k: int) -> str:
    if k == 0:
        return f"mov.b32 {dst}, w;"
    return f"shl.b32 {dst}, w, {k};" if k > 0 else f"shr.u32 {dst}, w, {-k};"


_PAIR_PTX = "\n".join(
    ["{", ".reg .b32 w, v, t, d, sg;", "prmt.b32 w, $2, 0, 0x1404;"]
    + [line for out, (mag, sgn) in enumerate(_SHIFTS) for line in (
        _shift_ptx("t", mag),
        f"lop3.b32 v, t, {_MAG_MASK:#010x}, {_EXP_124:#010x}, 0xEA;",
        "fma.rn.relu.bf16x2 t, v, $3, $5;",
        "neg.bf16x2 t, t;",
        "fma.rn.bf16x2 d, v, $4, t;",
        _shift_ptx("sg", sgn),
        f"lop3.b32 ${out}, d, sg, {_SIGN:#010x}, 0xF8;")]
    + ["}"])

# E8M0 byte ($3) -> (-T, T, S) as bf16x2 pairs: S = 2^(b-127) is b << 7 in each half (one multiply), and
# T = 4S is a bf16x2 multiply, which also keeps T = 0 for b = 0.
_CONST_PTX = """{
.reg .b32 s2, t2, four;
mov.b32 four, 0x40804080;
mul.lo.u32 s2, $3, 0x00800080;
mul.rn.bf16x2 t2, s2, four;
xor.b32 $0, t2, 0x80008000;
mov.b32 $1, t2;
mov.b32 $2, s2;
}"""


# The same constants from a bf16 scale already in both halves of $3 (S = s, any bf16 that keeps the
# products below exact: the attention kernel's E4M3 row scales): -T ($0), T ($1), S ($2).
_SCALED_CONST_PTX = """{
.reg .b32 t2, four;
mov.b32 four, 0x40804080;
mul.rn.bf16x2 t2, $3, four;
xor.b32 $0, t2, 0x80008000;
mov.b32 $1, t2;
mov.b32 $2, $3;
}"""


# "subnormal" mode. $2 = the input register, $3 = C -> low-nibble pair ($0), high-nibble pair ($1).
# w = [B0, B0, B1, B1]: low nibble magnitude at bits 0-2 (shift 6 -> 6-8), its sign at 11 (shift 4 -> 15);
# high nibble magnitude at bits 4-6 (shift 2), its sign already at 15 in the upper copy.
SUBNORMAL_PTX = """{
.reg .b32 w, t, m, r, sg;
prmt.b32 w, $2, 0, 0x1100;
shl.b32 t, w, 6;
and.b32 m, t, 0x01C001C0;
mul.rn.bf16x2 r, m, $3;
shl.b32 sg, w, 4;
lop3.b32 $0, sg, 0x80008000, r, 0xEA;
shl.b32 t, w, 2;
and.b32 m, t, 0x01C001C0;
mul.rn.bf16x2 r, m, $3;
lop3.b32 $1, w, 0x80008000, r, 0xEA;
}"""

# E8M0 byte ($1) -> C = 2^(b-1) in both bf16 halves ((b + 126) << 7), or 0 for b = 0 (slct: b - 1 < 0).
_SUBNORMAL_CONST_PTX = """{
.reg .b32 c, bm1;
mul.lo.u32 c, $1, 0x00800080;
add.u32 c, c, 0x3F003F00;
sub.s32 bm1, $1, 1;
slct.b32.s32 $0, c, 0, bm1;
}"""
SUBNORMAL_MAX_SCALE_BYTE = 128     # C = 2^(b-1) must be a finite bf16


def scale_byte_max(w_scale) -> int | None:
    """The largest E8M0 byte of ``w_scale`` (uint8 or float8_e8m0fnu, any layout); None if it is empty.
    Reads the array: for weight-load time, not per step."""
    import jax

    if not w_scale.size:
        return None
    s = w_scale if w_scale.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(w_scale, jnp.uint8)
    return int(jnp.max(s))


def scales_fit_subnormal(w_scale) -> bool:
    """Whether every E8M0 byte of ``w_scale`` is one the "subnormal" mode decodes exactly (<= 128)."""
    top = scale_byte_max(w_scale)
    return top is None or top <= SUBNORMAL_MAX_SCALE_BYTE


def dequant(q, b, mode: str = "packed"):
    """q uint8 [R, C] bytes, b int32 [R, C] (each row's E8M0 byte, broadcast), both in the WGMMA layout
    -> bf16 [R, 2C] in the WGMMA layout, columns [C low nibbles, C high nibbles] (the kernel's K order).

    mode: "packed" (exact for b in {0} and [3, 251]) or "subnormal" (exact for b in [0, 128])."""
    if mode not in ("packed", "subnormal"):
        raise ValueError(f"mode={mode!r} must be 'packed' or 'subnormal'")
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm, vector

    def consts(b_reg):
        i32 = ir.IntegerType.get_signless(32)
        bval = vector.extract(b_reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
        if mode == "subnormal":
            return [llvm.inline_asm(i32, [bval], _SUBNORMAL_CONST_PTX, "=r,r")]
        res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 3), [bval], _CONST_PTX, "=r,=r,=r,r")
        return [llvm.extractvalue(i32, res, [k]) for k in range(3)]

    if mode == "subnormal":
        return _inline_pairs(q, b, consts, SUBNORMAL_PTX, "=r,=r,r,r", "fp4_subnormal_dequant")
    return _inline_pairs(q, b, consts, _PAIR_PTX, "=r,=r,r,r,r,r", "fp4_packed_dequant")


def dequant_scaled(q, s):
    """The "packed" decoder with a bf16 scale per row: q uint8 [R, C], s bf16 [R, C] (each row's scale,
    broadcast), both in the WGMMA layout -> bf16 [R, 2C], columns [C low nibbles, C high nibbles].

    The E2M1 value times s, exact for any s >= 0 with 4 significant bits or fewer whose s/4 and 6s are
    normal bf16 numbers: every non-negative E4M3 value (the attention kernel's compressed-cache scales,
    made from an amax), so the same bits as any exact decoder. s = 0 gives 0. A negative s would turn
    codes 0 and 1 wrong (the relu step assumes s >= 0)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    def consts(s_reg):   # a WGMMA register holds two columns of one row: the pair (s, s) as it is
        i32 = ir.IntegerType.get_signless(32)
        res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 3), [mgpu_utils.bitcast(s_reg, i32)],
                              _SCALED_CONST_PTX, "=r,=r,=r,r")
        return [llvm.extractvalue(i32, res, [k]) for k in range(3)]

    return _inline_pairs(q, s, consts, _PAIR_PTX, "=r,=r,r,r,r,r", "fp4_scaled_dequant")


def _inline_pairs(q, aux, consts, pair_ptx: str, constraints: str, name: str):
    """Run ``pair_ptx`` on every 16-bit register of q (two bytes of a row) with the constants
    ``consts(aux register)`` of its row -> bf16 [R, 2C] (low-nibble pairs, then high-nibble pairs)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    rows, cols = q.shape
    layout = plgpu.Layout.WGMMA

    def body(_, q_fa, aux_fa):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(q_fa.layout.registers_shape((rows, 2 * cols)), dtype=object)
        row_consts = {}
        groups = cols // 8   # register axis 1 walks 8-column groups; the high nibbles go after the low ones
        for idx, reg in np.ndenumerate(q_fa.registers):
            row_key = idx[:1] + idx[2:]
            if row_key not in row_consts:     # one set per row the thread holds, shared by its column groups
                row_consts[row_key] = consts(aux_fa.registers[idx])
            x = arith.extui(i32, mgpu_utils.bitcast(reg, i16))
            res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [x, *row_consts[row_key]], pair_ptx,
                                  constraints)
            for half in range(2):
                pair = mgpu_utils.bitcast(llvm.extractvalue(i32, res, [half]), bf16x2)
                out[idx[:1] + (idx[1] + half * groups,) + idx[2:]] = pair
        return mgpu.FragmentedArray(_registers=out, _layout=q_fa.layout, _is_signed=None)

    body.__name__ = name
    fn = plgpu.inline_mgpu(arg_types=(layout, layout),
                           return_type=plgpu.ShapeDtypeStruct((rows, 2 * cols), jnp.bfloat16, layout))(body)
    return fn(q, aux)


# ---- numpy replay of the PTX above (tests only) ------------------------------------------------------

def _bf16x2(word):
    lo = (word & 0xFFFF).astype(np.uint32) << 16
    hi = word & 0xFFFF0000
    return np.stack([lo, hi], -1).astype(np.uint32).view(np.float32).astype(np.float64)


def _word(pair):
    b = jnp.asarray(pair.astype(np.float32)).astype(jnp.bfloat16)   # exact here; round-to-nearest anyway
    u = np.asarray(b).view(np.uint16).astype(np.uint32)
    return u[..., 0] | (u[..., 1] << 16)


def emulate(byte0, byte1, b):
    """The PTX on uint32 numpy arrays -> (low pair, high pair) bf16x2 words as uint32."""
    return _emulate_pairs(byte0, byte1, (np.asarray(b, np.uint32) * 0x00800080) & 0xFFFFFFFF)


def emulate_scaled(byte0, byte1, s_bits):
    """``dequant_scaled``'s PTX: s_bits = the scale's bf16 bits (uint16) -> (low pair, high pair)."""
    s = np.asarray(s_bits, np.uint32)
    return _emulate_pairs(byte0, byte1, s | (s << 16))


def _emulate_pairs(byte0, byte1, s2):
    x = np.asarray(byte0, np.uint32) | (np.asarray(byte1, np.uint32) << 8)
    t2 = _word(_bf16x2(s2) * 4.0)
    neg_t, pos_t, scale = _bf16x2(t2 ^ _SIGN), _bf16x2(t2), _bf16x2(s2)
    w = ((x & 0xFF) << 8) | ((x & 0xFF00) << 16)

    def shift(k):
        return (w << k) & 0xFFFFFFFF if k >= 0 else w >> -k

    outs = []
    for mag, sgn in _SHIFTS:
        v = _bf16x2((shift(mag) & _MAG_MASK) | _EXP_124)
        t = v * neg_t + scale
        t = np.where(t < 0, 0.0, t)
        d = _word(v * pos_t - t)
        outs.append(d | (shift(sgn) & _SIGN))
    return tuple(np.asarray(o, np.uint32) for o in outs)


def emulate_subnormal(byte0, byte1, b):
    """``SUBNORMAL_PTX`` (and its constant) on uint32 numpy arrays -> (low pair, high pair) bf16x2 words."""
    x = np.asarray(byte0, np.uint32) | (np.asarray(byte1, np.uint32) << 8)
    b = np.asarray(b, np.int64)
    c = np.where(b - 1 >= 0, ((b * 0x00800080) + 0x3F003F00) & 0xFFFFFFFF, 0).astype(np.uint32)
    w = (x & 0xFF) | ((x & 0xFF) << 8) | ((x & 0xFF00) << 8) | ((x & 0xFF00) << 16)
    outs = []
    for mag_shift, sign_word in ((6, (w << 4) & 0xFFFFFFFF), (2, w)):
        m = (w << mag_shift) & 0x01C001C0
        r = _word_exact(_bf16x2(m) * _bf16x2(c))
        outs.append((sign_word & _SIGN) | r)
    return tuple(np.asarray(o, np.uint32) for o in outs)


def _word_exact(pair):
    """float64 pairs that are exact bf16 values (subnormals included) -> bf16x2 words, in numpy alone
    (numpy keeps float32 subnormals; the products here are exact, so any inexact one is a bug)."""
    u = pair.astype(np.float32).view(np.uint32)
    if np.any(u & 0xFFFF):
        raise AssertionError("a product is not a bf16 value: the subnormal decode would round")
    u = u >> 16
    return u[..., 0] | (u[..., 1] << 16)
