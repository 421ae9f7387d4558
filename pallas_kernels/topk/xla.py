"""XLA top-k for the indexer: three exact methods with the same result, chosen by size.

* "select" (``select.py``): bisection on order-preserving integer keys; 16 counting passes and two
  prefix sums over the row, no sort; on long rows over a list of candidate blocks instead of the row
  (``select.select_on_candidates``).
* "sort": a stable sort of the whole row on descending score. The H200 prefill trace of 2026-12-04 had
  XLA's segmented radix sort of [2048, 8192] rows at ~3.5 ms per indexer layer and 2048-token chunk.
* "top_k": ``lax.top_k`` (documented: equal values come out lower index first). On the GPU it lowers to
  a full sort at k=512 as well (``benchmarks/NOTES.md``); ``benchmarks/attention_gpu.py`` checks its tie
  rule there.
* "auto" (default): "select" from ``SELECT_MIN_SCORES`` scores per call, else "sort".

Each method is an exact function of the row, so choosing one by shape keeps results batch-invariant.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.topk.reference import ascending_with_unreachable_last, canonical_scores, pad_to_k
from pallas_kernels.topk.select import score_key, select_topk

# "auto" selects by bisection from this many scores per call (a 2048-token prefill chunk over 2048+
# index keys), and sorts below it: at decode (64-256 rows) a sort is one small launch, the bisection 32.
SELECT_MIN_SCORES = 1 << 22


def topk_desc(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices) of the k largest along the last axis, lower index first among equals."""
    order = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(scores, order, axis=-1), order.astype(jnp.int32)


# From this many rows ``topk_desc_rows`` takes k argmax passes instead of the sort: the H100 prefill
# trace (2026-12-07, session 32) had the router's stable sort of [16384, 384] scores at ~0.25 ms a call,
# where six passes read ~150 MB (~0.05 ms at copy speed). A decode step's 64 rows keep the one sort
# launch. Both give the same indices, so the cut changes no bits.
PASSES_MIN_ROWS = 1024
PASSES_MAX_K = 8


def topk_desc_rows(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``topk_desc`` (values, indices: the k largest along the last axis, descending, lower index first
    among equals, -0.0 equal to +0.0, NaN last), by k passes of a first-occurrence argmax on order keys
    where there are many rows and k is small, by the stable sort otherwise."""
    rows = math.prod(scores.shape[:-1])
    if rows < PASSES_MIN_ROWS or k > PASSES_MAX_K or k > scores.shape[-1]:
        return topk_desc(scores, k)
    # keys: 0 = already picked, 1 = NaN, then the float order (order_key(-inf) = 0x007FFFFF)
    keys = jnp.maximum(score_key(scores.astype(jnp.float32)), jnp.uint32(1))
    cols = lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
    picks = []
    for _ in range(k):
        j = jnp.argmax(keys, axis=-1).astype(jnp.int32)
        picks.append(j)
        keys = jnp.where(cols == j[..., None], jnp.uint32(0), keys)
    order = jnp.stack(picks, axis=-1)
    return jnp.take_along_axis(scores, order, axis=-1), order


def _sort_topk(scores: jax.Array, k: int) -> jax.Array:
    return ascending_with_unreachable_last(*topk_desc(scores, k))


def _lax_topk(scores: jax.Array, k: int) -> jax.Array:
    return ascending_with_unreachable_last(*lax.top_k(canonical_scores(scores), k))


_METHODS = {"select": select_topk, "sort": _sort_topk, "top_k": _lax_topk}


def topk_indices_xla(scores_bts: jax.Array, k: int, *, method: str = "auto", width: int | None = None,
                     may_branch: bool = False) -> jax.Array:
    """-> idx_btk int32. Same contract as ``pallas_kernels.topk.topk_indices``.

    method: "auto", "select", "sort" or "top_k" (module docstring). width: the "select" method reads the
    first ``width`` columns in place; the others select on that slice. may_branch: "select" may use its
    candidate list (a ``lax.cond``) on long rows."""
    width = scores_bts.shape[-1] if width is None else min(width, scores_bts.shape[-1])
    if method == "auto":
        method = "select" if math.prod(scores_bts.shape[:-1]) * width >= SELECT_MIN_SCORES else "sort"
    if method not in _METHODS:
        raise ValueError(f"topk_indices_xla: unknown method {method!r} "
                         f"(want 'auto', {', '.join(map(repr, _METHODS))})")
    kk = min(k, width)
    if method == "select":
        return pad_to_k(select_topk(scores_bts, kk, width=width, prefilter=may_branch), k)
    return pad_to_k(_METHODS[method](scores_bts[..., :width], kk), k)
