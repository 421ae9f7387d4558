"""Manifold-constrained hyper-connections: 4 residual streams mixed by Sinkhorn-normalised matrices.

Shapes: the stream state is x_bthd [B, T, hc, D] (hc = 4 copies). All mixing math is fp32 and row-local.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mixes(x_bthd: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, norm_eps: float,
          hc_eps: float, sinkhorn_iters: int, unroll: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(pre [B,T,hc], post [B,T,hc], comb [B,T,hc,hc]) from the flattened stream (stream-major columns).

    unroll: the Sinkhorn rounds unrolled (no while loop; ``Numerics.sinkhorn_unroll``)."""
    b, t, hc, d = x_bthd.shape
    f = x_bthd.astype(jnp.float32).reshape(b, t, hc * d)
    m = jnp.einsum("btk,mk->btm", f, fn, precision=jax.lax.Precision.HIGHEST)
    m = m * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + norm_eps)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(b, t, hc, hc)
    comb = jax.nn.softmax(logits, axis=-1) + hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + hc_eps)

    def sinkhorn_round(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    # By default a loop rather than unrolled rounds: same arithmetic, a much smaller graph to compile.
    comb = jax.lax.fori_loop(0, sinkhorn_iters - 1, sinkhorn_round, comb, unroll=True if unroll else 1)
    return pre, post, comb


def pre_apply(x_bthd: jax.Array, pre_bth: jax.Array, out_dtype) -> jax.Array:
    """Collapse the streams: sum_c pre_c x_c (fp32 sum)."""
    return jnp.einsum("bthd,bth->btd", x_bthd.astype(jnp.float32), pre_bth,
                      precision=jax.lax.Precision.HIGHEST).astype(out_dtype)


def post_apply(y_btd: jax.Array, x_bthd: jax.Array, post_bth: jax.Array, comb_bthk: jax.Array, out_dtype) -> jax.Array:
    """Expand: new_k = post_k y + sum_j comb[j, k] x_j (the j sum in stream order, fp32).

    Written as hc multiply-adds rather than an einsum: XLA made the einsum a batched GEMM of [hc, D] x
    [hc, hc] per token (~0.2 ms a call at a 2048-token chunk on the H200) plus a separate add (1.2 ms in
    80 of the 32k prefill's 384 calls; 2026-12-04 trace), for what is one elementwise pass."""
    x = x_bthd.astype(jnp.float32)
    mixed = x[:, :, :1] * comb_bthk[:, :, 0, :, None]
    for j in range(1, x.shape[2]):
        mixed = mixed + x[:, :, j:j + 1] * comb_bthk[:, :, j, :, None]
    return (post_bth[..., None] * y_btd.astype(jnp.float32)[:, :, None, :] + mixed).astype(out_dtype)
