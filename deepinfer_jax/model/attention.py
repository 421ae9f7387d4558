"""CSA2 attention for one layer: queries, the SWA ring, compressed KV (own or reused), sinks, output.

Every layer has its own queries, window KV and output projection; what differs by role (LayerPlan) is
where the compressed KV and the top-k come from. The per-step hand-offs between layers (a source's
caches, its selection, the candidate mask) travel in ``published``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.config import AttnMode, LayerPlan, ModelConfig
from deepinfer_jax.model import attention_v4, compressor, dense_fp8, indexer, kv_codec
from deepinfer_jax.model.linear import grouped_dense, quant_linear, weight_of
from deepinfer_jax.model.norms import rms_norm
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp4_e4m3, fake_quant_fp8, kernel_route
from deepinfer_jax.model.rope import apply_rope, rope_inv_freq
from deepinfer_jax.model.v4_quant import fake_quant_kv_v4
from deepinfer_jax.model.window import chunk_window_index, window_index, window_keys, window_update
from pallas_kernels.registry import PALLAS_MOSAIC_GPU


def sink_attention(q_bthd: jax.Array, win_k_bwd: jax.Array, win_mask_btw: jax.Array, comp_kv: dict | None,
                   idx_btk: jax.Array | None, sink_h: jax.Array, scale: float, precision,
                   comp_layout: kv_codec.Layout = kv_codec.COMPRESSED) -> jax.Array:
    """Softmax over window keys and selected compressed keys, with a per-head sink in the denominator.

    comp_kv: the compressed-KV storage (kv_codec, in comp_layout); only the selected rows are read and decoded."""
    qf = q_bthd.astype(jnp.float32)
    z_w = jnp.einsum("bthd,bwd->bthw", qf, win_k_bwd.astype(jnp.float32), precision=precision) * scale
    z_w = jnp.where(win_mask_btw[:, :, None, :], z_w, -jnp.inf)
    parts_z = [z_w]
    if idx_btk is not None:
        b = q_bthd.shape[0]
        rows = kv_codec.gather(comp_kv, jnp.arange(b)[:, None, None], jnp.maximum(idx_btk, 0))
        sel = kv_codec.decode(comp_layout, rows, jnp.float32)  # [B, T, K, D]
        z_c = jnp.einsum("bthd,btkd->bthk", qf, sel, precision=precision) * scale
        z_c = jnp.where((idx_btk >= 0)[:, :, None, :], z_c, -jnp.inf)
        parts_z.append(z_c)
    z = jnp.concatenate(parts_z, axis=-1)
    sink = sink_h.astype(jnp.float32)[None, None, :]
    m = jnp.maximum(jnp.max(z, axis=-1), sink)
    e = jnp.exp(z - m[..., None])
    denom = jnp.sum(e, axis=-1) + jnp.exp(sink - m)
    n_w = z_w.shape[-1]
    o = jnp.einsum("bthw,bwd->bthd", e[..., :n_w], win_k_bwd.astype(jnp.float32), precision=precision)
    if idx_btk is not None:
        o = o + jnp.einsum("bthk,btkd->bthd", e[..., n_w:], sel, precision=precision)
    return o / denom[..., None]


def sparse_inputs(win_k_bwd: jax.Array, win_mask_btw: jax.Array, comp_kv: dict | None, idx_btk: jax.Array | None,
                  dtype, comp_layout: kv_codec.Layout = kv_codec.COMPRESSED,
                  window: int | None = None, win_idx_btw: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The window keys and the compressed KV as one ``sparse_sink_attention`` problem: kv [B, W+T(+N), D]
    (window rows first) and idx [B, T, window(+K)] (each query's visible window rows, ``window_index``,
    then the selection offset by W+T). window: the most window keys a query sees (None: W+T, no
    compaction). win_idx_btw: those window rows when the caller has them (``chunk_window_index``)."""
    n_w = win_mask_btw.shape[-1]
    idx_w = win_idx_btw if win_idx_btw is not None else window_index(win_mask_btw, n_w if window is None else window)
    kv = win_k_bwd.astype(dtype)
    if idx_btk is None:
        return kv, idx_w
    comp = kv_codec.decode(comp_layout, comp_kv, dtype)
    idx_c = jnp.where(idx_btk >= 0, idx_btk.astype(jnp.int32) + n_w, -1)
    return jnp.concatenate([kv, comp], axis=1), jnp.concatenate([idx_w, idx_c], axis=-1)


def gathered_inputs(win_k_bwd: jax.Array, win_idx_btw: jax.Array, comp_kv: dict, idx_btk: jax.Array, dtype,
                    comp_layout: kv_codec.Layout = kv_codec.COMPRESSED) -> tuple[jax.Array, jax.Array]:
    """``sparse_inputs``' problem with only the selected compressed rows decoded: kv [B, W+T + T*K, D]
    (the window rows, then each query's K selected rows in selection order) and idx [B, T, Kw + K]
    (its visible window columns, then its own K rows; -1 where the selection is). Every query meets the
    same row values in the same order as from ``sparse_inputs``, so a kernel gives the same bits."""
    b, t, k = idx_btk.shape
    rows = kv_codec.gather(comp_kv, jnp.arange(b)[:, None, None], jnp.maximum(idx_btk, 0))
    sel = kv_codec.decode(comp_layout, rows, dtype)                          # [B, T, K, D]
    n_w = win_k_bwd.shape[1]
    own = n_w + jnp.arange(t, dtype=jnp.int32)[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None, :]
    idx_c = jnp.where(idx_btk >= 0, own[None], -1)
    kv = jnp.concatenate([win_k_bwd.astype(dtype), sel.reshape(b, t * k, sel.shape[-1])], axis=1)
    return kv, jnp.concatenate([win_idx_btw.astype(jnp.int32), idx_c], axis=-1)


def _route(numerics: Numerics, dtype, h: int, d: int, config, fp4: bool) -> tuple[str, str | None]:
    """``kernel_route`` of the attention op (fp4: its FP4 variant) for these static shapes."""
    from pallas_kernels import attention as pk_attn

    why = pk_attn.kernel_unsupported_reason(h, d, config, fp4=fp4)
    if why is None and dtype != jnp.bfloat16:
        why = f"the kernel takes bf16 q and kv, not {dtype}"
    return kernel_route(numerics, "attention", "sparse_sink_attention_fp4" if fp4 else "sparse_sink_attention", why)


def attention_core(q_bthd: jax.Array, win_k_bwd: jax.Array, win_mask_btw: jax.Array, comp_kv: dict | None,
                   idx_btk: jax.Array | None, sink_h: jax.Array, scale: float, numerics: Numerics,
                   comp_layout: kv_codec.Layout = kv_codec.COMPRESSED,
                   win_idx_btw: jax.Array | None = None) -> jax.Array:
    """``sink_attention`` on the implementation ``numerics.kernels`` picks (numerics.py): the model's
    float32 code, or ``pallas_kernels.attention.sparse_sink_attention`` (the Mosaic GPU kernel on Hopper,
    its XLA fallback elsewhere). With V4.1's quantized compressed cache the op is its FP4 variant,
    ``sparse_sink_attention_fp4``, which reads the selected rows as stored instead of a bf16 copy of the
    whole cache. The choice depends on the platform, the mode and static shapes only.

    win_idx_btw: each query's visible window columns ``window_index(win_mask_btw, W)`` would give, when the
    caller has them without the mask (``chunk_window_index``); the kernel routes take them from here."""
    from pallas_kernels import attention as pk_attn

    h, d = q_bthd.shape[-2:]
    ring = win_k_bwd.shape[1] - q_bthd.shape[1]   # window_keys' keys: the ring W, then the chunk's T rows
    config = pk_attn.SparseAttentionConfig(split_rows=numerics.attention_split_rows, pdl=numerics.kernel_pdl)
    # (the Mosaic GPU interpreter hangs on the FP4 variant: under "interpret" the decoded path runs)
    fp4 = (idx_btk is not None and comp_layout == kv_codec.COMPRESSED and "scale" in comp_kv
           and numerics.kernel_mode("attention") != "interpret")
    route, impl = _route(numerics, q_bthd.dtype, h, d, config, fp4)
    gathered = False
    if fp4 and impl == PALLAS_MOSAIC_GPU and numerics.attention_fp4_rows in ("never", "gather"):
        # the bf16 kernel on the decoded cache or on the decoded selected rows (Numerics.attention_fp4_rows);
        # the XLA routes above keep reading only the selected rows
        fp4, gathered = False, numerics.attention_fp4_rows == "gather"
        route, impl = _route(numerics, q_bthd.dtype, h, d, config, fp4)
    if not fp4 and numerics.kernel_attention_schedule() != "halves":
        # p.kv accumulated in place: ptxas spills 200 B a consumer thread, 720 B with a fresh accumulator
        # a 128-column chunk (benchmarks/NOTES.md item -33; GPU only, as the seesaw's cp.async rows are)
        config = dataclasses.replace(config, schedule=numerics.kernel_attention_schedule(), pv_cols=256,
                                     pv_in_place=True)
        route, impl = _route(numerics, q_bthd.dtype, h, d, config, fp4)
    if route == "model":
        return sink_attention(q_bthd, win_k_bwd, win_mask_btw, comp_kv, idx_btk, sink_h, scale, numerics.precision,
                              comp_layout)
    if win_idx_btw is None:
        win_idx_btw = window_index(win_mask_btw, ring)
    if fp4:
        return pk_attn.sparse_sink_attention_fp4(q_bthd, win_k_bwd.astype(q_bthd.dtype),
                                                 win_idx_btw, comp_kv["values"],
                                                 comp_kv["scale"], idx_btk.astype(jnp.int32), sink_h, scale,
                                                 config=config, impl=impl)
    if gathered:
        kv_bsd, idx = gathered_inputs(win_k_bwd, win_idx_btw, comp_kv, idx_btk, q_bthd.dtype, comp_layout)
    else:
        kv_bsd, idx = sparse_inputs(win_k_bwd, win_mask_btw, comp_kv, idx_btk, q_bthd.dtype, comp_layout, ring,
                                    win_idx_btw)
    if impl == "interpret":
        from pallas_kernels.attention.config import BLOCK_ROWS
        from pallas_kernels.attention.kernel import sparse_sink_attention_pallas
        from pallas_kernels.interpret import gpu_interpreter

        # One split of the fewest 64-row blocks (the interpreter is slow; splits change only the
        # summation order, which the kernel tests cover).
        config = pk_attn.SparseAttentionConfig(split_rows=-(-idx.shape[-1] // BLOCK_ROWS) * BLOCK_ROWS)
        with gpu_interpreter():
            return sparse_sink_attention_pallas(q_bthd, kv_bsd, idx, sink_h, scale, config)
    return pk_attn.sparse_sink_attention(q_bthd, kv_bsd, idx, sink_h, scale, config=config, impl=impl)


def _compress_into(p: dict, cfg: ModelConfig, plan: LayerPlan, x_btd: jax.Array, pos_bt: jax.Array, src: dict,
                   inv_freq: jax.Array, numerics: Numerics) -> dict:
    """A KV-source layer's compressor: the entries its rows complete, written into its source cache ->
    the new cache (compressed KV, index keys, pending partial blocks)."""
    dt, kvq, eps = numerics.dtype, numerics.kv_quant, cfg.rms_norm_eps
    lay = kv_codec.layouts(cfg)
    src = dict(src)
    latent, emits, pend = compressor.compress(p["compressor"], x_btd, pos_bt, plan.ratio,
                                              {k: src[k] for k in ("pend_kv", "pend_score") if k in src},
                                              eps=eps, numerics=numerics)
    src.update(pend)
    j = pos_bt // plan.ratio
    key_pos = j * plan.ratio
    ik = indexer.index_keys(p["indexer"], latent, key_pos, inv_freq, eps=eps, numerics=numerics)
    ckv = apply_rope(latent, key_pos, inv_freq)
    if numerics.fake_quant:
        ckv = fake_quant_fp4_e4m3(ckv)
    n_entries = src["kv"]["values"].shape[1]
    # A row emits the entry its position completes (pos // ratio, once per entry), and every other row
    # gets its own out-of-range index (dropped): unique, so XLA writes in parallel. The non-unique form
    # (all dropped rows at n_entries) took 0.9 ms a layer-chunk for the index keys' 1-byte scales alone
    # in the H200's prefill at chunk 8192 (session 24 trace).
    j_write = jnp.where(emits, j, n_entries + jnp.arange(x_btd.shape[1], dtype=j.dtype))
    rows = jnp.arange(x_btd.shape[0])[:, None]
    src["kv"] = kv_codec.scatter(src["kv"], rows, j_write, kv_codec.encode(lay.compressed, ckv, kvq, dt), unique=True)
    src["index_k"] = kv_codec.scatter(src["index_k"], rows, j_write, kv_codec.encode(lay.index_k, ik, kvq, dt),
                                      unique=True)
    return src


def _select(p: dict, cfg: ModelConfig, plan: LayerPlan, x_btd: jax.Array, qr: jax.Array, pos_bt: jax.Array,
            src: dict, published: dict, inv_freq: jax.Array, numerics: Numerics) -> jax.Array:
    """The indexer of a layer with its own index query: scores over the source's index keys, the
    candidate mask it publishes or obeys, top-k -> idx [B, T, index_topk] (also published)."""
    # (the cache as stored: the indexer decodes it, or its decode kernel's FP4 form reads it so)
    scores = indexer.index_scores(p["indexer"], cfg, x_btd, qr, pos_bt, src["index_k"], plan.ratio, inv_freq,
                                  numerics)
    if plan.is_candidate_source:
        published["candidate_mask"] = indexer.candidate_mask(
            scores, pos_bt, plan.ratio, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    if plan.uses_candidate_mask:
        scores = jnp.where(published["candidate_mask"], scores, -jnp.inf)
    idx = indexer.select(scores, cfg.index_topk, numerics, live=indexer.live_entries(pos_bt, plan.ratio))
    published[f"topk_{plan.layer_id}"] = idx
    return idx


def attention(p: dict, cfg: ModelConfig, plan: LayerPlan, x_btd: jax.Array, pos_bt: jax.Array, layer_cache: dict,
              source_caches: dict, published: dict, numerics: Numerics) -> tuple[jax.Array, dict, dict]:
    """-> (out_btd, new window cache, updated source caches). ``published`` is updated in place."""
    b, t, _ = x_btd.shape
    h, hd = cfg.num_attention_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    inv_freq = rope_inv_freq(plan.rope, cfg.qk_rope_head_dim)
    dt = numerics.dtype

    ab = cfg.act_quant_block
    qr = rms_norm(quant_linear(x_btd, p["wq_a"], numerics, act_block=ab), p["q_norm"]["weight"], eps, dt)
    q = quant_linear(qr, p["wq_b"], numerics, act_block=ab).reshape(b, t, h, hd)
    if cfg.per_head_q_norm:  # V4: unweighted RMS norm of each head (V4.1 has none)
        q = rms_norm(q, None, eps, dt)
    # (decode: concatenated, which XLA fuses with the FP4 kernel's permutation of q, not the select;
    # prefill chunks: the rope columns updated in place, apply_rope says why)
    q = apply_rope(q, pos_bt[..., None], inv_freq, join="concatenate" if t == 1 else "update")

    kv = rms_norm(quant_linear(x_btd, p["wkv"], numerics, act_block=ab), p["kv_norm"]["weight"], eps, dt)
    kv = apply_rope(kv, pos_bt, inv_freq)
    if numerics.fake_quant and cfg.kv_fp8_rounding:
        kv = fake_quant_kv_v4(kv, cfg.qk_rope_head_dim) if cfg.variant == "v4" else fake_quant_fp8(kv)
    kvq = numerics.kv_quant
    lay = kv_codec.layouts(cfg)
    ring = kv_codec.decode(lay.window, layer_cache["kv"], dt)
    win_k, win_mask = window_keys(ring, layer_cache["pos"], kv, pos_bt, cfg.sliding_window)
    # (the kernel routes take the visible window columns computed without the [B, T, W+T] mask)
    win_idx = chunk_window_index(layer_cache["pos"], pos_bt, cfg.sliding_window, layer_cache["pos"].shape[1])
    new_ring, new_pos = window_update(layer_cache["kv"], layer_cache["pos"],
                                      kv_codec.encode(lay.window, kv, kvq, dt), pos_bt)
    new_win = {"kv": new_ring, "pos": new_pos}

    idx = None
    comp_kv = None
    if plan.mode is not AttnMode.SWA and cfg.variant == "v4":  # every compressed layer is its own source
        comp_kv, idx, source_caches = attention_v4.compressed_inputs(p, cfg, plan, x_btd, qr, pos_bt, source_caches,
                                                                     inv_freq, numerics)
    elif plan.mode is not AttnMode.SWA:
        key = f"layer_{plan.kv_source}"
        if plan.mode is AttnMode.FULL:
            with jax.named_scope("compressor"):
                source_caches = {**source_caches, key: _compress_into(p, cfg, plan, x_btd, pos_bt,
                                                                      source_caches[key], inv_freq, numerics)}
        src = source_caches[key]
        comp_kv = src["kv"]
        if plan.has_index_query:
            with jax.named_scope("indexer"):
                idx = _select(p, cfg, plan, x_btd, qr, pos_bt, src, published, inv_freq, numerics)
        else:
            idx = published[f"topk_{plan.index_source}"]

    with jax.named_scope("core"):
        o = attention_core(q, win_k, win_mask, comp_kv, idx, p["attn_sink"], hd ** -0.5, numerics, lay.compressed,
                           win_idx)
    o = apply_rope(o.astype(dt), pos_bt[..., None], inv_freq, inverse=True, join="select" if t == 1 else "update")
    g = cfg.o_groups
    o_g = o.reshape(b, t, g, cfg.heads_per_group * hd)
    # (no activation quantizer in front of wo_a: on the dense kernel its bf16 operand form)
    impl = dense_fp8.kernel_impl(p["wo_a"], numerics, b * t, "bf16")
    if impl is not None:
        z = dense_fp8.kernel_matmul(o_g.reshape(b * t, g, -1), p["wo_a"], impl, "bf16",
                                    numerics.kernel_pdl).reshape(b, t, g, -1)
    else:
        wo_a = weight_of(p["wo_a"], dt).reshape(g, cfg.o_lora_rank, cfg.heads_per_group * hd)
        z = grouped_dense(o_g, wo_a, numerics, dt)
    z = z.astype(dt)
    out = quant_linear(z.reshape(b, t, g * cfg.o_lora_rank), p["wo_b"], numerics, act_block=ab)
    return out, new_win, source_caches
