"""Indexer top-k with the V4.1 selection semantics.

``topk_indices(scores_btS f32 [B, T, S], k) -> idx_btk int32 [B, T, k]``:

* the k largest scores of each row; equal scores (+0.0 and -0.0 are equal) go to the lower index;
* the picked indices are returned re-sorted into ascending index order;
* a pick whose score is -inf (unreachable; NaN counts as -inf) becomes -1, and -1s come last;
* k > S pads with -1;
* ``width=W`` ranks the first W columns only, as ``scores_bts[..., :W]`` would (the XLA bisection reads
  them in place instead of copying the slice);
* an implementation registered for the op takes ``(scores_bts, k)``; one that also takes the keywords
  ``width`` and ``may_branch`` gets them, the others get the slice;
* subnormal scores count as zero (XLA flushes them on CPU and GPU).

The result is an exact function of the row, so any correct implementation is batch-invariant.
No GPU kernel: the XLA path (``xla.py``) selects by bisection on integer keys for large calls and by a
stable sort for small ones (``method="auto"``); ``lax.top_k`` is its method ``"top_k"``.
"""

from __future__ import annotations

from pallas_kernels.topk.reference import topk_indices_reference
from pallas_kernels.topk.xla import topk_indices_xla

__all__ = ["topk_indices", "topk_indices_reference", "topk_indices_xla"]


def topk_indices(scores_bts, k: int, *, impl: str | None = None, selection=None, width: int | None = None,
                 may_branch: bool = False):
    """The op (see module docstring), dispatched through ``pallas_kernels.registry`` (XLA by default).
    width: only the first ``width`` columns compete (default S), as ``scores_bts[..., :width]`` would,
    without making that slice. may_branch: the implementation may put a data-dependent conditional in
    the program (the XLA bisection's candidate list, ``select.select_on_candidates``); leave it False in
    a program that must stay one CUDA graph (a decode step). The picks are the same either way."""
    import inspect

    from pallas_kernels.registry import AUTO, resolve

    op = resolve("topk_indices", impl=impl, selection=AUTO if selection is None else selection).load()
    if {"width", "may_branch"} <= inspect.signature(op).parameters.keys():
        return op(scores_bts, k, width=width, may_branch=may_branch)
    return op(scores_bts[..., :width], k)   # an implementation registered with the plain (scores, k) form
