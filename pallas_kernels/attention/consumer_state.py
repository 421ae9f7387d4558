"""The online-softmax state of the attention kernels' two consumer warpgroups (kernel.py's "halves"
schedule and seesaw.py's): where it starts and how it ends. Mosaic GPU kernel code, traced inside a
consumer warpgroup."""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.attention.config import HEAD_GROUP

LOG2E = math.log2(math.e)
NEG_BIG = -1e30     # finite "minus infinity" for a running max that may never see a valid score
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)   # one value per head


def initial_state(sink_ref, group, *, n_splits: int, consumer: int, cols: int, n_chunks: int):
    """(o, m, l) of consumer ``consumer`` before its first block: o n_chunks zero [64, cols] arrays,
    m and l per head in log2 units. With one split the running max starts at the sink and consumer 0's
    denominator at 1: e^(sink - m) then rides in that share of the denominator, rescaled with it, so the
    sink enters it exactly once and a query with no valid entry gives 0. With several splits the sink
    waits for ``kernel.merge_splits``."""
    h = HEAD_GROUP
    if n_splits == 1:
        m = plgpu.load(sink_ref.at[group], layout=ROW_LAYOUT, optimized=False) * LOG2E
    else:
        m = plgpu.layout_cast(jnp.full((h,), NEG_BIG, jnp.float32), ROW_LAYOUT)
    l = plgpu.layout_cast(jnp.full((h,), 1.0 if (n_splits == 1 and consumer == 0) else 0.0, jnp.float32),
                          ROW_LAYOUT)
    o = tuple(plgpu.layout_cast(jnp.zeros((h, cols), jnp.float32), plgpu.Layout.WGMMA) for _ in range(n_chunks))
    return o, m, l


def write_output(consumer: int, o, m, l, *, l_exchange, sync: Callable[[], None], q_smem, out_refs, n, split,
                 n_splits: int, cols: int, half_dim: int) -> None:
    """The epilogue of consumer ``consumer``, which owns output columns [consumer * half_dim, + half_dim)
    as o's [64, cols] chunks: add both consumers' denominators (through ``l_exchange`` [2, 64] f32 and
    ``sync``, a rendezvous of the two), normalise, and write o: with one split as bf16 o [n, 64, D]
    through this consumer's half of the query tile (no one reads q any more once both passed ``sync``),
    else as float32 partials [n, splits, 64, D] with consumer 0 writing the log2-sum-exp [n, splits, 64].
    Both consumers must hold the same running max m."""
    l_exchange.at[consumer][...] = l
    sync()
    l = l_exchange.at[0][...] + l_exchange.at[1][...]
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
    o = [oc * lax.broadcast_in_dim(inv_l, (HEAD_GROUP, cols), [0]) for oc in o]
    if n_splits == 1:
        (o_ref,) = out_refs
        for c, oc in enumerate(o):
            q_smem.at[consumer, :, pl.ds(c * cols, cols)][...] = oc.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem.at[consumer], o_ref.at[n, :, pl.ds(consumer * half_dim, half_dim)])
        plgpu.wait_smem_to_gmem(0)
    else:
        o_ref, lse_ref = out_refs
        for c, oc in enumerate(o):
            o_ref.at[n, split, :, pl.ds(consumer * half_dim + c * cols, cols)][...] = oc
        if consumer == 0:
            lse_ref.at[n, split][...] = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), -jnp.inf)


def output_types(n_queries: int, n_splits: int, head_dim: int) -> tuple:
    """What ``write_output`` writes: o [n, 64, D] bf16 for one split, else the float32 partials
    [n, splits, 64, D] and their log2-sum-exp [n, splits, 64]."""
    h = HEAD_GROUP
    if n_splits == 1:
        return (jax.ShapeDtypeStruct((n_queries, h, head_dim), jnp.bfloat16),)
    return (jax.ShapeDtypeStruct((n_queries, n_splits, h, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((n_queries, n_splits, h), jnp.float32))
