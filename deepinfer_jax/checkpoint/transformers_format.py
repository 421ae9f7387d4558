"""Load a transformers-spelled V4-Flash checkpoint (a HF re-upload, or ``DeepseekV4ForCausalLM``'s own
state dict saved as safetensors) into the same params pytree as ``loader.load_params``.

Names are mapped with ``hf_names`` onto the native list of ``tensor_specs``, and stacked routed experts
are split per expert, so the set of names and every shape is checked against the config exactly as for
an official checkpoint. Dtypes may differ from the official ones (re-uploads are often BF16 or fp32, with
no FP8 scales): a tensor is accepted in any float dtype when the native one is a float or an FP8 weight
without its scale; the model then runs the weight as stored (``linear.weight_of`` without a scale).
Small checkpoints only: every tensor is read into host memory (the official loader streams instead).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from deepinfer_jax.checkpoint import hf_names
from deepinfer_jax.checkpoint.loader import _set, _tuples
from deepinfer_jax.checkpoint.names import param_path
from deepinfer_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, read_index
from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, expected_tensors
from deepinfer_jax.config import ModelConfig

_FLOAT_STORED = {"BF16", "F32", "F16"}


def read_native_tensors(ckpt_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint under its native name (stacked experts split per expert)."""
    ckpt_dir = Path(ckpt_dir)
    weight_map = read_index(ckpt_dir)
    out: dict[str, np.ndarray] = {}
    sources: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        with SafetensorsFile(ckpt_dir / shard) as f:
            for name in f.names():
                native = hf_names.to_native(name)
                arr = f.read(name)
                parts = (hf_names.split_stacked_experts(native, arr) if hf_names.is_stacked_experts(native)
                         else {native: arr})
                for n, a in parts.items():
                    if n in out:
                        raise CheckpointError(f"{ckpt_dir}: {name!r} and {sources[n]!r} both map to {n!r}")
                    out[n], sources[n] = a, name
    return out


def load_transformers_params(ckpt_dir: str | Path, cfg: ModelConfig | None = None, *,
                             groups: Sequence[str] = (BACKBONE,)) -> dict:
    """The params pytree of a transformers-spelled checkpoint; raises CheckpointError listing every
    missing, unexpected or wrongly shaped tensor (by native name)."""
    ckpt_dir = Path(ckpt_dir)
    cfg = cfg if cfg is not None else ModelConfig.from_json(ckpt_dir)
    tensors = read_native_tensors(ckpt_dir)
    every = expected_tensors(cfg)
    wanted = {n: s for n, s in every.items() if s.group in groups}
    # FP8 scales are optional here (an unquantized re-upload has none); everything else must be present.
    missing = sorted(n for n, s in wanted.items() if n not in tensors and not (s.dtype == "F8_E8M0"))
    unexpected = sorted(n for n in tensors if n not in every)
    bad = []
    for n, spec in wanted.items():
        if n not in tensors:
            continue
        a = tensors[n]
        is_float = np.issubdtype(np.dtype(a.dtype), np.floating) or a.dtype.kind == "V"
        stored_float = spec.dtype in _FLOAT_STORED or spec.dtype == "F8_E4M3"
        shape = spec.shape
        if spec.dtype == "I8" and is_float:  # unquantized FP4 experts: [out, in], not packed [out, in / 2]
            shape = (*shape[:-1], 2 * shape[-1])
        if tuple(a.shape) != shape:
            bad.append(f"{n} [got shape {list(a.shape)}, expected {list(shape)}]")
        elif stored_float and not is_float:
            bad.append(f"{n} [got dtype {a.dtype}, expected a float]")
    if missing or unexpected or bad:
        lines = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in
                 (("missing", missing), ("unexpected for this config", unexpected), ("wrong", bad)) if items]
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match its config:\n  " + "\n  ".join(lines))
    tree: dict = {}
    stacks: dict[tuple, dict[int, np.ndarray]] = defaultdict(dict)
    for n in wanted:
        if n not in tensors:
            continue
        path, expert = param_path(n)
        if expert is None:
            _set(tree, path, jax.device_put(tensors[n]))
        else:
            stacks[path][expert] = tensors[n]
    for path, rows in stacks.items():
        _set(tree, path, jax.device_put(np.stack([rows[e] for e in range(len(rows))])))
    return _tuples(tree)
