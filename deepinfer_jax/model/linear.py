"""Quantized linears computed from the stored formats (weights stay FP8 / packed FP4 in memory).

Dequantization happens inside the jitted graph; the activation fake-quant of the reference is applied
when ``numerics.fake_quant`` is on. Kernels for the GPU hot path live in ``pallas_kernels``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from deepinfer_jax.model import dense_fp8
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp8, fit_block

FP4_BLOCK = 32
# E2M1 code -> value; index = the 4-bit nibble (sign in bit 3).
_FP4_VALUES = jnp.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)


def e8m0_to_f32(scale: jax.Array) -> jax.Array:
    return scale.astype(jnp.float32)


def dequant_fp8(w_f8: jax.Array, scale_e8m0: jax.Array) -> jax.Array:
    """[..., out, in] e4m3 with [..., ceil(out/B), ceil(in/B)] E8M0 block scales -> fp32."""
    *_, out_dim, in_dim = w_f8.shape
    # Blocks are square powers of two (32 for V4.1, 128 for V4); the last block may be partial, so the
    # block is the power of two that covers the dims with this many scales, not out_dim / rows.
    per_scale = max(-(-out_dim // scale_e8m0.shape[-2]), -(-in_dim // scale_e8m0.shape[-1]))
    block = 1 << (per_scale - 1).bit_length()
    s = e8m0_to_f32(scale_e8m0)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :out_dim, :in_dim]
    return w_f8.astype(jnp.float32) * s


def dequant_fp4(w_u8: jax.Array, scale_e8m0: jax.Array) -> jax.Array:
    """[..., out, in/2] packed E2M1 (element 2k in the low nibble) with [..., out, in/32] E8M0 -> fp32."""
    lo = _FP4_VALUES[(w_u8 & 0x0F).astype(jnp.int32)]
    hi = _FP4_VALUES[(w_u8 >> 4).astype(jnp.int32)]
    w = jnp.stack([lo, hi], axis=-1).reshape(*w_u8.shape[:-1], w_u8.shape[-1] * 2)
    s = jnp.repeat(e8m0_to_f32(scale_e8m0), FP4_BLOCK, axis=-1)[..., : w.shape[-1]]
    return w * s


def dot_f32(x: jax.Array, w_oi: jax.Array) -> jax.Array:
    """x[..., in] @ w[out, in]^T as fp32 math: fp32 [..., out].

    With bf16 x and w every product is exact in fp32 (8 x 8 significand bits), so the dot runs on the
    bf16 operands with fp32 accumulation (tensor cores on a GPU) instead of upcast copies at HIGHEST
    precision on the CUDA cores; only the fp32 summation order differs. For the head and the routers,
    whose weights are stored BF16 and used in fp32: on the H200 slice the head's fp32 form cost 0.9 ms
    of convert + 1.7 ms of fp32 GEMM per decode step, the routers' 54 ms of a 32k prefill."""
    if x.dtype == jnp.bfloat16 and w_oi.dtype == jnp.bfloat16:
        return jnp.einsum("...i,oi->...o", x, w_oi, preferred_element_type=jnp.float32)
    return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w_oi.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _bf16_out_dot(x: jax.Array, w: jax.Array, numerics: Numerics, out_dtype) -> bool:
    """Whether a dense dot asks the GEMM for bf16 (f32 accumulation, one rounding at its end): bf16
    operands to a bf16 out_dtype, where ``Numerics.bf16_out_dense``."""
    return (out_dtype is not None and jnp.dtype(out_dtype) == jnp.bfloat16 and x.dtype == jnp.bfloat16
            and w.dtype == jnp.bfloat16 and numerics.bf16_out_dense())


def dense(x: jax.Array, w_oi: jax.Array, numerics: Numerics, out_dtype=None) -> jax.Array:
    """x[..., in] @ w[out, in]^T with fp32 accumulation (bf16 operands to a bf16 out_dtype: the GEMM
    rounds its f32 sums once, where ``Numerics.bf16_out_dense``; else an f32 dot and a convert)."""
    if _bf16_out_dot(x, w_oi, numerics, out_dtype):
        return jnp.einsum("...i,oi->...o", x, w_oi, precision=numerics.precision,
                          preferred_element_type=jnp.bfloat16)
    y = jnp.einsum("...i,oi->...o", x.astype(jnp.float32) if w_oi.dtype == jnp.float32 else x, w_oi,
                   precision=numerics.precision, preferred_element_type=jnp.float32)
    return y if out_dtype is None else y.astype(out_dtype)


def grouped_dense(x_btgi: jax.Array, w_gri: jax.Array, numerics: Numerics, out_dtype) -> jax.Array:
    """z[b, t, g] = x[b, t, g] @ w[g]^T per group (attention's wo_a over its o_groups) with fp32
    accumulation, rounded to ``out_dtype``: as ``dense``, one bf16-output dot where
    ``Numerics.bf16_out_dense`` holds for bf16 operands (on the H100, benchmarks/bf16_out_dot_gpu.py's
    wo_a rows: the f32 dot + convert's bits at 64 and 8,192 rows, 0.66 against 0.81 ms at 8,192), else
    an f32 dot and a convert."""
    bf16 = _bf16_out_dot(x_btgi, w_gri, numerics, out_dtype)
    z = jnp.einsum("btgi,gri->btgr", x_btgi, w_gri, precision=numerics.precision,
                   preferred_element_type=jnp.bfloat16 if bf16 else jnp.float32)
    return z.astype(out_dtype)


def weight_of(p: dict, dtype=jnp.float32) -> jax.Array:
    """The dequantized weight of a linear's param dict (FP8 + scale, packed FP4 + scale, plain, or held
    for the dense kernel: ``dense_fp8.prepare_dense_fp8``)."""
    if dense_fp8.is_prepared(p):
        return dense_fp8.held_weight(p, dtype)
    w = p["weight"]
    if "scale" not in p:
        return w.astype(dtype)
    if w.dtype == jnp.uint8:
        return dequant_fp4(w, p["scale"]).astype(dtype)
    return dequant_fp8(w, p["scale"]).astype(dtype)


def act_quant(x: jax.Array, numerics: Numerics, act_block: int) -> jax.Array:
    """The reference's activation quantization in front of an FP8/FP4 GEMM (spec §2.9, §3.1): FP8-E4M3
    with a power-of-two scale per 1 x act_block along K (``ModelConfig.act_quant_block``: 32 for V4.1,
    128 for V4); the identity when ``numerics.fake_quant`` is off."""
    if not numerics.fake_quant:
        return x
    return fake_quant_fp8(x, fit_block(x.shape[-1], act_block))


def act_quant_rows(x: jax.Array, act_block: int):
    """``e4m3_rows(act_quant(x))`` (``pallas_kernels.grouped_gemm.fp8_operands``: the activation
    quantizer's output as E4M3 values with a power-of-two scale per 32 columns, the FP8 kernels' x),
    bit for bit, in one pass: x [..., K] -> E4m3Rows of [prod(...), K].

    The two-step form reads the quantized rows again for their block maxima (two more kernels a
    linear on a GPU). Here they come from x's: rounding to E4M3 is monotone in |x|, so a 32-block's
    largest quantized magnitude is its largest |x| quantized, and e4m3_rows' scale follows from it.
    For fake_quant on (V4.1's 32-wide and V4's 128-wide blocks, and tiny configs' shorter rows)."""
    from deepinfer_jax.model.numerics import FP8_MAX, block_amax, fp8_scale, round_to_e4m3
    from pallas_kernels.grouped_gemm.fp8_operands import SCALE_BLOCK, E4m3Rows, row_scale_exponent

    k = x.shape[-1]
    block = fit_block(k, act_block)
    if block % SCALE_BLOCK:
        raise ValueError(f"E4M3 rows need quantizer blocks of whole {SCALE_BLOCK}-column blocks, got {block}")
    xb = x.reshape(-1, k // SCALE_BLOCK, SCALE_BLOCK).astype(jnp.float32)
    amax32 = block_amax(xb)[..., 0]                                           # [R, K/32]
    per = block // SCALE_BLOCK
    s = jnp.repeat(fp8_scale(jnp.max(amax32.reshape(xb.shape[0], -1, per), axis=-1)), per, axis=-1)
    q = round_to_e4m3(jnp.clip(xb / s[..., None], -FP8_MAX, FP8_MAX))        # the quantizer's codes
    j = row_scale_exponent(round_to_e4m3(jnp.clip(amax32 / s, 0.0, FP8_MAX)) * s)
    values = (q * (s * jnp.ldexp(jnp.float32(1), -j))[..., None]).astype(jnp.float8_e4m3fn)
    return E4m3Rows(values.reshape(xb.shape[0], k), jnp.ldexp(jnp.float32(1), j))


def _dense_operands(numerics: Numerics, k: int, act_block: int) -> str:
    """The dense kernel's operand form for a quantized linear of K inputs: ``dense_fp8.DENSE_OPERANDS``,
    except that E4M3 needs the quantizer's FP8 values on whole 32-column blocks (else bf16)."""
    e4m3 = dense_fp8.DENSE_OPERANDS == "e4m3" and numerics.fake_quant and fit_block(k, act_block) % 32 == 0
    return "e4m3" if e4m3 else "bf16"


def quant_linear(x: jax.Array, p: dict, numerics: Numerics, out_dtype=None, *, act_block: int) -> jax.Array:
    """An FP8/FP4-weight linear as the reference runs it: FP8 1 x act_block activations, fp32 accumulation.
    A linear held for the dense kernel runs on it where ``dense_fp8.kernel_impl`` says so, in the
    operand form ``dense_fp8.DENSE_OPERANDS`` names."""
    lead, k = x.shape[:-1], x.shape[-1]
    form = _dense_operands(numerics, k, act_block)
    impl = dense_fp8.kernel_impl(p, numerics, math.prod(lead), form)
    if impl is not None:
        if form == "e4m3":     # the quantizer's codes and scales straight into the kernel's E4M3 rows
            rows = act_quant_rows(x, act_block)
            x_m1k = type(rows)(rows.values[:, None], rows.scale[:, None])
        else:
            x_m1k = act_quant(x, numerics, act_block).reshape(-1, 1, k)
        y = dense_fp8.kernel_matmul(x_m1k, p, impl, form, numerics.kernel_pdl)
        return y.reshape(*lead, -1).astype(out_dtype or numerics.dtype)
    x = act_quant(x, numerics, act_block)
    w = weight_of(p, jnp.float32 if numerics.dtype == jnp.float32 else jnp.bfloat16)
    return dense(x.astype(w.dtype), w, numerics, out_dtype or numerics.dtype)


def quant_linear_pair(x: jax.Array, p: dict, numerics: Numerics, out_dtype=None, *,
                      act_block: int) -> tuple[jax.Array, jax.Array]:
    """Two FP8 linears of the same shape on the same rows, held as one [2N, K] (``dense_fp8``'s "w13")
    -> (x W_a^T, x W_b^T). On the dense kernel one launch; on XLA's route two dots on the halves of the
    weight, so the bits are those of two ``quant_linear`` calls."""
    form = _dense_operands(numerics, x.shape[-1], act_block)
    if dense_fp8.kernel_impl(p, numerics, math.prod(x.shape[:-1]), form) is not None:
        y = quant_linear(x, p, numerics, out_dtype, act_block=act_block)
        return jnp.split(y, 2, axis=-1)
    xq = act_quant(x, numerics, act_block)
    w = weight_of(p, jnp.float32 if numerics.dtype == jnp.float32 else jnp.bfloat16)
    return tuple(dense(xq.astype(w.dtype), half, numerics, out_dtype or numerics.dtype)
                 for half in jnp.split(w, 2, axis=0))


def plain_linear(x: jax.Array, p: dict, numerics: Numerics, out_dtype=None, compute_dtype=None) -> jax.Array:
    """A BF16-weight linear (no activation quantization); compute_dtype=float32 promotes like the reference.

    With float32 compute on bf16 x and weight, the dot is ``dot_f32``'s bf16-operand form: the same
    exact products, summed in float32 in another order. The V4.1 ratio-2 compressor's wkv + wgate ran as
    an fp32 GEMM on the CUDA cores (8 x 1.78 ms of the H200 slice's 32k prefill, session 24 trace)."""
    cd = compute_dtype or numerics.dtype
    if jnp.dtype(cd) == jnp.float32 and x.dtype == jnp.bfloat16 and p["weight"].dtype == jnp.bfloat16:
        return dot_f32(x, p["weight"]).astype(out_dtype or numerics.dtype)
    return dense(x.astype(cd), p["weight"].astype(cd), numerics, out_dtype or numerics.dtype)


def held_as_bf16(path: tuple, leaf) -> bool:
    """Whether ``dequantize_dense_fp8`` holds the param at ``path`` (a tuple of keys, e.g. from
    ``sharding.tree_paths``; leaf: an array or ShapeDtypeStruct) as bf16: a 2-D FP8 ``weight`` outside
    the routed experts (the grouped GEMM kernel dequantizes those in registers) and outside lookup
    tables read by rows (the Engram table, ``embed``). The memory planner counts the same set."""
    return (path[-1] == "weight" and len(leaf.shape) == 2 and leaf.dtype == jnp.float8_e4m3fn
            and "experts" not in path and "embed" not in path)


_dequant_bf16 = jax.jit(lambda p: weight_of(p, jnp.bfloat16))


def is_dense_fp8_linear(node: dict, path: tuple) -> bool:
    """Whether the dict ``node`` at ``path`` is a dense FP8 linear with its scale (``held_as_bf16``)."""
    w = node.get("weight")
    return "scale" in node and w is not None and held_as_bf16(path + ("weight",), w)


def rewrite_nodes(node, fn, path: tuple = ()):
    """``node`` (a params tree) with ``fn(sub, path)`` in place of each dict sub-node for which it returns
    a replacement (not None); other dicts, lists and tuples are rebuilt around their rewritten children.
    The load-time rewrites of the dense FP8 linears (``dequantize_dense_fp8``,
    ``dense_fp8.prepare_dense_fp8``) walk the params with it."""
    if isinstance(node, dict):
        new = fn(node, path)
        if new is not None:
            return new
        return {k: rewrite_nodes(v, fn, path + (k,)) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(rewrite_nodes(v, fn, path + (i,)) for i, v in enumerate(node))
    return node


def dequantize_dense_fp8(params: dict) -> dict:
    """The params with every dense FP8 linear (outside the routed experts) stored as its bf16 dequantized
    weight, no scale: what ``quant_linear`` builds from the FP8 weight inside every step, made once.

    Same values (an E4M3 value times a power of two is exact in bf16), so the same bits; one more byte
    per weight at rest. The GPU engine does this at load: measured on the H200 12-layer slice at decode
    B=64, the step's per-layer FP8 -> bf16 converts took ~2.8 ms of a 37.6 ms step (benchmarks/NOTES.md).
    Which weights: ``held_as_bf16``."""

    def held(node, path):
        if not is_dense_fp8_linear(node, path):
            return None
        out = {k: v for k, v in node.items() if k != "scale"}
        w = node["weight"]
        sharding = getattr(w, "sharding", None)
        w = _dequant_bf16({"weight": w, "scale": node["scale"]})
        out["weight"] = w if sharding is None else jax.device_put(w, sharding)
        return out

    return rewrite_nodes(params, held)
