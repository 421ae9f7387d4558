"""Load an official-format checkpoint into the params pytree, checking every tensor against the config.

Tensors are streamed shard by shard from memory maps and handed to ``place`` one at a time (the
sharding code passes a function that puts each array straight onto its NamedSharding), so host memory
stays at one tensor, or one layer's stacked experts, at a time. Weights stay in their stored formats.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from deepinfer_jax.checkpoint.names import DTYPES, param_path
from deepinfer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, read_index
from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, IGNORED_PREFIXES, TensorSpec, expected_tensors
from deepinfer_jax.config import ModelConfig

Place = Callable[[tuple, np.ndarray], jax.Array]

__all__ = ["CheckpointError", "load_params", "read_tensor", "validate_checkpoint"]


def _default_place(path: tuple, arr: np.ndarray) -> jax.Array:
    return jax.device_put(arr)


def _open_shards(ckpt_dir: Path, weight_map: dict[str, str]) -> dict[str, SafetensorsFile]:
    return {s: SafetensorsFile(ckpt_dir / s) for s in sorted(set(weight_map.values()))}


def validate_checkpoint(cfg: ModelConfig, weight_map: dict[str, str], shards: dict[str, SafetensorsFile],
                        groups: tuple[str, ...]) -> dict[str, TensorSpec]:
    """Every problem at once: missing, unexpected, wrong dtype, wrong shape. -> the specs to load."""
    every = expected_tensors(cfg)
    wanted = {n: s for n, s in every.items() if s.group in groups}
    missing = sorted(n for n in wanted if n not in weight_map)
    unexpected = sorted(n for n in weight_map if n not in every and not n.startswith(IGNORED_PREFIXES))
    not_in_shard = sorted(n for n in wanted if n in weight_map and n not in shards[weight_map[n]].header)
    bad = []
    for n, spec in wanted.items():
        if n not in weight_map or n in not_in_shard:
            continue
        f = shards[weight_map[n]]
        if f.dtype(n) != spec.dtype:
            bad.append(f"{n}: dtype {f.dtype(n)}, expected {spec.dtype}")
        elif f.shape(n) != spec.shape:
            bad.append(f"{n}: shape {list(f.shape(n))}, expected {list(spec.shape)}")
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if not_in_shard:
        problems.append(f"index lists tensor(s) absent from their shard: {', '.join(not_in_shard[:20])}")
    if unexpected:
        problems.append(f"unexpected tensor(s) for this config: {', '.join(unexpected[:20])}")
    if bad:
        problems.append("wrong dtype/shape: " + "; ".join(bad[:20]) + (" ..." if len(bad) > 20 else ""))
    if problems:
        raise CheckpointError("checkpoint does not match its config:\n  " + "\n  ".join(problems))
    return wanted


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _tuples(tree):
    """Dicts keyed by consecutive ints (layers.{L}, mtp.{s}) become tuples."""
    if isinstance(tree, dict):
        out = {k: _tuples(v) for k, v in tree.items()}
        if out and all(isinstance(k, int) for k in out):
            return tuple(out[i] for i in range(len(out)))
        return out
    return tree


def load_params(ckpt_dir: str | Path, cfg: ModelConfig | None = None, *, groups: tuple[str, ...] = (BACKBONE,),
                place: Place | None = None, progress: bool = True) -> dict:
    ckpt_dir = Path(ckpt_dir)
    cfg = cfg or ModelConfig.from_json(ckpt_dir)
    place = place or _default_place
    weight_map = read_index(ckpt_dir)
    shards = _open_shards(ckpt_dir, weight_map)
    try:
        wanted = validate_checkpoint(cfg, weight_map, shards, groups)
        # stacked expert leaves: path -> (buffer [E, ...], rows still to fill)
        n_experts = defaultdict(int)
        for n in wanted:
            path, e = param_path(n)
            if e is not None:
                n_experts[path] += 1
        buffers: dict[tuple, list] = {}
        tree: dict = {}
        total = sum(np.prod(s.shape) * DTYPES[s.dtype].itemsize for s in wanted.values())
        bar = tqdm(total=int(total), unit="B", unit_scale=True, desc="loading", disable=not progress)
        for shard_name, f in shards.items():
            for n in f.names():
                if n not in wanted:
                    continue
                arr = f.read(n)
                path, e = param_path(n)
                if e is None:
                    _set(tree, path, place(path, arr))
                else:
                    if path not in buffers:
                        buffers[path] = [np.empty((n_experts[path], *arr.shape), arr.dtype), n_experts[path]]
                    buf = buffers[path]
                    if not 0 <= e < buf[0].shape[0]:
                        raise CheckpointError(f"{n}: expert index {e} out of range [0, {buf[0].shape[0]})")
                    buf[0][e] = arr
                    buf[1] -= 1
                    if buf[1] == 0:
                        _set(tree, path, place(path, buf[0]))
                        del buffers[path]
                bar.update(arr.nbytes)
        bar.close()
        if buffers:
            raise CheckpointError(f"incomplete expert stacks: {sorted(map(str, buffers))}")
    finally:
        for f in shards.values():
            f.close()
    return _tuples(tree)


def read_tensor(ckpt_dir: str | Path, name: str) -> np.ndarray:
    """One tensor by native name, as stored (a copy)."""
    ckpt_dir = Path(ckpt_dir)
    weight_map = read_index(ckpt_dir)
    if name not in weight_map:
        raise CheckpointError(f"{ckpt_dir}: no tensor named {name!r}")
    with SafetensorsFile(ckpt_dir / weight_map[name]) as f:
        return f.read(name)
