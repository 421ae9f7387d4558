"""The sparse indexer: index keys, scores over visible compressed entries, the candidate pool, top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.linear import plain_linear, quant_linear
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp4_pow2
from deepinfer_jax.model.rope import apply_rope
from deepinfer_jax.model.selection import topk_desc, topk_positions


def index_keys(p: dict, latent_btd: jax.Array, key_pos_bt: jax.Array, inv_freq, *, eps: float,
               numerics: Numerics) -> jax.Array:
    from deepinfer_jax.model.norms import rms_norm

    k = rms_norm(plain_linear(latent_btd, p["wk"], numerics), p["k_norm"]["weight"], eps, numerics.dtype)
    k = apply_rope(k, key_pos_bt, inv_freq)
    return fake_quant_fp4_pow2(k) if numerics.fake_quant else k


def index_scores(p: dict, cfg: ModelConfig, x_btd: jax.Array, qr_btr: jax.Array, pos_bt: jax.Array,
                 index_k_bsd: jax.Array, ratio: int, inv_freq, numerics: Numerics) -> jax.Array:
    """I[b, t, s] = sum_h w[t, h] relu(iq[t, h] . K[s]); -inf where entry s is not yet visible."""
    b, t, _ = x_btd.shape
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    iq = quant_linear(qr_btr, p["wq_b"], numerics, act_block=cfg.act_quant_block).reshape(b, t, hi, di)
    iq = apply_rope(iq, pos_bt[..., None], inv_freq)
    if numerics.fake_quant:
        iq = fake_quant_fp4_pow2(iq)
    w = plain_linear(x_btd, p["weights_proj"], numerics, jnp.float32) * (di ** -0.5 * hi ** -0.5)
    dots = jnp.einsum("bthd,bsd->bths", iq.astype(jnp.float32), index_k_bsd.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    scores = jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w, precision=jax.lax.Precision.HIGHEST)
    visible = jnp.arange(index_k_bsd.shape[1])[None, None, :] < ((pos_bt + 1) // ratio)[..., None]
    return jnp.where(visible & (pos_bt >= 0)[..., None], scores, -jnp.inf)


def candidate_mask(scores_bts: jax.Array, pos_bt: jax.Array, ratio: int, block: int, n_blocks: int) -> jax.Array:
    """Positions inside the top ``n_blocks`` reachable blocks (block max score; the newest block pinned)."""
    b, t, s = scores_bts.shape
    nb = -(-s // block)
    padded = jnp.pad(scores_bts, ((0, 0), (0, 0), (0, nb * block - s)), constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(b, t, nb, block), axis=-1)
    newest = (pos_bt + 1) // ratio - 1
    pinned = (jnp.arange(nb)[None, None, :] == (newest // block)[..., None]) & (newest >= 0)[..., None]
    block_scores = jnp.where(pinned, jnp.inf, block_scores)
    vals, idx = topk_desc(block_scores, min(n_blocks, nb))
    keep = jnp.zeros((b, t, nb), bool)
    keep = keep.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx].set(vals > -jnp.inf)
    return jnp.repeat(keep, block, axis=-1)[..., :s]


def select(scores_bts: jax.Array, k: int) -> jax.Array:
    return topk_positions(scores_bts, k)
