"""Cross-device combines whose summation order is fixed by device index, not chosen by the runtime.

A ``psum`` leaves the reduction tree to XLA / NCCL, which pick algorithms (ring, tree, NVLS) by message
size: the same row could then be summed in a different order at another batch size, breaking batch
invariance. Gathering the partials and adding them in index order costs (n-1)/n more traffic than a
reduce-scatter, but the result depends only on the values, never on the batch or the runtime.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def ordered_sum(x: jax.Array, axis_names: Sequence[str], dtype=jnp.float32) -> jax.Array:
    """Inside shard_map: sum of ``x`` over the devices of ``axis_names``, as ((p0 + p1) + p2) + ...

    Device i is the row-major position over ``axis_names`` (the order NamedSharding lays out a dim
    split over the same axes). The sum runs in ``dtype`` and is returned in ``dtype``."""
    axis_names = tuple(axis_names)
    if not axis_names:
        return x.astype(dtype)
    # to='invarying': the gathered stack is the same on every device of axis_names (shard_map's check).
    parts = jax.lax.all_gather(x.astype(dtype), axis_names, axis=0, tiled=False, to='invarying')
    acc = parts[0]
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i]
    return acc


def flat_axis_index(axis_names: Sequence[str]) -> jax.Array:
    """Inside shard_map: this device's row-major position over ``axis_names`` (0 when there are none)."""
    axis_names = tuple(axis_names)
    if not axis_names:
        return jnp.int32(0)
    return jax.lax.axis_index(axis_names)
