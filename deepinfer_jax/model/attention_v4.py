"""V4-Flash's compressed part of one layer's attention (spec §3.2): what ``attention.attention`` reads
besides the window, for a layer that is its own KV source (V4 has no cross-layer sharing).

* ratio 4 (CSA): overlapping compressor -> compressed KV; the indexer's own overlapping compressor ->
  index-K (RoPE, Hadamard rotation, FP4); index queries from qr (RoPE, Hadamard, FP4); top-k of
  sum_h w_h relu(q_h . k) over the visible entries.
* ratio 128 (HCA): non-overlapping compressor -> compressed KV; no indexer: every visible entry is read.
Visibility is the V4.1 rule: entry j (tokens j*r .. j*r + r - 1) is visible at position p iff j < (p+1) // r.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import LayerPlan, ModelConfig
from deepinfer_jax.model import compressor_v4, hadamard, indexer, kv_codec
from deepinfer_jax.model.linear import plain_linear, quant_linear
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp4_pow2
from deepinfer_jax.model.rope import apply_rope
from deepinfer_jax.model.v4_quant import fake_quant_kv_v4


def compressed_inputs(p: dict, cfg: ModelConfig, plan: LayerPlan, x_btd: jax.Array, qr_btr: jax.Array,
                      pos_bt: jax.Array, source_caches: dict, inv_freq, numerics: Numerics):
    """-> (compressed-KV storage [B, N, head_dim], selected entries idx [B, T, K] (-1 = none), new source caches)."""
    b, t, _ = x_btd.shape
    dt, eps, r = numerics.dtype, cfg.rms_norm_eps, plan.ratio
    kvq, lay = numerics.kv_quant, kv_codec.layouts(cfg)
    key = f"layer_{plan.layer_id}"
    src = dict(source_caches[key])
    rows = jnp.arange(b)[:, None]
    key_pos = (jnp.maximum(pos_bt, 0) // r) * r  # an entry's RoPE position: its window's first token

    latent, emits, state = compressor_v4.compress(p["compressor"], x_btd, pos_bt, r, plan.overlap, src, eps=eps,
                                                  numerics=numerics)
    src.update(state)
    ckv = apply_rope(latent, key_pos, inv_freq)
    if numerics.fake_quant and cfg.kv_fp8_rounding:
        ckv = fake_quant_kv_v4(ckv, cfg.qk_rope_head_dim)
    n_entries = src["kv"]["values"].shape[1]
    j_write = jnp.where(emits, pos_bt // r, n_entries)  # out of range -> dropped
    src["kv"] = kv_codec.scatter(src["kv"], rows, j_write, kv_codec.encode(lay.compressed, ckv, kvq, dt))

    visible_n = indexer.visible_entries(pos_bt, r)  # [B, T] entries a row may read
    if not plan.has_indexer:
        entries = jnp.arange(n_entries, dtype=jnp.int32)
        idx = jnp.where(entries[None, None, :] < visible_n[..., None], entries, -1)
        return src["kv"], idx, {**source_caches, key: src}

    pi = p["indexer"]
    ilat, iemits, istate = compressor_v4.compress(pi["compressor"], x_btd, pos_bt, r, plan.overlap, src, eps=eps,
                                                  numerics=numerics, prefix="idx_")
    src.update(istate)
    ik = hadamard.rotate(apply_rope(ilat, key_pos, inv_freq))
    if numerics.fake_quant:
        ik = fake_quant_fp4_pow2(ik)
    ij_write = jnp.where(iemits, pos_bt // r, n_entries)
    src["index_k"] = kv_codec.scatter(src["index_k"], rows, ij_write,
                                      kv_codec.encode(lay.index_k, ik, kvq, dt))

    hi, di = cfg.index_n_heads, cfg.index_head_dim
    iq = quant_linear(qr_btr, pi["wq_b"], numerics, act_block=cfg.act_quant_block).reshape(b, t, hi, di)
    iq = hadamard.rotate(apply_rope(iq, pos_bt[..., None], inv_freq))
    if numerics.fake_quant:
        iq = fake_quant_fp4_pow2(iq)
    w = plain_linear(x_btd, pi["weights_proj"], numerics, jnp.float32) * (di ** -0.5 * hi ** -0.5)
    index_k = kv_codec.decode(lay.index_k, src["index_k"], jnp.float32)
    dots = jnp.einsum("bthd,bsd->bths", iq.astype(jnp.float32), index_k, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.einsum("bths,bth->bts", jax.nn.relu(dots), w, precision=jax.lax.Precision.HIGHEST)
    visible = jnp.arange(n_entries)[None, None, :] < visible_n[..., None]
    idx = indexer.select(jnp.where(visible, scores, -jnp.inf), cfg.index_topk, numerics,
                         live=jnp.max(visible_n))
    return src["kv"], idx, {**source_caches, key: src}
