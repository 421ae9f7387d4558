"""The sparse indexer: index keys, scores over visible compressed entries, the candidate pool, top-k."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.linear import plain_linear, quant_linear
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp4_pow2
from deepinfer_jax.model.rope import apply_rope
from deepinfer_jax.model.selection import topk_desc, topk_positions

INDEX_KEY_BLOCK = 4096   # index keys scored per block (see index_scores)


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
    # Fake-quantized iq and K are E2M1 values times power-of-two scales: exact in bf16, and a bf16 x bf16
    # product is exact in fp32. So bf16 operands with fp32 accumulation give the fp32 products on the
    # tensor cores; fp32 operands ran on the GPU's fp32 units at 1/15 the rate (855 of 5,328 ms of a
    # 32k prefill on the H200, benchmarks/NOTES.md). Unquantized (exact) numerics keep fp32 operands.
    op_dtype = jnp.bfloat16 if numerics.fake_quant else jnp.float32
    iq, keys = iq.astype(op_dtype), index_k_bsd.astype(op_dtype)
    # The per-head dots [B, T, H, S] are materialized in fp32 before the relu and the head sum: 8 GiB at
    # a 2048-token chunk over 32k keys, which ran the H200 out of memory. Key blocks bound it; each
    # score is still the sum over its own heads, so blocking changes no row's inputs.
    parts = []
    for s0 in range(0, keys.shape[1], INDEX_KEY_BLOCK):
        dots = jnp.einsum("bthd,bsd->bths", iq, keys[:, s0:s0 + INDEX_KEY_BLOCK],
                          precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        parts.append(jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w, precision=jax.lax.Precision.HIGHEST))
    scores = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
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
