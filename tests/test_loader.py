"""Loader: round trip, leaf dtypes/shapes, and a clear error for every kind of bad checkpoint."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.checkpoint.loader import CheckpointError, load_params, read_tensor
from deepinfer_jax.checkpoint.names import param_path
from deepinfer_jax.checkpoint.safetensors_io import INDEX_NAME, SafetensorsFile
from deepinfer_jax.checkpoint.tensor_specs import expected_tensors
from deepinfer_jax.config import ConfigError, ModelConfig

FIXTURE = Path(__file__).parent / "fixtures" / "v41_flash_config.json"
JNP = {"BF16": jnp.bfloat16, "F32": jnp.float32, "F8_E4M3": jnp.float8_e4m3fn, "F8_E8M0": jnp.float8_e8m0fnu,
       "I8": jnp.uint8}


def test_tensor_list_reproduces_the_official_totals():
    specs = expected_tensors(ModelConfig.from_json(FIXTURE))
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
    assert len(specs) == 95_822  # text + DSpark tensors; HF's 96,085 adds 263 vision tensors
    assert sum(math.prod(s.shape) * size[s.dtype] for s in specs.values()) == 509_315_516_760
    assert sum(math.prod(s.shape) for s in specs.values() if s.dtype == "F8_E4M3") == 204_015_223_296


def test_every_leaf_has_the_contract_dtype_and_shape(tiny_ckpt, tiny_cfg, tiny_params):
    for name, spec in expected_tensors(tiny_cfg).items():
        if spec.group != "backbone":
            continue
        path, expert = param_path(name)
        leaf = tiny_params
        for k in path:
            leaf = leaf[k]
        shape = spec.shape if expert is None else (tiny_cfg.n_routed_experts, *spec.shape)
        assert leaf.shape == shape and leaf.dtype == JNP[spec.dtype], name
    w = tiny_params["layers"][3]["ffn"]["experts"]["w2"]["weight"][5]
    assert np.array_equal(np.asarray(w), read_tensor(tiny_ckpt, "layers.3.ffn.experts.5.w2.weight"))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(path: Path, edit) -> None:
    """Rewrite one shard with ``edit(header) -> header`` (data bytes kept)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    header, data = edit(header, data)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX_NAME).read_text())["weight_map"][name]


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path / "ck")
    index = json.loads((ck / INDEX_NAME).read_text())
    del index["weight_map"]["layers.2.attn.compressor.wgate.weight"]
    (ck / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): layers\.2\.attn\.compressor\.wgate\.weight"):
        load_params(ck, progress=False)


def test_wrong_shape_and_dtype_are_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path / "ck")
    shard = _shard_of(ck, "layers.0.attn.q_norm.weight")

    def edit(h, data):
        e = h["layers.0.attn.q_norm.weight"]
        e["dtype"], e["shape"] = "F16", e["shape"]  # same size, wrong dtype
        h["layers.0.attn.kv_norm.weight"]["shape"] = [2, h["layers.0.attn.kv_norm.weight"]["shape"][0] // 2]
        return h, data

    _rewrite_shard(shard, edit)
    with pytest.raises(CheckpointError) as ei:
        load_params(ck, progress=False)
    msg = str(ei.value)
    assert "layers.0.attn.q_norm.weight: dtype F16, expected BF16" in msg
    assert "layers.0.attn.kv_norm.weight: shape [2, 32], expected [64]" in msg


def test_unexpected_tensor_is_named(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path / "ck")
    index = json.loads((ck / INDEX_NAME).read_text())
    shard = index["weight_map"]["norm.weight"]
    index["weight_map"]["layers.0.attn.q_norm.extra"] = shard
    (ck / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) for this config: layers\.0\.attn\.q_norm\.extra"):
        load_params(ck, progress=False)


def test_corrupt_header_truncated_shard_missing_shard(tiny_ckpt, tmp_path):
    ck = _copy(tiny_ckpt, tmp_path / "a")
    shard = _shard_of(ck, "norm.weight")
    raw = shard.read_bytes()
    shard.write_bytes(raw[:8] + b"{not json" + raw[17:])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt JSON header"):
        load_params(ck, progress=False)
    shard.write_bytes(struct.pack("<Q", 10**12) + raw[8:])
    with pytest.raises(CheckpointError, match=r"corrupt header length"):
        SafetensorsFile(shard)
    shard.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: tensor '.*' ends at byte"):
        load_params(ck, progress=False)
    ck2 = _copy(tiny_ckpt, tmp_path / "b")
    victim = sorted(ck2.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"points at missing shard\(s\): \['{victim.name}'\]"):
        load_params(ck2, progress=False)


def test_bad_config_keys_are_named(tiny_ckpt, tmp_path):
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    raw["text_config"]["n_routed_expert"] = 8
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['n_routed_expert'\]"):
        ModelConfig.from_dict(raw)
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    raw["text_config"]["compress_ratios"][5] = 1
    with pytest.raises(ConfigError, match=r"layer 5 has compress ratio 1 but its KV source 4 has ratio 2"):
        ModelConfig.from_dict(raw)
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    del raw["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match=r"required key 'hidden_size' is missing"):
        ModelConfig.from_dict(raw)


def test_generator_is_deterministic(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
    import make_tiny

    a = make_tiny.main(["--out", str(tmp_path / "a"), "--seed", "3"])
    b = make_tiny.main(["--out", str(tmp_path / "b"), "--seed", "3"])
    for f in sorted(a.iterdir()):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
