"""Manifold-constrained hyper-connections: 4 residual streams mixed by Sinkhorn-normalised matrices.

Shapes: the stream state is x_bthd [B, T, hc, D] (hc = 4 copies). All mixing math is fp32 and row-local.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer_jax.model.numerics import round_to_bf16
from pallas_kernels.sinkhorn import SEGMENT_ROUNDS, SinkhornConfig, sinkhorn_rounds, sinkhorn_rounds_xla


def split_bf16x3(w: jax.Array) -> jax.Array:
    """fp32 w [..., M, K] -> bf16 [..., 3 * M, K]: hi, mid and lo parts, each the bf16 rounding of what
    the previous parts leave, so hi + mid + lo == w exactly for normal-range values (3 x 8 significand
    bits hold fp32's 24). The roundings are ``round_to_bf16``, not bf16 casts and back: XLA:GPU deleted
    those as no-ops, making ``w - hi`` zero and mid and lo zeros (deviceless H200 compile, 2026-12-05)."""
    hi = round_to_bf16(w)
    r = w - hi
    mid = round_to_bf16(r)
    lo = round_to_bf16(r - mid)
    return jnp.concatenate([hi, mid, lo], axis=-2).astype(jnp.bfloat16)   # exact: already on the grid


SPLIT_SUFFIX = "_bf16x3"


def is_stream_mix_fn(key, leaf) -> bool:
    """Whether a params dict entry is an mHC stream-mix weight (``hc_attn_fn``, ``hc_ffn_fn``,
    ``hc_head_fn``: fp32 [M, K]) that ``prepare_stream_dots`` splits."""
    return (isinstance(key, str) and key.startswith("hc_") and key.endswith("_fn") and len(leaf.shape) == 2
            and leaf.dtype == jnp.float32)


_split_jit = jax.jit(split_bf16x3)


def prepare_stream_dots(params):
    """The params with each mHC stream-mix weight ``hc_*_fn`` [M, K] joined by its ``split_bf16x3`` parts
    under ``hc_*_fn`` + SPLIT_SUFFIX (bf16 [3 * M, K]), which ``stream_dot``'s bf16 form otherwise makes
    from fn in every step: a [72, 20480] concatenate launch per mHC call in the B=64 decode step (24 of
    them in the H200 slice's; ~2.6 us each in the H100 4-layer timeline of 2026-12-05). Same values, so
    the same bits; 1.5x each fn's bytes more at rest (``planner``). fn stays for the fp32 form. For the
    GPU engine, at load."""

    def walk(node):
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            for k, v in node.items():
                if is_stream_mix_fn(k, v) and k + SPLIT_SUFFIX not in node:
                    parts = _split_jit(v)
                    sharding = getattr(v, "sharding", None)
                    out[k + SPLIT_SUFFIX] = parts if sharding is None else jax.device_put(parts, sharding)
            return out
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node

    return walk(params)


def stream_dot(x_btk: jax.Array, fn_mk: jax.Array, bf16: bool = False,
               fn_parts: jax.Array | None = None) -> jax.Array:
    """x [B, T, K] @ fn [M, K]^T in fp32 -> [B, T, M], fn fp32.

    bf16 (``Numerics.bf16_stream_dot``), with a bf16 stream: the dot runs on bf16 operands with fp32
    accumulation, fn split into three bf16 parts (``split_bf16x3``). Every product is exact in fp32,
    so this is the fp32 dot with another summation order (parts summed small to large), as
    ``linear.dot_f32`` does for the head. At HIGHEST on fp32 operands XLA ran it on the CUDA cores:
    48 ms of the H200 slice's 32k prefill (384 calls of [2048, 20480] x [20480, 24]; 2026-12-04 trace)
    and a reduce fusion per call at decode. Otherwise, and for fp32 streams, the HIGHEST fp32 dot.
    fn_parts: ``split_bf16x3(fn)`` [3 * M, K] made ahead (``prepare_stream_dots``), for the bf16 form."""
    if not bf16 or x_btk.dtype != jnp.bfloat16:
        return jnp.einsum("btk,mk->btm", x_btk.astype(jnp.float32), fn_mk, precision=jax.lax.Precision.HIGHEST)
    m = fn_mk.shape[0]
    if fn_parts is None:
        fn_parts = split_bf16x3(fn_mk.astype(jnp.float32))
    parts = jnp.einsum("btk,mk->btm", x_btk, fn_parts, preferred_element_type=jnp.float32)
    return (parts[..., 2 * m:] + parts[..., m:2 * m]) + parts[..., :m]


def mixes(x_bthd: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
          hc_eps: float, sinkhorn_iters: int, unroll: bool = False, segment_rows: int | None = None,
          bf16_dot: bool = False, sinkhorn_impl: str | None = None,
          rows_local: Callable | None = None, fn_parts: jax.Array | None = None, pdl: bool = False,
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(pre [B,T,hc], post [B,T,hc], comb [B,T,hc,hc]) from the flattened stream (stream-major columns).

    sinkhorn_impl: who runs the Sinkhorn rounds: None = the model's XLA code below, else the
    ``pallas_kernels.sinkhorn`` op with that implementation ("interpret": the Mosaic GPU kernel in the
    interpreter). For the XLA code: unroll, the rounds unrolled (no while loop;
    ``Numerics.sinkhorn_unroll``); segment_rows, from this many rows B*T the unrolled rounds are cut
    into segments of ``pallas_kernels.sinkhorn.SEGMENT_ROUNDS`` (``Numerics.sinkhorn_segment_rows``; None: never).
    bf16_dot: ``stream_dot``'s bf16 form; fn_parts: its split of fn made ahead (``prepare_stream_dots``).
    pdl: the Sinkhorn kernel's ``SinkhornConfig.pdl`` (``Numerics.kernel_pdl``).
    rows_local: for the op, a wrapper that runs a function of [B, ...] arrays on each device's own
    rows (``ParallelContext.batch_local``): GSPMD cannot split a Pallas call, so on a mesh it would
    gather every device's rows and run the whole batch on each."""
    b, t, hc, d = x_bthd.shape
    f = x_bthd.astype(jnp.float32).reshape(b, t, hc * d)
    m = stream_dot(x_bthd.reshape(b, t, hc * d), fn, bf16_dot, fn_parts)
    m = m * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + norm_eps)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(b, t, hc, hc)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)

    rounds = sinkhorn_iters - 1
    if sinkhorn_impl is None:
        cut = segment_rows is not None and b * t >= segment_rows
        return pre, post, sinkhorn_rounds_xla(comb, rounds=rounds, eps=hc_eps, unroll=unroll,
                                              segment=SEGMENT_ROUNDS if cut else None)
    if sinkhorn_impl == "interpret":
        from pallas_kernels.interpret import gpu_interpreter
        from pallas_kernels.sinkhorn.kernel import sinkhorn_rounds_pallas

        def run(c):
            with gpu_interpreter():
                return sinkhorn_rounds_pallas(c, rounds=rounds, eps=hc_eps)
    else:
        from pallas_kernels.registry import AUTO

        def run(c):
            return sinkhorn_rounds(c, rounds=rounds, eps=hc_eps, impl=sinkhorn_impl, selection=AUTO,
                                   config=SinkhornConfig(pdl=pdl))
    return pre, post, (run if rows_local is None else rows_local(run))(comb)


def pre_apply(x_bthd: jax.Array, pre_bth: jax.Array, out_dtype) -> jax.Array:
    """Collapse the streams: sum_c pre_c x_c (fp32, in stream order).

    Written as hc multiply-adds, as ``post_apply`` is: the einsum was a reduce over the 4 streams, which
    XLA:GPU emits as a kernel of its own in front of the RMSNorm that always follows (two a layer;
    deviceless H200 compile). Elementwise, it fuses into the norm's kernel (-8 launches in the 4-layer
    decode step). The einsum summed in another order: the fp32 sum moves by an ulp, now and then a bf16
    output by one step. On the tiny random model that flipped near-tied routing in 3 of 5 prompts of
    21-33 tokens, and 5 of the example job's 100 requests drew other tokens (each version is
    deterministic and batch-invariant; neither order is the reference's own)."""
    return _weighted_streams(x_bthd.astype(jnp.float32), pre_bth).astype(out_dtype)


def _weighted_streams(x_bthd: jax.Array, w_bth: jax.Array) -> jax.Array:
    """sum_c w[:, :, c] x[:, :, c] -> [B, T, D], fp32 adds in stream order, each weight a scalar per token
    (the form XLA fuses into the neighbouring kernel: ``pre_apply``, ``post_apply``)."""
    acc = x_bthd[:, :, 0] * w_bth[:, :, 0, None]
    for c in range(1, x_bthd.shape[2]):
        acc = acc + x_bthd[:, :, c] * w_bth[:, :, c, None]
    return acc


def post_apply(y_btd: jax.Array, x_bthd: jax.Array, post_bth: jax.Array, comb_bthk: jax.Array, out_dtype) -> jax.Array:
    """Expand: new_k = post_k y + sum_j comb[j, k] x_j (the j sum in stream order, fp32).

    Written as hc multiply-adds rather than an einsum: XLA made the einsum a batched GEMM of [hc, D] x
    [hc, hc] per token (~0.2 ms a call at a 2048-token chunk on the H200) plus a separate add (1.2 ms in
    80 of the 32k prefill's 384 calls; 2026-12-04 trace), for what is one elementwise pass."""
    x = x_bthd.astype(jnp.float32)
    y = y_btd.astype(jnp.float32)
    hc = x.shape[2]
    # One output stream at a time, each coefficient a scalar per token (comb[:, :, j, k]): XLA then reads
    # comb's entries where the Sinkhorn kernel wrote them ([hc * hc, tokens]) and fuses the whole apply into
    # one kernel; with comb[:, :, j, :] it kept a transpose kernel in front (deviceless H200 compile).
    outs = [post_bth[:, :, k, None] * y + _weighted_streams(x, comb_bthk[:, :, :, k]) for k in range(hc)]
    return jnp.stack(outs, axis=2).astype(out_dtype)
