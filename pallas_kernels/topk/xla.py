"""XLA top-k for the indexer: ``lax.top_k`` (documented: equal values come out lower index first).

``lax.top_k`` is an exact selection, so its result is a function of the row alone whenever its tie
rule holds; ``benchmarks/attention_gpu.py`` checks that rule on the GPU against the explicit-sort
version (``method="sort"``), which is the fallback should a backend break it.
"""

from __future__ import annotations

import jax
from jax import lax

from pallas_kernels.topk.reference import (ascending_with_unreachable_last, canonical_scores, pad_to_k,
                                           topk_indices_reference)


def topk_indices_xla(scores_bts: jax.Array, k: int, *, method: str = "top_k") -> jax.Array:
    """-> idx_btk int32. Same contract as ``pallas_kernels.topk.topk_indices``.

    method: "top_k" (``lax.top_k``) or "sort" (a full two-key sort; slower, tie rule by construction)."""
    if method == "sort":
        return topk_indices_reference(scores_bts, k)
    if method != "top_k":
        raise ValueError(f"topk_indices_xla: unknown method {method!r} (want 'top_k' or 'sort')")
    s = canonical_scores(scores_bts)
    vals, idx = lax.top_k(s, min(k, s.shape[-1]))
    return pad_to_k(ascending_with_unreachable_last(vals, idx), k)
