"""V4.1 compressors: ratio-2 pair pooling (per-channel softmax gate) and the ratio-1 per-token latent.

Groups are aligned to absolute positions: pair j = tokens (2j, 2j+1). A pair is emitted by the row of
its second token; when that token's partner arrived in an earlier step, the partner comes from the fp32
pending state carried in the cache, so chunking never changes what a group pools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.linear import plain_linear
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.numerics import Numerics


def compress(p: dict, x_btd: jax.Array, pos_bt: jax.Array, ratio: int, state: dict, *, eps: float,
             numerics: Numerics) -> tuple[jax.Array, jax.Array, dict]:
    """-> (latent_btd pre-RoPE, emits_bt bool, new pending state). Row t emits group pos_t // ratio."""
    valid = pos_bt >= 0
    if ratio == 1:
        latent = rms_norm(plain_linear(x_btd, p["wkv"], numerics), p["norm"]["weight"], eps, numerics.dtype)
        return latent, valid, state
    if ratio != 2:
        raise NotImplementedError(f"V4.1 compressor ratio {ratio}")
    k = plain_linear(x_btd, p["wkv"], numerics, jnp.float32, compute_dtype=jnp.float32)
    s = plain_linear(x_btd, p["wgate"], numerics, jnp.float32, compute_dtype=jnp.float32)
    # Rows are contiguous in position, so the partner of row t is row t-1, or the pending token for t = 0.
    prev_k = jnp.concatenate([state["pend_kv"][:, None], k[:, :-1]], axis=1)
    prev_s = jnp.concatenate([state["pend_score"][:, None], s[:, :-1]], axis=1)
    gate = jax.nn.softmax(jnp.stack([prev_s, s], axis=-1), axis=-1)
    pooled = gate[..., 0] * prev_k + gate[..., 1] * k
    latent = rms_norm(pooled, p["norm"]["weight"], eps, numerics.dtype)
    emits = valid & (pos_bt % 2 == 1)
    # The new pending token is the last valid row if it opens a pair.
    last = jnp.argmax(jnp.where(valid, pos_bt, -1), axis=1)
    last_pos = jnp.max(jnp.where(valid, pos_bt, -1), axis=1)
    take = (last_pos >= 0) & (last_pos % 2 == 0)
    rows = jnp.arange(x_btd.shape[0])
    new_state = {
        "pend_kv": jnp.where(take[:, None], k[rows, last], state["pend_kv"]),
        "pend_score": jnp.where(take[:, None], s[rows, last], state["pend_score"]),
    }
    return latent, emits, new_state
