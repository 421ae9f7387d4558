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
