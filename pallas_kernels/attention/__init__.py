"""Sparse attention with per-head sinks over caller-selected KV rows (DeepSeek-V4.1 CSA2 attention core).

The op::

    sparse_sink_attention(q_bthd, kv_bsd, idx_btk, sink_h, scale) -> o_bthd

* ``q_bthd``  [B, T, H, D] bf16 — queries.
* ``kv_bsd``  [B, S, D] bf16 — one shared row per entry, used as both key and value (V4.1 concatenates
  the sliding-window rows and the compressed rows of the layer's KV source; that is the caller's job).
* ``idx_btk`` int32 [B, T, K] — for query (b, t) the entries of ``kv_bsd[b]`` to attend, in [0, S) or
  -1 = skip (any negative value skips). Duplicates are kept (an entry listed twice counts twice).
  Values >= S are a caller error (the kernel then reads a zero row, the XLA path clamps to S - 1).
* ``sink_h``  f32 [H] — per-head sink logit; ``scale`` — a Python float (V4.1: D ** -0.5).

For head h over the valid entries i: ``z_i = (q_h . kv_i) * scale``, ``m = max(max_i z_i, sink_h)``,
``o_h = sum_i e^(z_i - m) kv_i / (sum_i e^(z_i - m) + e^(sink_h - m))``. The sink only enlarges the
denominator; a query with no valid entry returns 0. Softmax and accumulation are float32 in every
implementation; the fast ones round the probabilities to bf16 for the p.kv product, like flash kernels.

Implementations (same signature):

* ``reference.sparse_sink_attention_reference`` — float32 HIGHEST-precision oracle (tests only).
* ``xla.sparse_sink_attention_xla`` — gather + einsum; any platform, any shape. Batch-invariant on the
  CPU; on the H200 only within one compiled shape (measured: bits change with B).
* ``kernel.sparse_sink_attention_pallas`` — Mosaic GPU kernel for Hopper; decode and prefill alike
  (one CTA per token), ``D % 128 == 0``; batch-invariant for a fixed ``SparseAttentionConfig``.

The two-source variant reads V4.1's compressed KV as the cache stores it (kv_codec.COMPRESSED)::

    sparse_sink_attention_fp4(q_bthd, win_kv_bsd, win_idx_btk, comp_values_bnc, comp_scale_bng,
                              comp_idx_btk, sink_h, scale) -> o_bthd

* ``win_kv_bsd`` [B, Sw, D] bf16 and ``win_idx_btk`` [B, T, Kw]: the window rows, as ``kv_bsd``/``idx_btk``;
* ``comp_values_bnc`` uint8 [B, N, D/2]: packed E2M1 values (byte j: element 2j low nibble, 2j+1 high),
  ``comp_scale_bng`` float8_e4m3fn [B, N, D/16]: one scale per 16 values, ``comp_idx_btk`` [B, T, Kc]:
  the selected compressed rows (-1 skips).
The query attends to the listed window rows and the listed compressed rows dequantized (value x scale,
exact in bf16), with the same sink and numerics as above. Implementations: ``kernel`` (dequantizes in the
kernel: reads 256 + 32 bytes per compressed row instead of 1,024), ``xla`` (gathers and dequantizes the
listed rows only), ``reference``.
"""

from __future__ import annotations

import jax

from pallas_kernels.attention.config import SparseAttentionConfig, kernel_unsupported_reason
from pallas_kernels.attention.reference import sparse_sink_attention_fp4_reference, sparse_sink_attention_reference
from pallas_kernels.attention.xla import sparse_sink_attention_fp4_xla, sparse_sink_attention_xla

__all__ = ["SparseAttentionConfig", "kernel_unsupported_reason", "sparse_sink_attention",
           "sparse_sink_attention_fp4", "sparse_sink_attention_fp4_pallas", "sparse_sink_attention_fp4_reference",
           "sparse_sink_attention_fp4_xla", "sparse_sink_attention_pallas", "sparse_sink_attention_reference",
           "sparse_sink_attention_xla"]


def sparse_sink_attention_pallas(*args, **kwargs):
    """Lazy import: the Mosaic GPU module is only loaded when the kernel is asked for."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas as impl

    return impl(*args, **kwargs)


def sparse_sink_attention_fp4_pallas(*args, **kwargs):
    """Lazy import, as above."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_fp4_pallas as impl

    return impl(*args, **kwargs)


def _dispatch(op: str, fp4: bool, q_bthd: jax.Array, config: SparseAttentionConfig, impl: str | None, selection):
    """The registry's choice for op, falling back to XLA where the kernel cannot run this (H, D, config)."""
    from pallas_kernels.registry import AUTO, PALLAS_MOSAIC_GPU, XLA, KernelUnavailableError, resolve

    selection = AUTO if selection is None else selection
    chosen = resolve(op, impl=impl, selection=selection)
    if chosen.name == PALLAS_MOSAIC_GPU:
        h, d = q_bthd.shape[-2:]
        if (why := kernel_unsupported_reason(h, d, config, fp4=fp4)) is not None:
            if (impl or selection.impl_for(op)) is not None:
                raise KernelUnavailableError(f"{op}: {PALLAS_MOSAIC_GPU!r} was requested but {why}")
            return resolve(op, impl=XLA), False
        return chosen, True
    return chosen, False


def sparse_sink_attention_fp4(q_bthd: jax.Array, win_kv_bsd: jax.Array, win_idx_btk: jax.Array,
                              comp_values_bnc: jax.Array, comp_scale_bng: jax.Array, comp_idx_btk: jax.Array,
                              sink_h: jax.Array, scale: float, *,
                              config: SparseAttentionConfig = SparseAttentionConfig(), impl: str | None = None,
                              selection=None) -> jax.Array:
    """The two-source op (module docstring), chosen like ``sparse_sink_attention``."""
    chosen, is_kernel = _dispatch("sparse_sink_attention_fp4", True, q_bthd, config, impl, selection)
    args = (q_bthd, win_kv_bsd, win_idx_btk, comp_values_bnc, comp_scale_bng, comp_idx_btk, sink_h, scale)
    return chosen.load()(*args, config) if is_kernel else chosen.load()(*args)


def sparse_sink_attention(q_bthd: jax.Array, kv_bsd: jax.Array, idx_btk: jax.Array, sink_h: jax.Array,
                          scale: float, *, config: SparseAttentionConfig = SparseAttentionConfig(),
                          impl: str | None = None, selection=None) -> jax.Array:
    """The op (see module docstring), dispatched through ``pallas_kernels.registry``.

    Automatic choice: the Mosaic kernel on a Hopper CUDA device when it supports (H, D, config), else the
    XLA path -- a function of (platform, H, D, config) only, so the same for every batch size. ``impl`` /
    ``selection`` force one; forcing the kernel on a shape it cannot run raises ``KernelUnavailableError``."""
    chosen, is_kernel = _dispatch("sparse_sink_attention", False, q_bthd, config, impl, selection)
    if is_kernel:
        return chosen.load()(q_bthd, kv_bsd, idx_btk, sink_h, scale, config)
    return chosen.load()(q_bthd, kv_bsd, idx_btk, sink_h, scale)
