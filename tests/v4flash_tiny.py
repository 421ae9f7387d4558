"""A tiny random V4-Flash checkpoint in transformers' spelling (shared by the V4-Flash tests).

The weights are float32 with no FP8 scales, so transformers' ``DeepseekV4ForCausalLM`` and our model read
exactly the same numbers; the tensor set is the native list of ``tensor_specs`` (MTP included) renamed
by ``hf_names``. Scales are picked so that every part of the block matters: mHC mixes of O(1), logits
of O(1) spread, compressor gates with a visible position bias.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from checkpoints.tiny_configs import TINY_V4FLASH
from deepinfer_jax.checkpoint import hf_names
from deepinfer_jax.checkpoint.safetensors_io import write_checkpoint
from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, DSPARK, expected_tensors
from deepinfer_jax.config import ModelConfig


def random_native_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, spec in expected_tensors(cfg).items():
        if spec.group not in (BACKBONE, DSPARK) or spec.dtype == "F8_E8M0":
            continue  # no FP8 scales: the weights are stored unquantized
        shape = spec.shape
        if spec.dtype == "I8":  # packed FP4 stores two values per byte; unquantized it is [out, in]
            shape = (*shape[:-1], 2 * shape[-1])
        if spec.dtype == "I64":  # tid2eid: k distinct experts per token id
            out[name] = np.stack([rng.permutation(cfg.n_routed_experts)[:shape[1]] for _ in range(shape[0])])
            continue
        leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
        if leaf.endswith("norm"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf.endswith("_fn"):
            a = 0.05 * rng.standard_normal(shape)
        elif leaf.endswith("_base") or leaf == "ape":
            a = 0.5 * rng.standard_normal(shape)
        elif leaf.endswith("_scale"):
            a = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf in ("attn_sink",):
            a = rng.standard_normal(shape)
        elif leaf == "bias":
            a = 0.1 * rng.standard_normal(shape)
        elif leaf == "embed":
            a = rng.standard_normal(shape)
        else:  # a linear [out, in]
            a = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = a.astype(np.float32)
    return out


def to_transformers_tensors(cfg: ModelConfig, native: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Native names -> transformers' module spelling, routed experts stacked per block."""
    blocks = [f"layers.{i}" for i in range(cfg.num_hidden_layers)]
    blocks += [f"mtp.{s}" for s in range(cfg.num_nextn_predict_layers)]
    out = {hf_names.to_transformers(n): a for n, a in native.items() if ".ffn.experts." not in n}
    for b in blocks:
        out.update(hf_names.stack_experts(native, b, cfg.n_routed_experts))
    return out


def write_tiny_v4flash(out_dir: Path, seed: int = 0) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """config.json (official V4-Flash layout) + transformers-spelled float32 shards -> (cfg, native tensors)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(TINY_V4FLASH, indent=2) + "\n")
    cfg = ModelConfig.from_json(out_dir)
    native = random_native_tensors(cfg, seed)
    hf = to_transformers_tensors(cfg, native)
    dtypes = {n: "I64" if a.dtype == np.int64 else "F32" for n, a in hf.items()}
    write_checkpoint(out_dir, hf, dtypes, max_shard_bytes=1 << 30)
    return cfg, native
