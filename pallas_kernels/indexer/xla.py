"""XLA path for ``index_scores``: bf16-operand dots with fp32 accumulation, in key blocks.

The per-head dots [B, T, H, S] are materialized in fp32 before the relu and the head sum (XLA fuses no
reduction into a GEMM); key blocks bound that buffer (8 GiB at a 2048-token chunk over 32k keys ran the
H200 out of memory). Each score is the sum over its own heads, so blocking changes no score's inputs;
XLA may order that fp32 sum differently per block shape. Batch-invariant within one compiled shape
(XLA's GEMMs change bits with M across shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Keys scored per block.
KEY_BLOCK = 4096


def index_scores_xla(q_bthd: jax.Array, k_bsd: jax.Array, w_bth: jax.Array, n_visible_bt: jax.Array | None = None, *,
                     key_block: int = KEY_BLOCK, config=None) -> jax.Array:
    """n_visible_bt: int [B, T] or None; keys at or past a query's count score -inf (in the head sum's
    fusion, so no pass of its own)."""
    del config   # the kernel's tiles; nothing to choose here
    hi = jax.lax.Precision.HIGHEST
    w = w_bth.astype(jnp.float32)
    parts = []
    for s0 in range(0, k_bsd.shape[1], key_block):
        dots = jnp.einsum("bthd,bsd->bths", q_bthd, k_bsd[:, s0:s0 + key_block], precision=hi,
                          preferred_element_type=jnp.float32)
        parts.append(jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w, precision=hi))
    scores = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return scores if n_visible_bt is None else mask_unseen(scores, n_visible_bt)


def mask_unseen(scores_bts: jax.Array, n_visible_bt: jax.Array) -> jax.Array:
    """-inf at keys s >= n_visible_bt[b, t] (the op's contract for every implementation)."""
    keys = jnp.arange(scores_bts.shape[-1], dtype=jnp.int32)
    return jnp.where(keys < n_visible_bt[..., None].astype(jnp.int32), scores_bts, -jnp.inf)
