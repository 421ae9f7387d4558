"""Indexer top-k with the V4.1 selection semantics.

``topk_indices(scores_btS f32 [B, T, S], k) -> idx_btk int32 [B, T, k]``:

* the k largest scores of each row; equal scores (+0.0 and -0.0 are equal) go to the lower index;
* the picked indices are returned re-sorted into ascending index order;
* a pick whose score is -inf (unreachable; NaN counts as -inf) becomes -1, and -1s come last;
* k > S pads with -1;
* subnormal scores count as zero (XLA flushes them on CPU and GPU).

The result is an exact function of the row, so any correct implementation is batch-invariant.
No GPU kernel: the XLA path (``xla.py``) selects by bisection on integer keys for large calls and by a
stable sort for small ones (``method="auto"``); ``lax.top_k`` is its method ``"top_k"``.
"""

from __future__ import annotations

from pallas_kernels.topk.reference import topk_indices_reference
from pallas_kernels.topk.xla import topk_indices_xla

__all__ = ["topk_indices", "topk_indices_reference", "topk_indices_xla"]


def topk_indices(scores_bts, k: int, *, impl: str | None = None, selection=None):
    """The op (see module docstring), dispatched through ``pallas_kernels.registry`` (XLA by default)."""
    from pallas_kernels.registry import AUTO, resolve

    return resolve("topk_indices", impl=impl, selection=AUTO if selection is None else selection).load()(scores_bts, k)
