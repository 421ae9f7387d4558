"""Load an official-format checkpoint into the params pytree, checking every tensor against the config.

Everything is validated from the headers before any data is read, and all problems are reported in one
CheckpointError. Tensors are then streamed shard by shard, one at a time, from memory maps and handed to
``place`` (the sharding code passes a function that puts each array straight onto its NamedSharding), so
host memory stays at one tensor, or one block's stacked experts, at a time. Weights stay in their stored
formats (docs/CONTRACTS.md dtypes); the model dequantizes inside jit.

Host-local reading: when ``place`` has a ``region(path, shape)`` method (``sharding.MeshPlace``), only the
part of each leaf that this process's devices hold is read: routed experts outside the process's expert
range are skipped, row-split leaves (vocabulary, Engram tables) are read by their row range, and a shard
file none of whose tensors this process needs is never read (only its header, for validation).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from deepinfer_jax.checkpoint.names import DTYPES, param_path
from deepinfer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, read_index
from deepinfer_jax.checkpoint.tensor_specs import (BACKBONE, DSPARK, IGNORED_PREFIXES, IMAGE, TensorSpec,
                                                   expected_tensors)
from deepinfer_jax.config import ModelConfig

Place = Callable[[tuple, np.ndarray], jax.Array]
GROUPS = (BACKBONE, IMAGE, DSPARK)

__all__ = ["CheckpointError", "GROUPS", "load_params", "read_tensor", "validate_checkpoint"]


def _default_place(path: tuple, arr: np.ndarray) -> jax.Array:
    return jax.device_put(arr)


def validate_checkpoint(cfg: ModelConfig, weight_map: dict[str, str], shards: dict[str, SafetensorsFile],
                        groups: Sequence[str] = (BACKBONE,), ckpt_dir: Path | None = None) -> dict[str, TensorSpec]:
    """Check presence, dtype and shape of every expected tensor of ``groups`` and reject unknown names.

    -> the specs to load. Raises one CheckpointError that lists every offending tensor by category.
    """
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown tensor group(s) {unknown}; known: {list(GROUPS)}")
    every = expected_tensors(cfg)
    wanted = {n: s for n, s in every.items() if s.group in groups}
    missing = sorted(n for n in wanted if n not in weight_map)
    absent = sorted(f"{n} [{weight_map[n]}]" for n in wanted if n in weight_map and n not in shards[weight_map[n]])
    unexpected = sorted(n for n in weight_map if n not in every and not n.startswith(IGNORED_PREFIXES))
    wrong_dtype, wrong_shape = [], []
    for n, spec in wanted.items():
        if n not in weight_map or n not in shards[weight_map[n]]:
            continue
        f = shards[weight_map[n]]
        if f.dtype(n) != spec.dtype:
            wrong_dtype.append(f"{n} [got {f.dtype(n)}, expected {spec.dtype}]")
        if f.shape(n) != spec.shape:
            wrong_shape.append(f"{n} [got {list(f.shape(n))}, expected {list(spec.shape)}]")
    problems = [(label, items) for label, items in (
        ("missing", missing),
        ("listed in the index but absent from the shard", absent),
        ("wrong dtype", sorted(wrong_dtype)),
        ("wrong shape", sorted(wrong_shape)),
        ("unexpected for this config", unexpected),
    ) if items]
    if problems:
        lines = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in problems]
        where = f"checkpoint {ckpt_dir}" if ckpt_dir is not None else "checkpoint"
        raise CheckpointError(f"{where} does not match its config:\n  " + "\n  ".join(lines))
    return wanted


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _tuples(tree):
    """Dicts keyed by the ints 0..n-1 (``layers.{L}``, ``mtp.{s}``) become tuples."""
    if isinstance(tree, dict):
        out = {k: _tuples(v) for k, v in tree.items()}
        if out and all(isinstance(k, int) for k in out):
            if sorted(out) != list(range(len(out))):
                raise CheckpointError(f"block indices {sorted(out)} are not 0..{len(out) - 1}")
            return tuple(out[i] for i in range(len(out)))
        return out
    return tree


def _read(f: SafetensorsFile, name: str, region: tuple | None) -> np.ndarray:
    """The tensor, or only its ``region`` (a slice per dim), as a host copy. A region that starts and ends
    on dim-0 boundaries touches only those rows' pages of the memory map."""
    if region is None:
        return f.read(name)
    e = f.header[name]
    lo, hi = e["data_offsets"]
    shape = tuple(e["shape"])
    dt = DTYPES[e["dtype"]]
    if hi == lo:
        return np.zeros(shape, dt)[region].copy()
    view = np.frombuffer(f._mm, dtype=dt, count=(hi - lo) // dt.itemsize, offset=f.data_start + lo).reshape(shape)
    out = view[region].copy()
    del view
    return out


def load_params(ckpt_dir: str | Path, cfg: ModelConfig | None = None, *, groups: Sequence[str] = (BACKBONE,),
                place: Place | None = None, progress: bool = True, stats: dict | None = None) -> dict:
    """The params pytree (docs/CONTRACTS.md) of the tensors of ``groups``, each leaf made by ``place``.

    ``cfg`` defaults to the checkpoint's own config.json. ``place(path, np_array) -> jax.Array`` receives
    each tensor (stacked experts as one [E, ...] array) as soon as it is complete. A ``place`` with a
    ``region(path, shape)`` method (``sharding.make_place``) gets only the region of each leaf this process
    holds, as ``place(path, array, region, stored_shape)``, and only that is read (module docstring).
    ``stats``, if given, receives what was read: ``bytes_read``, ``tensors_read``, ``files_read``.
    """
    ckpt_dir = Path(ckpt_dir)
    cfg = cfg if cfg is not None else ModelConfig.from_json(ckpt_dir)
    place = place or _default_place
    region_of = getattr(place, "region", None)
    weight_map = read_index(ckpt_dir)
    shards: dict[str, SafetensorsFile] = {}
    read_stats = {"bytes_read": 0, "tensors_read": 0, "files_read": []}
    try:
        for s in sorted(set(weight_map.values())):
            shards[s] = SafetensorsFile(ckpt_dir / s)
        wanted = validate_checkpoint(cfg, weight_map, shards, groups, ckpt_dir)
        stack_rows: dict[tuple, int] = defaultdict(int)  # stacked leaf -> number of experts
        for n in wanted:
            path, expert = param_path(n)
            if expert is not None:
                stack_rows[path] = max(stack_rows[path], expert + 1)
        # What this process needs of each leaf: None = all of it, else a slice per dim (stacked experts:
        # dim 0 is the expert index).
        regions: dict[tuple, tuple | None] = {}
        for n, spec in wanted.items():
            path, expert = param_path(n)
            if path in regions:
                continue
            shape = (stack_rows[path], *spec.shape) if expert is not None else tuple(spec.shape)
            regions[path] = region_of(path, shape) if region_of is not None else None

        def needed(n: str) -> bool:
            path, expert = param_path(n)
            r = regions[path]
            return r is None or expert is None or r[0].start <= expert < r[0].stop

        stacks: dict[tuple, np.ndarray] = {}  # stacked leaf -> preallocated host buffer [E (local), ...]
        rows_left: dict[tuple, int] = {}
        tree: dict = {}

        def finish(path: tuple, arr: np.ndarray, stored_shape: tuple) -> None:
            r = regions[path]
            _set(tree, path, place(path, arr) if r is None else place(path, arr, r, stored_shape))

        empty = sorted(".".join(map(str, p)) for p, r in regions.items()
                       if r is not None and any(x.start >= x.stop for x in r))
        if empty:  # every device of a mesh holds a part of every leaf: this process holds no mesh device
            raise CheckpointError(f"this process holds no part of {empty[:3]}: its devices are not in the mesh")
        # (regions: a tensor's region is read, not the whole of it; the bar then shows bytes, no total)
        total = None if region_of is not None else sum(shards[weight_map[n]].nbytes(n) for n in wanted)
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not progress) as bar:
            for shard_name, f in shards.items():
                bar.set_postfix_str(shard_name, refresh=False)
                mine = [n for n in f.names() if n in wanted and weight_map[n] == shard_name and needed(n)]
                if mine:
                    read_stats["files_read"].append(shard_name)
                # in file order: the page cache then reads each shard front to back
                for n in sorted(mine, key=lambda n: f.header[n]["data_offsets"][0]):
                    path, expert = param_path(n)
                    r = regions[path]
                    if expert is None:
                        arr = _read(f, n, r)
                        finish(path, arr, tuple(wanted[n].shape))
                    else:
                        arr = _read(f, n, None if r is None else r[1:])
                        lo, hi = (0, stack_rows[path]) if r is None else (r[0].start, r[0].stop)
                        if path not in stacks:
                            stacks[path] = np.empty((hi - lo, *arr.shape), arr.dtype)
                            rows_left[path] = hi - lo
                        stacks[path][expert - lo] = arr
                        rows_left[path] -= 1
                        if rows_left[path] == 0:
                            finish(path, stacks.pop(path), (stack_rows[path], *wanted[n].shape))
                    read_stats["bytes_read"] += arr.nbytes
                    read_stats["tensors_read"] += 1
                    bar.update(arr.nbytes)
                    del arr
        if stacks:  # unreachable after validation unless expert ids repeat
            raise CheckpointError(f"incomplete expert stacks: {sorted(map(str, stacks))}")
    finally:
        for f in shards.values():
            f.close()
    if stats is not None:
        stats.update(read_stats)
    return _tuples(tree)


def read_tensor(ckpt_dir: str | Path, name: str) -> np.ndarray:
    """One tensor by native name, as stored (a host copy); for tools and tests."""
    ckpt_dir = Path(ckpt_dir)
    weight_map = read_index(ckpt_dir)
    if name not in weight_map:
        raise CheckpointError(f"{ckpt_dir}: the index lists no tensor named {name!r}")
    with SafetensorsFile(ckpt_dir / weight_map[name]) as f:
        return f.read(name)
