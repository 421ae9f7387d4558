"""The KV/state cache as a pytree; every leaf has the slot (batch) dim first.

* ``window[L]``: the layer's SWA ring, kv [B, W, head_dim] and the position held by each slot [B, W].
* ``sources["layer_{s}"]`` for every KV-source layer s: compressed KV [B, N, head_dim], index-K
  [B, N, index_head_dim] (not on V4's indexer-less ratio-128 layers), and the compressor's carried fp32
  rows (V4.1 ratio 2: the pending half-pair; V4: compressor_v4's windows). N = ``compressed_entries``:
  ceil(max_len/r), rounded up to a multiple of ``INDEX_ENTRY_ALIGN`` where an indexer scores them.
Each KV tensor is a storage dict from ``kv_codec`` ({"values"} in BF16, or at deployment precision when
``numerics.kv_quant``: {"values", "scale"}, plus "rope" for V4-Flash's BF16 RoPE dims; ``kv_codec.layouts``).
Positions start at -1 (empty). A slot handed to a new request needs ``reset_slots``: the window ring
trusts any row below a chunk's first position, and with bounded replay the upper layers first write at
P - window, so the previous occupant's rows would show through. The compressed KV and index-K need no
reset: an entry is visible only once the request's own positions have written it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model import compressor_v4, kv_codec
from deepinfer_jax.model.numerics import Numerics


#: An indexed source's entries come in multiples of this, the index-score kernels' key tiles (prefill 128,
#: decode 256): a score row is then the kernel's output buffer as it is, with no padded copy of the keys
#: and no slice of the [T, S] scores (a pass each at a prefill chunk). Entries past a request's own
#: positions are never visible, so the extra ones change no result.
INDEX_ENTRY_ALIGN = 256


def compressed_entries(max_len: int, ratio: int, indexed: bool = True) -> int:
    """Entries of a source cache compressing ``ratio`` positions into one, for ``max_len`` positions."""
    n = -(-max_len // ratio)
    return -(-n // INDEX_ENTRY_ALIGN) * INDEX_ENTRY_ALIGN if indexed else n


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int, numerics: Numerics) -> dict:
    """The cache as a pytree of jax.ShapeDtypeStruct (for memory planning without allocating)."""
    dt = numerics.dtype
    q = numerics.kv_quant
    if q and not cfg.kv_fp8_rounding:
        # the FP8 cache would round what this reference keeps unrounded: storage would change results
        raise ValueError("V4-Flash's initial-revision reference does not round the KV to FP8, so it has no "
                         "deployment-precision cache; use Numerics(kv_quant=False) (e.g. 'reference-bf16-kv')")
    w = cfg.sliding_window
    lay = kv_codec.layouts(cfg)
    window = tuple(
        {"kv": kv_codec.stored_shapes(lay.window, (batch, w), cfg.head_dim, q, dt),
         "pos": jax.ShapeDtypeStruct((batch, w), jnp.int32)}
        for _ in range(cfg.num_hidden_layers)
    )
    sources = {}
    for s in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[s]
        plan = cfg.layer_plan(s)
        n = compressed_entries(max_len, r, plan.has_indexer)
        entry = {"kv": kv_codec.stored_shapes(lay.compressed, (batch, n), cfg.head_dim, q, dt)}
        if plan.has_indexer:  # V4's ratio-128 layers attend every entry: no index-K
            entry["index_k"] = kv_codec.stored_shapes(lay.index_k, (batch, n), cfg.index_head_dim, q, dt)
        if cfg.variant == "v4":  # the windows' projected rows, for both compressors (compressor_v4.py)
            entry.update(compressor_v4.state_shapes(batch, r, plan.overlap, cfg.head_dim))
            if plan.has_indexer:
                entry.update(compressor_v4.state_shapes(batch, r, plan.overlap, cfg.index_head_dim, "idx_"))
        elif r > 1:
            entry["pend_kv"] = jax.ShapeDtypeStruct((batch, cfg.head_dim), jnp.float32)
            entry["pend_score"] = jax.ShapeDtypeStruct((batch, cfg.head_dim), jnp.float32)
        sources[f"layer_{s}"] = entry
    return {"window": window, "sources": sources}


def init_leaf(sd: jax.ShapeDtypeStruct) -> jax.Array:
    """An empty cache leaf: positions -1; E8M0 has no zero, so scales start at 1 to keep empty rows finite."""
    fill = -1 if sd.dtype == jnp.int32 else (1 if sd.dtype == jnp.float8_e8m0fnu else 0)
    return jnp.full(sd.shape, fill, sd.dtype)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, numerics: Numerics) -> dict:
    return jax.tree.map(init_leaf, cache_shapes(cfg, batch, max_len, numerics))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, numerics: Numerics) -> int:
    leaves = jax.tree.leaves(cache_shapes(cfg, batch, max_len, numerics))
    return sum(int(jnp.dtype(x.dtype).itemsize) * math.prod(x.shape) for x in leaves)


def reset_slots(cache: dict, reset_b: jax.Array) -> dict:
    """The cache with the slots where ``reset_b`` [B] is true emptied: window positions -1, pending pair 0.

    Touches only [B, W] positions and [B, D] pending rows per layer, not the KV itself, so resetting
    on admission costs nothing next to the step (a full-cache select would rewrite every KV byte).
    """
    def clear(x: jax.Array, empty) -> jax.Array:
        return jnp.where(reset_b.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.asarray(empty, x.dtype), x)

    window = tuple(dict(layer, pos=clear(layer["pos"], -1)) for layer in cache["window"])
    sources = {name: {k: clear(v, 0) if k.startswith("pend_") else v for k, v in src.items()}
               for name, src in cache["sources"].items()}
    return {**cache, "window": window, "sources": sources}
