"""The sparse indexer: index keys, scores over visible compressed entries, the candidate pool, top-k."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model import kv_codec
from deepinfer_jax.model.linear import plain_linear, quant_linear
from deepinfer_jax.model.numerics import Numerics, fake_quant_fp4_pow2, kernel_route
from deepinfer_jax.model.rope import apply_rope
from pallas_kernels.indexer import (IndexScoresConfig, decode_unsupported_reason, index_scores as index_scores_op,
                                    index_scores_xla, kernel_unsupported_reason)
from pallas_kernels.indexer.config import QUERY_ROWS
from pallas_kernels.registry import AUTO, PALLAS_MOSAIC_GPU, XLA
from pallas_kernels.topk import topk_indices
from pallas_kernels.topk.select import top_mask


def index_keys(p: dict, latent_btd: jax.Array, key_pos_bt: jax.Array, inv_freq, *, eps: float,
               numerics: Numerics) -> jax.Array:
    from deepinfer_jax.model.norms import rms_norm

    k = rms_norm(plain_linear(latent_btd, p["wk"], numerics), p["k_norm"]["weight"], eps, numerics.dtype)
    k = apply_rope(k, key_pos_bt, inv_freq)
    return fake_quant_fp4_pow2(k) if numerics.fake_quant else k


def index_scores(p: dict, cfg: ModelConfig, x_btd: jax.Array, qr_btr: jax.Array, pos_bt: jax.Array,
                 index_k: jax.Array | dict, ratio: int, inv_freq, numerics: Numerics) -> jax.Array:
    """I[b, t, s] = sum_h w[t, h] relu(iq[t, h] . K[s]); -inf where entry s is not yet visible.

    index_k: the keys K [B, S, D], or the index cache as stored (a ``kv_codec`` storage dict in the
    ``kv_codec.INDEX_K`` layout): a decode step on the decode kernel's FP4 form
    (``Numerics.decode_index_fp4``) then reads it as stored; every other path decodes it first."""
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
    iq = iq.astype(op_dtype)
    n_visible = visible_entries(pos_bt, ratio)
    # The kernel serves prefill chunks of fake-quantized values; exact fp32 numerics always score here,
    # whatever Numerics.kernels says, and decode steps (T = 1) too unless Numerics.decode_index_kernel
    # (the op's decode kernel: untimed, other rounding than XLA's head sum).
    route, impl = "model", None
    decode = t == 1 and numerics.decode_index_kernel
    config = IndexScoresConfig(decode_tiles=numerics.decode_index_tiles)
    if numerics.fake_quant and (t >= QUERY_ROWS or decode):
        route, impl = kernel_route(numerics, "indexer", "index_scores",
                                   decode_unsupported_reason(hi, di) if decode
                                   else kernel_unsupported_reason(hi, di, config))
    # Every route writes -inf past each query's visible entries itself: a mask here would be one more
    # pass over [T, S] float32 scores that XLA writes out as the top-k's conditional operand (2.1 GB a
    # ratio-1 layer-chunk at chunk 16384; benchmarks/NOTES.md item -35).
    stored = index_k if isinstance(index_k, dict) else None
    if (decode and numerics.decode_index_fp4 and impl in ("interpret", PALLAS_MOSAIC_GPU) and stored is not None
            and "scale" in stored):
        return _decode_scores_fp4(iq, stored, w, n_visible, impl)
    keys = (index_k if stored is None else kv_codec.decode(kv_codec.INDEX_K, stored, op_dtype)).astype(op_dtype)
    if route == "model":
        return index_scores_xla(iq, keys, w, n_visible)
    if impl == "interpret":
        from pallas_kernels.indexer import index_scores_pallas    # (the decode kernel at T = 1)
        from pallas_kernels.interpret import gpu_interpreter

        with gpu_interpreter():
            return index_scores_pallas(iq, keys, w, n_visible, config=config)
    return index_scores_op(iq, keys, w, n_visible, impl=impl, selection=AUTO, config=config)


def _decode_scores_fp4(iq_bthd: jax.Array, stored: dict, w_bth: jax.Array, n_visible_bt: jax.Array,
                       impl: str) -> jax.Array:
    """A decode step's scores [B, 1, S] on the decode kernel's FP4 form, over the cache as stored."""
    from pallas_kernels.indexer.decode_fp4 import index_scores_decode_fp4_pallas

    from pallas_kernels.interpret import gpu_interpreter

    with gpu_interpreter() if impl == "interpret" else contextlib.nullcontext():
        return index_scores_decode_fp4_pallas(iq_bthd[:, 0], stored["values"], stored["scale"], w_bth[:, 0],
                                              n_visible_bt[:, 0])[:, None]


def candidate_mask(scores_bts: jax.Array, pos_bt: jax.Array, ratio: int, block: int, n_blocks: int) -> jax.Array:
    """Positions inside the top ``n_blocks`` reachable blocks (block max score; the newest block pinned)."""
    b, t, s = scores_bts.shape
    nb = -(-s // block)
    padded = jnp.pad(scores_bts, ((0, 0), (0, 0), (0, nb * block - s)), constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(b, t, nb, block), axis=-1)
    newest = (pos_bt + 1) // ratio - 1
    pinned = (jnp.arange(nb)[None, None, :] == (newest // block)[..., None]) & (newest >= 0)[..., None]
    block_scores = jnp.where(pinned, jnp.inf, block_scores)
    # The bisection's mask, not a sort: the same blocks as a stable descending sort's first n_blocks
    # (less -inf), where the sort of [16384, 4098] block maxima and the scatter of its picks took 4.4 and
    # 1.1 ms a chunk-16384 call on the H100 (session 32 prefill trace).
    keep = top_mask(block_scores, min(n_blocks, nb))
    return jnp.repeat(keep, block, axis=-1)[..., :s]


# A prefill chunk's top-k runs on the first LIVE_WIDTH_BUCKETS-th, 2/LIVE_WIDTH_BUCKETS-th, ... of the
# entries, the narrowest that holds every visible one (``select``'s ``live``).
LIVE_WIDTH_BUCKETS = 4


def live_widths(s: int, k: int, buckets: int = LIVE_WIDTH_BUCKETS, align: int = 256) -> tuple[int, ...]:
    """The widths ``select`` may cut S entries to: S * i / buckets rounded up to ``align``, at least k,
    ascending and distinct, the last S."""
    cuts = {min(s, max(k, -(-s * i // buckets // align) * align)) for i in range(1, buckets)}
    return tuple(sorted(cuts | {s}))


def select(scores_bts: jax.Array, k: int, numerics: Numerics, live: jax.Array | None = None) -> jax.Array:
    """idx [B, T, min(k, S)]: each row's top-k entries in ascending order, -1 = none
    (``pallas_kernels.topk.topk_indices``).

    live: optional int32 scalar, a bound on the entries any row can reach: every score from column
    ``live`` on is -inf in every row (the batch's most visible entries). A prefill chunk (T > 1) then
    selects from the narrowest of ``live_widths`` that holds them. The picks are an exact function of
    each row and the cut-off columns are unreachable, so every width gives the same result, bit for bit,
    whatever the other rows are (tests/test_topk.py). Why: the bisection's 16 passes read the whole
    row, and at a 32k prompt's early chunks most of a ratio-1 layer's 32k index entries are not yet
    visible; at chunk 8192 the average width falls to ~63 % of S, at chunk 16384 to ~75 %."""
    # No Pallas top-k: only "xla" has a path to force; otherwise the registry picks (numerics.py).
    impl = XLA if numerics.kernel_mode("indexer") == "xla" else None
    s = scores_bts.shape[-1]
    kk = min(k, s)   # a row shorter than k keeps S columns (the op would pad to k with -1s the attention would read)
    widths = live_widths(s, kk)
    # decode steps keep one width and no candidate list: a conditional there would cut the step's CUDA graph
    prefill = scores_bts.shape[1] > 1
    if live is None or not prefill or len(widths) == 1:
        return topk_indices(scores_bts, kk, impl=impl, selection=AUTO, may_branch=prefill)
    branches = [lambda sc, w=w: topk_indices(sc, kk, impl=impl, selection=AUTO, width=w, may_branch=True)
                for w in widths]
    which = jnp.sum(jnp.asarray(live, jnp.int32) > jnp.asarray(widths[:-1], jnp.int32))
    return jax.lax.switch(which, branches, scores_bts)


def visible_entries(pos_bt: jax.Array, ratio: int) -> jax.Array:
    """[B, T] -> [B, T]: the compressed entries (ratio ``ratio``) a query at each position may read; 0 for
    padding (position -1)."""
    return jnp.where(pos_bt >= 0, (pos_bt + 1) // ratio, 0)


def live_entries(pos_bt: jax.Array, ratio: int) -> jax.Array:
    """The most entries any row of the batch sees (``select``'s ``live``)."""
    return jnp.max(visible_entries(pos_bt, ratio))
