"""XLA fallback for ``sparse_sink_attention``: gather the K selected rows, then two batched einsums.

Numerics match the Mosaic kernel: bf16 x bf16 products accumulated in float32 for q.kv, softmax in
float32, the probabilities rounded to the storage dtype for the p.kv product (accumulated in float32),
the division in float32. Every op is local to one (b, t) row, so inside one compiled shape a query's
output does not depend on its neighbours. Across batch sizes it is bitwise invariant on the CPU (tested),
but NOT on the H200: ``benchmarks/attention_gpu.py`` measured a probe query's bits changing between B=1
and B=2/3/8/64 (the batched einsums get shape-dependent GEMM algorithms). On the GPU use the kernel, or
run every step at one fixed shape.

Reads every selected row twice from the gathered copy (once per einsum) and writes the copy once:
about 3x the bytes of the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sparse_sink_attention_xla(q_bthd: jax.Array, kv_bsd: jax.Array, idx_btk: jax.Array, sink_h: jax.Array,
                              scale: float) -> jax.Array:
    """-> o_bthd in q's dtype. Same contract as ``pallas_kernels.attention.sparse_sink_attention``."""
    dt = q_bthd.dtype
    valid_btk = idx_btk >= 0
    rows_btkd = jnp.take_along_axis(kv_bsd[:, None], jnp.maximum(idx_btk, 0)[..., None], axis=2).astype(dt)
    z_bthk = jnp.einsum("bthd,btkd->bthk", q_bthd, rows_btkd, preferred_element_type=jnp.float32) * scale
    z_bthk = jnp.where(valid_btk[:, :, None, :], z_bthk, -jnp.inf)
    sink = sink_h.astype(jnp.float32)[None, None, :]
    m_bth = jnp.maximum(jnp.max(z_bthk, axis=-1), sink)
    e_bthk = jnp.exp(z_bthk - m_bth[..., None])
    denom_bth = jnp.sum(e_bthk, axis=-1) + jnp.exp(sink - m_bth)
    o_bthd = jnp.einsum("bthk,btkd->bthd", e_bthk.astype(dt), rows_btkd, preferred_element_type=jnp.float32)
    return (o_bthd / denom_bth[..., None]).astype(dt)


def fp4_rows(values_bnc: jax.Array, scale_bng: jax.Array, idx_btk: jax.Array, dtype) -> jax.Array:
    """The listed rows of an FP4 cache, dequantized: packed E2M1 [B, N, D/2] uint8 with one E4M3 scale
    per 16 values [B, N, D/16] -> [B, T, K, D] in dtype (exact in bf16). Entries < 0 read row 0."""
    from pallas_kernels.grouped_gemm.reference import unpack_fp4

    ix = jnp.maximum(idx_btk, 0)
    b = jnp.arange(values_bnc.shape[0])[:, None, None]
    vals = unpack_fp4(values_bnc[b, ix])                                  # [B, T, K, D] f32
    s = scale_bng[b, ix].astype(jnp.float32)                              # [B, T, K, D/16]
    d = vals.shape[-1]
    return (vals.reshape(*vals.shape[:-1], s.shape[-1], d // s.shape[-1]) * s[..., None]).reshape(vals.shape).astype(dtype)


def two_source_rows(win_kv_bsd: jax.Array, win_idx_btk: jax.Array, comp_values_bnc: jax.Array,
                    comp_scale_bng: jax.Array, comp_idx_btk: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Each query's listed window and compressed rows as one problem per query: kv [B*T, Kw+Kc, D] and
    idx [B*T, 1, Kw+Kc] (the row's own position, -1 where the entry is skipped)."""
    b, t, _ = win_idx_btk.shape
    win = jnp.take_along_axis(win_kv_bsd[:, None], jnp.maximum(win_idx_btk, 0)[..., None], axis=2).astype(dtype)
    comp = fp4_rows(comp_values_bnc, comp_scale_bng, comp_idx_btk, dtype)
    kv = jnp.concatenate([win, comp], axis=2)
    k = kv.shape[2]
    valid = jnp.concatenate([win_idx_btk, comp_idx_btk], axis=-1) >= 0
    idx = jnp.where(valid, jnp.arange(k, dtype=jnp.int32), -1)
    return kv.reshape(b * t, k, kv.shape[-1]), idx.reshape(b * t, 1, k)


def sparse_sink_attention_fp4_xla(q_bthd: jax.Array, win_kv_bsd: jax.Array, win_idx_btk: jax.Array,
                                  comp_values_bnc: jax.Array, comp_scale_bng: jax.Array, comp_idx_btk: jax.Array,
                                  sink_h: jax.Array, scale: float) -> jax.Array:
    """-> o_bthd in q's dtype; ``sparse_sink_attention_fp4``'s contract. Gathers and dequantizes only the
    listed compressed rows, then runs ``sparse_sink_attention_xla`` per query."""
    b, t, h, d = q_bthd.shape
    kv, idx = two_source_rows(win_kv_bsd, win_idx_btk, comp_values_bnc, comp_scale_bng, comp_idx_btk, q_bthd.dtype)
    o = sparse_sink_attention_xla(q_bthd.reshape(b * t, 1, h, d), kv, idx, sink_h, scale)
    return o.reshape(b, t, h, d)
