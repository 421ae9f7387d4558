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
* ``xla.sparse_sink_attention_xla`` — gather + einsum; any platform, any shape; the prefill path.
* ``kernel.sparse_sink_attention_pallas`` — Mosaic GPU kernel for Hopper; decode and prefill alike
  (one CTA per token), ``D % 128 == 0``; batch-invariant for a fixed ``SparseAttentionConfig``.
"""

from __future__ import annotations

import jax

from pallas_kernels.attention.config import SparseAttentionConfig, kernel_unsupported_reason
from pallas_kernels.attention.reference import sparse_sink_attention_reference
from pallas_kernels.attention.xla import sparse_sink_attention_xla

__all__ = ["SparseAttentionConfig", "kernel_unsupported_reason", "sparse_sink_attention",
           "sparse_sink_attention_pallas", "sparse_sink_attention_reference", "sparse_sink_attention_xla"]


def sparse_sink_attention_pallas(*args, **kwargs):
    """Lazy import: the Mosaic GPU module is only loaded when the kernel is asked for."""
    from pallas_kernels.attention.kernel import sparse_sink_attention_pallas as impl

    return impl(*args, **kwargs)


def _on_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", None) == "9.0"


def sparse_sink_attention(q_bthd: jax.Array, kv_bsd: jax.Array, idx_btk: jax.Array, sink_h: jax.Array,
                          scale: float, *, config: SparseAttentionConfig = SparseAttentionConfig()) -> jax.Array:
    """The op (see module docstring): the Mosaic kernel on a CUDA backend when it supports the shape,
    the XLA path everywhere else. The choice is a function of (backend, H, D, config) only, so it is the
    same for every batch size."""
    h, d = q_bthd.shape[-2:]
    if _on_hopper() and kernel_unsupported_reason(h, d, config) is None:
        return sparse_sink_attention_pallas(q_bthd, kv_bsd, idx_btk, sink_h, scale, config)
    return sparse_sink_attention_xla(q_bthd, kv_bsd, idx_btk, sink_h, scale)
