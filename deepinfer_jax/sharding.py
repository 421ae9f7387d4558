"""The one sharding rules table: logical axis names -> mesh axes, the mesh, and NamedSharding trees.

Every param and cache leaf has a logical axis name per dim (``logical_axes``); ``DEFAULT_RULES`` maps each
name onto the mesh axes ("data", "tensor", "expert"); a name mapped to () is replicated. A rule set that
would put two dims of one array on the same mesh axis is refused (``ShardingRules.spec``).

The table is chosen so that the only contraction split across devices is tensor parallelism's ``wo_b``,
whose partial sums ``parallel.attention_tp`` adds in device-index order; every other cross-device step
moves or selects values without arithmetic, so on a given mesh nothing depends on the batch:
* batch (slots) over ``data``: every op is row-local;
* attention heads and output groups over ``tensor`` (``parallel.attention_tp``; the single shared KV
  head, the compressor, the indexer and the caches stay whole on each tensor device: MQA);
* routed experts over ``tensor`` x ``expert`` (``parallel.moe_ep``: one non-zero term per (token, rank)
  in its combine, so the result is the single-device one bit for bit);
* the vocabulary (embedding rows, LM-head rows) over ``tensor`` x ``expert``: the head contracts over
  the hidden dim, which stays whole; an embedding row lives on exactly one device, so however the
  partitioner lowers the lookup (masked local gather + sum, or a gather of rows) it adds one row to
  zeros, exact in any order;
* Engram table rows over every axis (at V4.1 size the two tables are ~196 GB): a row lookup, same
  argument; tables are padded to split evenly (``PADDED_AXES``).
Small or contracted weights (norms, mHC, the q/o low-rank projections, the shared expert, the router,
compressor and indexer) are replicated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.config import ModelConfig

MESH_AXES = ("data", "tensor", "expert")


class ShardingError(ValueError):
    """A mesh, rule or array that cannot be sharded as asked (names the offending thing)."""


# ------------------------------------------------------------------------------------------------------
# Mesh


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the three mesh axes; parse from ``"data=1,tensor=2,expert=4"`` (missing axes are 1)."""

    data: int = 1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ShardingError(f"mesh axis {name!r} must be a positive integer, got {v!r}")

    @classmethod
    def parse(cls, spec: "str | MeshSpec | dict | Sequence[int]") -> "MeshSpec":
        if isinstance(spec, MeshSpec):
            return spec
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - set(MESH_AXES))
            if unknown:
                raise ShardingError(f"unknown mesh axis {unknown} (axes are {list(MESH_AXES)})")
            return cls(**{k: int(v) for k, v in spec.items()})
        if not isinstance(spec, str):
            sizes = tuple(int(v) for v in spec)
            if len(sizes) != len(MESH_AXES):
                raise ShardingError(f"a mesh shape needs {len(MESH_AXES)} sizes {MESH_AXES}, got {sizes}")
            return cls(*sizes)
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = re.fullmatch(r"([a-z]+)\s*=\s*(\d+)", part)
            if not m:
                raise ShardingError(f"mesh spec {spec!r}: {part!r} is not 'axis=size' (e.g. 'data=1,tensor=2,expert=4')")
            name, size = m.group(1), int(m.group(2))
            if name not in MESH_AXES:
                raise ShardingError(f"mesh spec {spec!r}: unknown axis {name!r} (axes are {list(MESH_AXES)})")
            if name in sizes:
                raise ShardingError(f"mesh spec {spec!r}: axis {name!r} given twice")
            sizes[name] = size
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.tensor, self.expert)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axes: Iterable[str]) -> int:
        return math.prod(getattr(self, a) for a in axes)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in MESH_AXES)


def make_mesh(spec: "str | MeshSpec | dict | Sequence[int]", devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, tensor, expert) mesh over ``devices`` (default: all devices of all processes).

    ``data`` is the outermost axis so that on several hosts it is the one that crosses hosts (the
    slow links carry no activations: slots never talk to each other)."""
    spec = MeshSpec.parse(spec)
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != spec.size:
        platform = devices[0].platform if devices else "none"
        hint = (f"; on CPU, simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count={spec.size} "
                f"set before jax starts" if platform == "cpu" else "")
        raise ShardingError(f"mesh {spec} needs {spec.size} devices, but {len(devices)} are available "
                            f"({platform}){hint}")
    if devices == list(jax.devices()):
        # jax orders devices by process and topology (NVLink islands, hosts) for this shape.
        return jax.make_mesh(spec.shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    return Mesh(np.asarray(devices, dtype=object).reshape(spec.shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * 3)


def mesh_spec_of(mesh: Mesh) -> MeshSpec:
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ShardingError(f"mesh axes {mesh.axis_names} are not {MESH_AXES}; build it with make_mesh")
    return MeshSpec(*(int(mesh.shape[a]) for a in MESH_AXES))


# ------------------------------------------------------------------------------------------------------
# The rules table

# logical axis -> mesh axes. Every logical name used by ``logical_axes`` must appear here; () = replicated.
_DEFAULT_TABLE: dict[str, tuple[str, ...]] = {
    # sharded
    "batch": ("data",),  # slots
    "heads": ("tensor",),  # query heads (wq_b rows = heads x head_dim, attention sinks)
    "o_groups": ("tensor",),  # grouped output projection (wo_a rows, wo_b columns = groups x o_lora_rank)
    "experts": ("tensor", "expert"),  # stacked routed experts
    "vocab": ("tensor", "expert"),  # embedding and LM-head rows (also the DSpark Markov head)
    "engram_rows": ("data", "tensor", "expert"),  # hashed n-gram table rows
    # replicated
    "embed": (),  # hidden size D
    "hc_embed": (),  # hc_mult x D (flattened mHC streams)
    "hc_mix": (),  # (2 + hc) x hc mixing coefficients
    "hc_scales": (),  # the 3 mHC scales
    "hc": (),  # hc_mult
    "q_lora": (),  # q_lora_rank
    "kv": (),  # head_dim of the shared K=V latent (wkv, kv_norm, compressor)
    "group_in": (),  # heads_per_group x head_dim: the input of one output group
    "ffn": (),  # moe_intermediate_size (routed and shared experts)
    "router": (),  # router rows (one per expert: the router needs all scores on every device)
    "index_heads": (),
    "index_dim": (),
    "engram_dim": (),  # engram_head_dim (and its scale blocks)
    "engram_in": (),  # engram_columns x engram_head_dim
    "engram_out": (),  # (hc + 1) x D
    "dspark_taps": (),  # taps x D input of DSpark's main_proj
    "markov_rank": (),
    "confidence_out": (),
    "confidence_in": (),
    # cache
    "window": (),  # sliding-window ring slots
    "cache_seq": (),  # compressed-KV entries
    "kv_store": (),  # a stored KV row (values or scales)
    # the grouped GEMM's tile-major expert weights [G, N/256, K/128, 256, 64] (moe.prepare_experts_tile_major)
    "tile_rows": (),
    "tile_bytes": (),
}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """logical axis -> tuple of mesh axes (hashable, so it can sit in a static jit argument)."""

    table: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def from_dict(cls, table: dict[str, Sequence[str] | str | None]) -> "ShardingRules":
        norm = {}
        for k, v in table.items():
            axes = () if v is None else (v,) if isinstance(v, str) else tuple(v)
            norm[k] = axes
        rules = cls(tuple(sorted(norm.items())))
        rules.validate()
        return rules

    def replace(self, **changes: Sequence[str] | str | None) -> "ShardingRules":
        d = dict(self.table)
        unknown = sorted(set(changes) - set(d))
        if unknown:
            raise ShardingError(f"unknown logical axis {unknown} (known: {sorted(d)})")
        d.update(changes)
        return ShardingRules.from_dict(d)

    def validate(self) -> None:
        for name, axes in self.table:
            for a in axes:
                if a not in MESH_AXES:
                    raise ShardingError(f"rule {name!r} -> {axes}: {a!r} is not a mesh axis {MESH_AXES}")
            if len(set(axes)) != len(axes):
                raise ShardingError(f"rule {name!r} -> {axes} names a mesh axis twice")
        missing = sorted(set(_DEFAULT_TABLE) - {k for k, _ in self.table})
        if missing:
            raise ShardingError(f"sharding rules lack logical axis {missing}")

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        for k, v in self.table:
            if k == logical:
                return v
        raise ShardingError(f"logical axis {logical!r} has no rule (known: {[k for k, _ in self.table]})")

    def spec(self, axes: Sequence[str | None], where: str = "array") -> PartitionSpec:
        """PartitionSpec for one array; refuses two dims of one array on the same mesh axis."""
        used: dict[str, int] = {}
        parts = []
        for dim, logical in enumerate(axes):
            mesh_axes = self.mesh_axes(logical)
            for a in mesh_axes:
                if a in used:
                    raise ShardingError(
                        f"{where}: mesh axis {a!r} would shard both dim {used[a]} ({axes[used[a]]!r}) and dim "
                        f"{dim} ({logical!r}); one mesh axis can split only one dim of an array")
                used[a] = dim
            parts.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        while parts and parts[-1] is None:
            parts.pop()
        return PartitionSpec(*parts)


DEFAULT_RULES = ShardingRules.from_dict(_DEFAULT_TABLE)


# ------------------------------------------------------------------------------------------------------
# Logical axes of every param and cache leaf

# Relative to one block (a backbone layer or a DSpark stage). Scales carry the axes of their weight:
# a block-scale dim is the weight dim counted in blocks, so it splits at the same boundaries.
_LINEAR_AXES = {  # linear name -> (out axis, in axis)
    "attn.wq_a": ("q_lora", "embed"),
    "attn.wq_b": ("heads", "q_lora"),
    "attn.wkv": ("kv", "embed"),
    "attn.wo_a": ("o_groups", "group_in"),
    "attn.wo_b": ("embed", "o_groups"),
    "attn.compressor.wkv": ("kv", "embed"),
    "attn.compressor.wgate": ("kv", "embed"),
    "attn.indexer.wk": ("index_dim", "kv"),
    "attn.indexer.wq_b": ("index_heads", "q_lora"),
    "attn.indexer.weights_proj": ("index_heads", "embed"),
    "ffn.gate": ("router", "embed"),
    "ffn.shared_experts.w1": ("ffn", "embed"),
    "ffn.shared_experts.w3": ("ffn", "embed"),
    "ffn.shared_experts.w2": ("embed", "ffn"),
    "ffn.experts.w1": ("experts", "ffn", "embed"),
    "ffn.experts.w3": ("experts", "ffn", "embed"),
    "ffn.experts.w2": ("experts", "embed", "ffn"),
    "engram.wkv": ("engram_out", "engram_in"),
    "engram.embed": ("engram_rows", "engram_dim"),
    "main_proj": ("embed", "dspark_taps"),
    "markov_head.embed": ("vocab", "markov_rank"),
    "markov_head.head": ("vocab", "markov_rank"),
    "confidence_head.proj": ("confidence_out", "confidence_in"),
}
_VECTOR_AXES = {  # leaf name (relative to a block) -> axes
    "attn_norm.weight": ("embed",),
    "ffn_norm.weight": ("embed",),
    "hc_attn_fn": ("hc_mix", "hc_embed"),
    "hc_ffn_fn": ("hc_mix", "hc_embed"),
    "hc_attn_fn_bf16x3": ("hc_mix", "hc_embed"),   # mhc.prepare_stream_dots: [3 * mix, hc * D]
    "hc_ffn_fn_bf16x3": ("hc_mix", "hc_embed"),
    "hc_attn_base": ("hc_mix",),
    "hc_ffn_base": ("hc_mix",),
    "hc_attn_scale": ("hc_scales",),
    "hc_ffn_scale": ("hc_scales",),
    "attn.attn_sink": ("heads",),
    "attn.q_norm.weight": ("q_lora",),
    "attn.kv_norm.weight": ("kv",),
    "attn.compressor.norm.weight": ("kv",),
    "attn.indexer.k_norm.weight": ("index_dim",),
    "ffn.gate.bias": ("router",),
    "ffn.gate.bias_vl": ("router",),
    "engram.q_weight": ("hc", "embed"),
    "engram.k_weight": ("hc", "embed"),
    "main_norm.weight": ("embed",),
    "norm.weight": ("embed",),
}
_ROOT_AXES = {
    "embed.weight": ("vocab", "embed"),
    "head.weight": ("vocab", "embed"),
    "norm.weight": ("embed",),
    "image_start": ("embed",),
    "image_end": ("embed",),
    "image_newline": ("embed",),
}
_CACHE_AXES = {
    "window.kv.values": ("batch", "window", "kv_store"),
    "window.kv.scale": ("batch", "window", "kv_store"),
    "window.kv.rope": ("batch", "window", "kv_store"),  # V4-Flash: the BF16 RoPE dims of a quantized entry
    "window.pos": ("batch", "window"),
    "sources.kv.values": ("batch", "cache_seq", "kv_store"),
    "sources.kv.scale": ("batch", "cache_seq", "kv_store"),
    "sources.kv.rope": ("batch", "cache_seq", "kv_store"),
    "sources.index_k.values": ("batch", "cache_seq", "kv_store"),
    "sources.index_k.scale": ("batch", "cache_seq", "kv_store"),
    "sources.pend_kv": ("batch", "kv_store"),
    "sources.pend_score": ("batch", "kv_store"),
}


def _block_leaf_axes(rel: str) -> tuple[str, ...] | None:
    if rel in _VECTOR_AXES:
        return _VECTOR_AXES[rel]
    head, _, leaf = rel.rpartition(".")
    if leaf in ("weight", "scale") and head in _LINEAR_AXES:
        return _LINEAR_AXES[head]
    if leaf == "scale_kn" and len(_LINEAR_AXES.get(head, ())) == 3:     # kernel-layout expert scales [G, K/32, N]
        g_axis, n_axis, k_axis = _LINEAR_AXES[head]
        return (g_axis, k_axis, n_axis)
    if leaf == "weight_tm" and len(_LINEAR_AXES.get(head, ())) == 3:    # tile-major expert weights
        g_axis, n_axis, k_axis = _LINEAR_AXES[head]
        return (g_axis, n_axis, k_axis, "tile_rows", "tile_bytes")
    return None


def path_str(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def logical_axes(path: Sequence[Any], cfg: ModelConfig | None = None) -> tuple[str, ...]:
    """Logical axis names of one param leaf (``("layers", 3, "ffn", "experts", "w1", "weight")``) or
    cache leaf (``("window", 3, "kv", "values")``, ``("sources", "layer_2", "index_k", "scale")``).

    With ``cfg`` the layer / stage index is checked against the config."""
    path = tuple(path)
    name = path_str(path)
    if path and path[0] in ("layers", "mtp"):
        if len(path) < 3 or not isinstance(path[1], (int, np.integer)):
            raise ShardingError(f"{name}: expected '{path[0]}.<index>.<leaf>'")
        if cfg is not None:
            n = cfg.num_hidden_layers if path[0] == "layers" else cfg.num_nextn_predict_layers
            if not 0 <= int(path[1]) < n:
                raise ShardingError(f"{name}: index {path[1]} out of range [0, {n}) for this config")
        axes = _block_leaf_axes(path_str(path[2:]))
    elif path and path[0] == "window":
        if len(path) < 3:
            raise ShardingError(f"{name}: expected 'window.<layer>.<leaf>'")
        axes = _CACHE_AXES.get("window." + path_str(path[2:]))
    elif path and path[0] == "sources":
        if len(path) < 3 or not str(path[1]).startswith("layer_"):
            raise ShardingError(f"{name}: expected 'sources.layer_<id>.<leaf>'")
        if cfg is not None and int(str(path[1])[6:]) not in cfg.kv_source_layer_ids:
            raise ShardingError(f"{name}: layer {path[1][6:]} is not a KV source layer of this config")
        axes = _CACHE_AXES.get("sources." + path_str(path[2:]))
    else:
        axes = _ROOT_AXES.get(name)
    if axes is None:
        raise ShardingError(f"{name}: no logical axes are defined for this leaf (add it to deepinfer_jax/sharding.py)")
    return axes


def _key_to_part(k: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise ShardingError(f"unsupported pytree key {k!r}")


def tree_paths(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """[(path tuple, leaf)] with dict keys and tuple indices as plain str / int."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_key_to_part(k) for k in kp), leaf) for kp, leaf in flat]


# ------------------------------------------------------------------------------------------------------
# Specs, validation and NamedSharding trees


# Logical axes of lookup tables whose rows are only ever gathered by id: they may be padded with rows no
# id reaches, so a prime-sized Engram table (its row count is a sum of primes) still splits evenly.
PADDED_AXES = frozenset({"engram_rows"})


def _parts(part: Any) -> tuple[str, ...]:
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def padded_shape(path: Sequence[Any], shape: Sequence[int], mesh_spec: MeshSpec,
                 rules: ShardingRules = DEFAULT_RULES) -> tuple[int, ...]:
    """The shape a leaf takes on this mesh: ``shape``, with PADDED_AXES dims rounded up to their split."""
    axes = logical_axes(path)
    out = list(shape)
    for dim, logical in enumerate(axes[:len(out)]):
        if logical in PADDED_AXES:
            n = mesh_spec.axis_size(rules.mesh_axes(logical))
            out[dim] = -(-out[dim] // n) * n
    return tuple(out)


def leaf_spec(path: Sequence[Any], shape: Sequence[int], mesh_spec: MeshSpec, rules: ShardingRules = DEFAULT_RULES,
              cfg: ModelConfig | None = None) -> PartitionSpec:
    """The PartitionSpec of one leaf, checked for rank and divisibility on this mesh."""
    name = path_str(path)
    axes = logical_axes(path, cfg)
    if len(axes) != len(shape):
        raise ShardingError(f"{name}: has {len(shape)} dims {tuple(shape)} but logical axes {axes}")
    spec = rules.spec(axes, name)
    for dim, part in enumerate(spec):
        mesh_axes = _parts(part)
        n = mesh_spec.axis_size(mesh_axes)
        if shape[dim] % n:
            hint = (" (a lookup table: place it with sharding.make_place / place_tree, which pads it)"
                    if axes[dim] in PADDED_AXES else "")
            raise ShardingError(f"{name}: dim {dim} ({axes[dim]!r}) has size {shape[dim]}, not divisible by mesh "
                                f"axes {mesh_axes} of total size {n} (mesh {mesh_spec}){hint}")
    return spec


def local_shape(shape: Sequence[int], spec: PartitionSpec, mesh_spec: MeshSpec) -> tuple[int, ...]:
    out = list(shape)
    for dim, part in enumerate(spec):
        out[dim] //= mesh_spec.axis_size(_parts(part))
    return tuple(out)


def tree_specs(tree: Any, mesh_spec: MeshSpec, rules: ShardingRules = DEFAULT_RULES,
               cfg: ModelConfig | None = None) -> Any:
    """The tree of PartitionSpecs for a params or cache tree (arrays or ShapeDtypeStructs)."""
    _, treedef = jax.tree_util.tree_flatten(tree)
    specs = [leaf_spec(p, leaf.shape, mesh_spec, rules, cfg) for p, leaf in tree_paths(tree)]
    return jax.tree_util.tree_unflatten(treedef, specs)


def tree_shardings(tree: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, cfg: ModelConfig | None = None) -> Any:
    """NamedSharding tree for params or cache (``jax.device_put(tree, tree_shardings(...))``)."""
    specs = tree_specs(tree, mesh_spec_of(mesh), rules, cfg)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def validate_model_mesh(cfg: ModelConfig, mesh_spec: MeshSpec | str, rules: ShardingRules = DEFAULT_RULES,
                        slots: int | None = None) -> None:
    """Checks what raw shapes cannot: tensor parallelism must split whole heads and whole output groups
    on 32-aligned boundaries (quantization blocks), and the expert count must split evenly."""
    ms = MeshSpec.parse(mesh_spec)
    heads = ms.axis_size(rules.mesh_axes("heads"))
    if rules.mesh_axes("o_groups") != rules.mesh_axes("heads"):
        raise ShardingError(f"rules: 'o_groups' -> {rules.mesh_axes('o_groups')} must equal 'heads' -> "
                            f"{rules.mesh_axes('heads')} (each device projects the groups of its own heads)")
    if cfg.num_attention_heads % heads or cfg.o_groups % heads:
        raise ShardingError(f"mesh {ms}: the heads axes {rules.mesh_axes('heads')} (size {heads}) must divide "
                            f"num_attention_heads={cfg.num_attention_heads} and o_groups={cfg.o_groups}")
    b = cfg.quant.block
    if (cfg.num_attention_heads // heads * cfg.head_dim) % b or (cfg.o_groups // heads * cfg.o_lora_rank) % b:
        raise ShardingError(f"mesh {ms}: a device's heads or output groups would not end on a {b}-wide "
                            f"quantization block")
    ne = ms.axis_size(rules.mesh_axes("experts"))
    if cfg.n_routed_experts % ne:
        raise ShardingError(f"mesh {ms}: n_routed_experts={cfg.n_routed_experts} is not divisible by the expert "
                            f"axes {rules.mesh_axes('experts')} of total size {ne}")
    nb = ms.axis_size(rules.mesh_axes("batch"))
    if slots is not None and slots % nb:
        raise ShardingError(f"mesh {ms}: {slots} slots do not split over the batch axes "
                            f"{rules.mesh_axes('batch')} of total size {nb}")


# ------------------------------------------------------------------------------------------------------
# The params tree without arrays (for planning, orbax restore targets and placement)

def abstract_params(cfg: ModelConfig, groups: Sequence[str] = ("backbone",), mesh: "Mesh | MeshSpec | None" = None,
                    rules: ShardingRules = DEFAULT_RULES) -> dict:
    """The params pytree as ShapeDtypeStructs (stacked experts, ``layers`` a tuple), from expected_tensors.

    With ``mesh``: the shapes the leaves take there (lookup tables padded, ``padded_shape``), and for a
    real Mesh each leaf carries its NamedSharding (an orbax restore target)."""
    from deepinfer_jax.checkpoint.names import DTYPES, param_path
    from deepinfer_jax.checkpoint.tensor_specs import expected_tensors

    tree: dict = {}
    stacked: dict[tuple, tuple[int, Any, tuple]] = {}
    for name, sp in expected_tensors(cfg).items():
        if sp.group not in groups:
            continue
        path, expert = param_path(name)
        if expert is not None:
            n, dt, shape = stacked.get(path, (0, sp.dtype, sp.shape))
            stacked[path] = (max(n, expert + 1), dt, shape)
            continue
        _set(tree, path, jax.ShapeDtypeStruct(sp.shape, DTYPES[sp.dtype]))
    for path, (n, dt, shape) in stacked.items():
        _set(tree, path, jax.ShapeDtypeStruct((n, *shape), DTYPES[dt]))
    for key in ("layers", "mtp"):
        if key in tree:
            tree[key] = tuple(tree[key][i] for i in sorted(tree[key]))
    if mesh is None:
        return tree
    ms = mesh if isinstance(mesh, MeshSpec) else mesh_spec_of(mesh)
    _, treedef = jax.tree_util.tree_flatten(tree)
    leaves = []
    for path, sd in tree_paths(tree):
        shape = padded_shape(path, sd.shape, ms, rules)
        sharding = None if isinstance(mesh, MeshSpec) else NamedSharding(mesh, leaf_spec(path, shape, ms, rules, cfg))
        leaves.append(jax.ShapeDtypeStruct(shape, sd.dtype, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _set(tree: dict, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


Region = tuple  # tuple of slices, one per dim: the part of a leaf one process needs


class MeshPlace:
    """``place(path, np_array[, region]) -> jax.Array`` for the loader: each device receives only its slice,
    and on several hosts the callback runs only for this host's devices.

    ``region(path, shape)`` is the bounding box (one slice per dim) of what this process's devices hold
    of a leaf of stored shape ``shape``, or None when that is the whole leaf: the loader then reads only
    that part from disk and passes it with ``region``. ``local_devices`` overrides the devices counted as
    this process's (default: the addressable ones); tests use it to simulate one host of several."""

    def __init__(self, cfg: ModelConfig | None, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
                 local_devices: Sequence[Any] | None = None):
        self.cfg, self.mesh, self.rules = cfg, mesh, rules
        self.mesh_spec = mesh_spec_of(mesh)
        self._local = None if local_devices is None else frozenset(local_devices)

    def sharding(self, path: Sequence[Any], stored_shape: Sequence[int]) -> tuple[NamedSharding, tuple[int, ...]]:
        """-> (the leaf's NamedSharding, its shape on this mesh: PADDED_AXES dims rounded up)."""
        path = tuple(path)
        shape = padded_shape(path, stored_shape, self.mesh_spec, self.rules)
        return NamedSharding(self.mesh, leaf_spec(path, shape, self.mesh_spec, self.rules, self.cfg)), shape

    def region(self, path: Sequence[Any], stored_shape: Sequence[int]) -> Region | None:
        stored_shape = tuple(stored_shape)
        sharding, shape = self.sharding(path, stored_shape)
        if self._local is None:
            idx = sharding.addressable_devices_indices_map(shape).values()
        else:
            idx = [i for d, i in sharding.devices_indices_map(shape).items() if d in self._local]
        if not idx:
            return tuple(slice(0, 0) for _ in stored_shape)
        box = []
        for dim, n in enumerate(stored_shape):
            bounds = [i[dim].indices(shape[dim])[:2] for i in idx]
            box.append(slice(min(lo for lo, _ in bounds), min(max(hi for _, hi in bounds), n)))
        if all(s.start == 0 and s.stop == n for s, n in zip(box, stored_shape)):
            return None
        return tuple(box)

    def __call__(self, path: Sequence[Any], array: np.ndarray, region: Region | None = None,
                 stored_shape: Sequence[int] | None = None) -> jax.Array:
        """``array``: the whole leaf (region None) or its ``region`` of a leaf of ``stored_shape``."""
        path = tuple(path)
        array = np.asarray(array)
        if region is None:
            array = pad_leaf(path, array, self.mesh_spec, self.rules)
            sharding = NamedSharding(self.mesh, leaf_spec(path, array.shape, self.mesh_spec, self.rules, self.cfg))
            return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])
        if stored_shape is None:
            raise ShardingError(f"{path_str(path)}: a region needs the leaf's stored shape")
        sharding, shape = self.sharding(path, stored_shape)
        pad = _pad_value(array.dtype)

        def fetch(idx):
            spans = [i.indices(n)[:2] for i, n in zip(idx, shape)]
            out = np.full([hi - lo for lo, hi in spans], pad, array.dtype)
            src, dst = [], []
            for (lo, hi), r, n in zip(spans, region, stored_shape):
                a, b = lo, min(hi, n)  # the stored (non-pad) part this device holds
                if a < b and (a < r.start or b > r.stop):
                    raise ShardingError(f"{path_str(path)}: a device needs [{a}, {b}) of a dim but only "
                                        f"[{r.start}, {r.stop}) was read (not one of this process's devices?)")
                a, b = (a, b) if a < b else (r.start, r.start)
                src.append(slice(a - r.start, b - r.start))
                dst.append(slice(a - lo, b - lo))
            out[tuple(dst)] = array[tuple(src)]
            return out

        return jax.make_array_from_callback(shape, sharding, fetch)


def make_place(cfg: ModelConfig | None, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES,
               local_devices: Sequence[Any] | None = None) -> MeshPlace:
    """The loader's ``place`` for ``mesh`` (see MeshPlace): reads and places only this host's shards."""
    return MeshPlace(cfg, mesh, rules, local_devices)


def _pad_value(dtype) -> Any:
    """Pad rows are zero values with unit scales (E8M0 has no zero)."""
    if np.dtype(dtype) == np.dtype(jnp.float8_e8m0fnu):
        return np.uint8(127).view(dtype)  # 2^0
    return np.zeros((), dtype)


def pad_leaf(path: Sequence[Any], array: np.ndarray, mesh_spec: MeshSpec,
             rules: ShardingRules = DEFAULT_RULES) -> np.ndarray:
    """``array`` grown to ``padded_shape`` (no copy when nothing grows). Pad rows are zero values with
    unit scales (E8M0 has no zero), never read: ids index the original rows only."""
    target = padded_shape(path, array.shape, mesh_spec, rules)
    if target == array.shape:
        return array
    out = np.full(target, _pad_value(array.dtype), array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


def place_tree(tree: Any, cfg: ModelConfig | None, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """Every leaf of a host (numpy) params or cache tree placed on ``mesh`` by ``make_place``."""
    place = make_place(cfg, mesh, rules)
    _, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [place(p, np.asarray(x)) for p, x in tree_paths(tree)])


__all__ = [
    "MESH_AXES", "MeshSpec", "ShardingError", "ShardingRules", "DEFAULT_RULES", "make_mesh", "mesh_spec_of",
    "logical_axes", "leaf_spec", "local_shape", "tree_specs", "tree_shardings", "tree_paths", "path_str",
    "validate_model_mesh", "abstract_params", "make_place", "MeshPlace", "place_tree", "pad_leaf", "padded_shape",
    "PADDED_AXES",
]
