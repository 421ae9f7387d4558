"""Indexer scores for DeepSeek-V4.1's sparse attention (the lightning indexer before top-k).

The op::

    index_scores(q_bthd, k_bsd, w_bth, n_visible_bt=None) -> scores_bts

* ``q_bthd`` [B, T, H, D] bf16 — index queries (V4.1: H = 32 or 64 heads of D = 128);
* ``k_bsd`` [B, S, D] bf16 — index keys, shared by the heads;
* ``w_bth`` f32 [B, T, H] — per-query head weights;
* ``n_visible_bt`` int [B, T] or None — how many leading keys each query may see: scores of the keys
  past it are -inf in every implementation (the kernels write them and skip the tiles wholly past it;
  XLA masks in the head sum's fusion), so the caller needs no masking pass of its own.
* ``scores[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, s])``, the dots with exact products of
  the bf16 inputs and fp32 accumulation (the model's fake-quantized FP4 values are exact in bf16).

Implementations (same signature), chosen by ``pallas_kernels.registry``:

* ``kernel.index_scores_pallas`` — Mosaic GPU kernel for Hopper: the per-head dots stay in registers
  and are summed over heads in a fixed order; skips tiles past ``n_visible_bt``. At T = 1 (a decode
  step) the op runs ``decode.index_scores_decode_pallas`` instead: keys on the wgmma M side, one
  query a batch row (the prefill kernel's 128-query tiles would be padding).
* ``xla.index_scores_xla`` — bf16-operand einsums in key blocks of 4096, then the relu and the head sum
  (materializes the fp32 dots of one key block).
* ``reference.index_scores_reference`` — float32 HIGHEST oracle; tests only.

The two fast implementations sum the heads in different orders, so they agree to fp32 rounding, not
bitwise; each is batch-invariant (the kernel across shapes, XLA within a compiled shape).
"""

from __future__ import annotations

import jax

from pallas_kernels.indexer.config import IndexScoresConfig, decode_unsupported_reason, kernel_unsupported_reason
from pallas_kernels.indexer.reference import index_scores_reference
from pallas_kernels.indexer.xla import index_scores_xla

__all__ = ["IndexScoresConfig", "decode_unsupported_reason", "index_scores", "index_scores_pallas",
           "index_scores_reference", "index_scores_xla", "kernel_unsupported_reason"]


def index_scores_pallas(q_bthd: jax.Array, k_bsd: jax.Array, w_bth: jax.Array, n_visible_bt: jax.Array | None = None,
                        *, config: IndexScoresConfig = IndexScoresConfig()) -> jax.Array:
    """The Mosaic GPU implementation: the decode kernel at T = 1 where it takes the shape, else the
    prefill kernel. Lazy imports: the Mosaic GPU modules load only when a kernel is asked for."""
    if q_bthd.shape[1] == 1 and decode_unsupported_reason(q_bthd.shape[2], q_bthd.shape[3]) is None:
        from pallas_kernels.indexer.config import DecodeIndexConfig
        from pallas_kernels.indexer.decode import index_scores_decode_pallas

        n_vis = None if n_visible_bt is None else n_visible_bt[:, 0]
        return index_scores_decode_pallas(q_bthd[:, 0], k_bsd, w_bth[:, 0], n_vis,
                                          config=DecodeIndexConfig(tiles=config.decode_tiles))[:, None]
    from pallas_kernels.indexer.kernel import index_scores_pallas as impl

    return impl(q_bthd, k_bsd, w_bth, n_visible_bt, config=config)


def index_scores(q_bthd: jax.Array, k_bsd: jax.Array, w_bth: jax.Array, n_visible_bt: jax.Array | None = None, *,
                 impl: str | None = None, selection=None, config: IndexScoresConfig = IndexScoresConfig()):
    """The op (see module docstring) on the implementation the registry picks for q's platform (the
    kernel only where ``kernel_unsupported_reason`` allows the shape)."""
    from pallas_kernels import registry

    if selection is None:
        selection = registry.KernelSelection.from_env()
    chosen = registry.resolve("index_scores", impl=impl, selection=selection, device=registry.device_of(q_bthd))
    if chosen.name == registry.PALLAS_MOSAIC_GPU and impl is None:
        if kernel_unsupported_reason(q_bthd.shape[2], q_bthd.shape[3], config) is not None:
            chosen = registry.resolve("index_scores", impl=registry.XLA, selection=selection)
    if chosen.name == registry.REFERENCE:
        return index_scores_reference(q_bthd, k_bsd, w_bth, n_visible_bt)
    return chosen.load()(q_bthd, k_bsd, w_bth, n_visible_bt, config=config)
