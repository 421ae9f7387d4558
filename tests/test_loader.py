"""Checkpoint I/O and the loader: the official tensor totals, a seeded tiny checkpoint generated here and
loaded (contract dtypes/shapes, bitwise round trip, stacking across shards, the place hook), the
committed checkpoint being current, and a clear error naming the offender for every kind of bad input."""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.checkpoint.loader import CheckpointError, load_params, read_tensor
from deepinfer_jax.checkpoint.names import native_name, param_path
from deepinfer_jax.checkpoint.safetensors_io import INDEX_NAME, SafetensorsFile, read_index, write_checkpoint
from deepinfer_jax.checkpoint.tensor_specs import expected_tensors
from deepinfer_jax.config import ConfigError, ModelConfig
from deepinfer_jax.engine.token_map import compressed_token_map
from deepinfer_jax.model.engram_hash import engram_primes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "checkpoints"))
import make_tiny  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "v41_flash_config.json"
ALL_GROUPS = ("backbone", "image", "dspark")
# docs/CONTRACTS.md, written out here rather than taken from names.py so that a wrong table there fails
CONTRACT_DTYPES = {"BF16": jnp.bfloat16, "F32": jnp.float32, "F8_E4M3": jnp.float8_e4m3fn,
                   "F8_E8M0": jnp.float8_e8m0fnu, "I8": jnp.uint8}
ELEMENT_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    return make_tiny.write_tiny(tmp_path_factory.mktemp("gen") / "tiny", seed=0)["out"]


@pytest.fixture(scope="module")
def gen_cfg(generated) -> ModelConfig:
    return ModelConfig.from_json(generated)


@pytest.fixture(scope="module")
def gen_params(generated, gen_cfg):
    return load_params(generated, gen_cfg, groups=ALL_GROUPS, progress=False)


def _leaf(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _read_all(ck: Path) -> dict[str, np.ndarray]:
    weight_map = read_index(ck)
    out = {}
    for shard in sorted(set(weight_map.values())):
        with SafetensorsFile(ck / shard) as f:
            out.update({n: f.read(n) for n in f.names()})
    return {n: out[n] for n in weight_map}


def test_tensor_list_reproduces_the_official_totals():
    specs = expected_tensors(ModelConfig.from_json(FIXTURE))
    assert len(specs) == 95_822  # text + DSpark tensors; HF's 96,085 adds 263 vision tensors
    assert sum(math.prod(s.shape) * ELEMENT_BYTES[s.dtype] for s in specs.values()) == 509_315_516_760
    assert sum(math.prod(s.shape) for s in specs.values() if s.dtype == "F8_E4M3") == 204_015_223_296


def test_names_round_trip():
    assert param_path("layers.3.ffn.experts.5.w1.weight") == (("layers", 3, "ffn", "experts", "w1", "weight"), 5)
    assert param_path("mtp.2.markov_head.embed.weight") == (("mtp", 2, "markov_head", "embed", "weight"), None)
    for name in expected_tensors(ModelConfig.from_json(FIXTURE)):
        assert native_name(*param_path(name)) == name


def test_generated_config_and_vocab_rows(generated, gen_cfg):
    cfg = gen_cfg
    assert list(cfg.engram_num_embeddings) == [sum(map(sum, engram_primes(cfg, lid))) for lid in cfg.engram_layer_ids]
    _, n_keys = compressed_token_map(generated / "tokenizer.json", cfg.vocab_size)
    assert cfg.engram_compressed_vocab_size == n_keys
    defined = make_tiny.defined_token_ids(generated / "tokenizer.json")
    assert 1000 < len(defined) < 3000 and defined.max() < cfg.vocab_size
    for name in ("embed.weight", "head.weight", "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight"):
        w = read_tensor(generated, name).astype(np.float32)
        nonzero_rows = np.flatnonzero(np.abs(w).sum(1))
        assert np.array_equal(nonzero_rows, defined), name  # undefined ids: zero rows; defined ones: random
    shards = sorted(generated.glob("model-*.safetensors"))
    assert 3 <= len(shards) <= 4 and all(p.name.endswith(f"-of-{len(shards):05d}.safetensors") for p in shards)
    index = json.loads((generated / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(
        math.prod(s.shape) * ELEMENT_BYTES[s.dtype] for s in expected_tensors(cfg).values())


def test_every_leaf_has_the_contract_dtype_and_shape(generated, gen_cfg, gen_params):
    specs = expected_tensors(gen_cfg)
    want: dict[tuple, tuple] = {}
    for name, spec in specs.items():
        path, expert = param_path(name)
        shape = spec.shape
        if expert is not None:
            n = gen_cfg.n_routed_experts if path[0] == "layers" else gen_cfg.dspark_n_routed_experts
            shape = (n, *shape)
        want[path] = (shape, CONTRACT_DTYPES[spec.dtype])
    got = {tuple(k.key if hasattr(k, "key") else k.idx for k in kp): v
           for kp, v in jax.tree_util.tree_flatten_with_path(gen_params)[0]}
    assert set(got) == set(want)  # no leaf missing, none extra
    for path, (shape, dtype) in want.items():
        assert got[path].shape == shape and got[path].dtype == dtype, path
    assert isinstance(gen_params["layers"], tuple) and len(gen_params["layers"]) == gen_cfg.num_hidden_layers
    assert isinstance(gen_params["mtp"], tuple) and len(gen_params["mtp"]) == gen_cfg.num_nextn_predict_layers
    backbone = load_params(generated, gen_cfg, progress=False)  # default: backbone only
    assert "mtp" not in backbone and "image_start" not in backbone and "layers" in backbone


def test_write_read_round_trip_is_bitwise(generated, gen_cfg, gen_params):
    defined = make_tiny.defined_token_ids(generated / "tokenizer.json")
    tensors, dtypes = make_tiny.make_tensors(gen_cfg, defined, seed=0)
    weight_map = read_index(generated)
    assert set(weight_map) == set(tensors)
    shards = {s: SafetensorsFile(generated / s) for s in set(weight_map.values())}
    try:
        for name, arr in tensors.items():
            f = shards[weight_map[name]]
            back = f.read(name)
            assert f.dtype(name) == dtypes[name] and back.dtype == arr.dtype and back.shape == arr.shape, name
            assert back.tobytes() == arr.tobytes(), name
            path, expert = param_path(name)  # and the loaded leaf holds the same bytes
            leaf = np.asarray(_leaf(gen_params, path))
            assert (leaf if expert is None else leaf[expert]).tobytes() == arr.tobytes(), name
    finally:
        for f in shards.values():
            f.close()


def test_generator_is_deterministic_and_seeded(generated, gen_cfg, tmp_path):
    again = make_tiny.write_tiny(tmp_path / "again", seed=0)["out"]
    for f in sorted(generated.iterdir()):
        assert f.read_bytes() == (again / f.name).read_bytes(), f.name
    defined = make_tiny.defined_token_ids(generated / "tokenizer.json")
    other, _ = make_tiny.make_tensors(gen_cfg, defined, seed=1)
    assert other["layers.0.attn.wq_a.weight"].tobytes() != read_tensor(generated, "layers.0.attn.wq_a.weight").tobytes()


def test_committed_checkpoint_is_what_make_tiny_writes(generated, tiny_ckpt):
    names = sorted(p.name for p in generated.iterdir())
    assert sorted(p.name for p in tiny_ckpt.iterdir()) == names
    for name in names:
        assert (tiny_ckpt / name).read_bytes() == (generated / name).read_bytes(), (
            f"{tiny_ckpt / name} is stale: regenerate with python checkpoints/make_tiny.py")


def test_experts_stack_across_shards_and_place_sees_each_leaf_once(generated, gen_cfg, gen_params, tmp_path):
    tensors = _read_all(generated)
    dtypes = {n: s.dtype for n, s in expected_tensors(gen_cfg).items()}
    w1 = "layers.0.ffn.experts.0.w1.weight"
    # shards smaller than one block's experts: the writer must spill them and the loader restack them
    block_experts = sum(a.nbytes for n, a in tensors.items() if n.startswith("layers.0.ffn.experts."))
    paths = write_checkpoint(tmp_path, tensors, dtypes, max_shard_bytes=block_experts // 3)
    (tmp_path / "config.json").write_bytes((generated / "config.json").read_bytes())
    wm = read_index(tmp_path)
    assert len({wm[f"layers.0.ffn.experts.{e}.w1.weight"] for e in range(gen_cfg.n_routed_experts)}) > 1
    seen = []

    def place(path, arr):
        seen.append((path, arr.shape))
        return jax.device_put(arr)

    params = load_params(tmp_path, groups=ALL_GROUPS, place=place, progress=False)
    assert len(seen) == len({p for p, _ in seen}) == len(jax.tree_util.tree_leaves(params))
    assert dict(seen)[param_path(w1)[0]] == (gen_cfg.n_routed_experts, *tensors[w1].shape)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(gen_params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert len(paths) > 4
    # with room, one block's experts stay in one shard
    write_checkpoint(tmp_path / "roomy", tensors, dtypes, max_shard_bytes=4 * block_experts)
    wm = read_index(tmp_path / "roomy")
    for layer in range(gen_cfg.num_hidden_layers):
        assert len({s for n, s in wm.items() if n.startswith(f"layers.{layer}.ffn.experts.")}) == 1


def test_reader_agrees_with_the_safetensors_package(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    theirs = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
              "c": rng.integers(-128, 128, size=(2, 8)).astype(np.int8)}
    safetensors_numpy.save_file(theirs, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "theirs.safetensors") as f:
        assert f.dtype("c") == "I8" and f.read("c").tobytes() == theirs["c"].tobytes()
        assert np.array_equal(f.read("a"), theirs["a"]) and np.array_equal(f.read("b"), theirs["b"])
    ours = {"x": theirs["a"], "y": np.ones((2, 3), ml_dtypes.bfloat16), "z": theirs["b"]}
    write_checkpoint(tmp_path / "ours", ours, {"x": "F32", "y": "BF16", "z": "I64"}, max_shard_bytes=1 << 20)
    with safe_open(str(tmp_path / "ours" / "model-00001-of-00001.safetensors"), "numpy") as f:
        assert set(f.keys()) == {"x", "y", "z"} and f.metadata() == {"format": "pt"}
        assert np.array_equal(f.get_tensor("x"), ours["x"]) and np.array_equal(f.get_tensor("z"), ours["z"])


# ------------------------------------------------------------------------------------------------------
# bad checkpoints: each error names the offending tensor / file

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(path: Path, edit) -> None:
    """Rewrite one shard with ``edit(header, data) -> (header, data)``."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _edit_index(ck: Path, edit) -> None:
    index = json.loads((ck / INDEX_NAME).read_text())
    edit(index["weight_map"])
    (ck / INDEX_NAME).write_text(json.dumps(index))


def _shard_of(ck: Path, name: str) -> Path:
    return ck / read_index(ck)[name]


def _load_error(ck: Path, **kw) -> str:
    with pytest.raises(CheckpointError) as ei:
        load_params(ck, progress=False, **kw)
    return str(ei.value)


def test_missing_tensors_are_all_named(generated, tmp_path):
    ck = _copy(generated, tmp_path / "ck")
    gone = ["layers.2.attn.compressor.wgate.weight", "layers.5.ffn.experts.7.w2.scale"]
    _edit_index(ck, lambda wm: [wm.pop(n) for n in gone])
    msg = _load_error(ck)
    assert f"missing (2): {gone[0]}, {gone[1]}" in msg


def test_index_naming_a_tensor_its_shard_lacks(generated, tmp_path):
    ck = _copy(generated, tmp_path / "ck")
    name = "layers.1.engram.q_weight"
    shard = _shard_of(ck, name)
    other = next(p.name for p in ck.glob("model-*.safetensors") if p != shard)
    _edit_index(ck, lambda wm: wm.__setitem__(name, other))
    assert f"listed in the index but absent from the shard (1): {name} [{other}]" in _load_error(ck)
    with pytest.raises(CheckpointError, match=rf"{other}: no tensor named '{name}'"):
        read_tensor(ck, name)


def test_wrong_shape_and_dtype_are_named_together(generated, tmp_path):
    ck = _copy(generated, tmp_path / "ck")
    shard = _shard_of(ck, "layers.0.attn.q_norm.weight")

    def edit(h, data):
        h["layers.0.attn.q_norm.weight"]["dtype"] = "F16"  # same element size, wrong dtype
        kv = h["layers.0.attn.kv_norm.weight"]
        kv["shape"] = [2, kv["shape"][0] // 2]  # same bytes, wrong shape
        return h, data

    _rewrite_shard(shard, edit)
    msg = _load_error(ck)
    assert "wrong dtype (1): layers.0.attn.q_norm.weight [got F16, expected BF16]" in msg
    assert "wrong shape (1): layers.0.attn.kv_norm.weight [got [2, 32], expected [64]]" in msg


def test_checkpoint_of_another_config_is_rejected_with_every_mismatch(generated, gen_cfg):
    raw = json.loads((generated / "config.json").read_text())
    raw["text_config"]["n_routed_experts"] = 6
    msg = _load_error(generated, cfg=ModelConfig.from_dict(raw))
    assert "unexpected for this config (" in msg and "layers.0.ffn.experts.7.w1.weight" in msg
    assert "layers.11.ffn.gate.weight [got [8, 64], expected [6, 64]]" in msg


def test_unexpected_tensor_is_named_and_vision_is_ignored(generated, tmp_path):
    ck = _copy(generated, tmp_path / "ck")
    shard = _shard_of(ck, "norm.weight")

    def add(names):
        def edit(h, data):
            for n in names:
                h[n] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]}
                data += bytes(8)
            return h, data
        return edit

    _rewrite_shard(shard, add(["vision.blocks.0.norm.weight", "aligner.proj.weight"]))
    _edit_index(ck, lambda wm: wm.update({"vision.blocks.0.norm.weight": shard.name, "aligner.proj.weight": shard.name}))
    load_params(ck, progress=False)  # the vision tower is not ours to load, and not an error
    _rewrite_shard(shard, add(["layers.0.attn.q_norm.extra"]))
    _edit_index(ck, lambda wm: wm.update({"layers.0.attn.q_norm.extra": shard.name}))
    assert "unexpected for this config (1): layers.0.attn.q_norm.extra" in _load_error(ck)


def test_corrupt_headers_name_the_file_and_tensor(generated, tmp_path):
    ck = _copy(generated, tmp_path / "ck")
    shard = _shard_of(ck, "norm.weight")
    raw = shard.read_bytes()
    shard.write_bytes(raw[:8] + b"{not json" + raw[17:])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt JSON header"):
        load_params(ck, progress=False)
    shard.write_bytes(struct.pack("<Q", 10**12) + raw[8:])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt header length 1000000000000 \(file is"):
        load_params(ck, progress=False)
    shard.write_bytes(raw)

    def bad_offsets(h, data):
        lo, hi = h["norm.weight"]["data_offsets"]
        h["norm.weight"]["data_offsets"] = [lo, hi + 2]
        return h, data

    _rewrite_shard(shard, bad_offsets)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt header: tensor 'norm.weight' offsets"):
        load_params(ck, progress=False)
    _rewrite_shard(shard, lambda h, data: ({k: v for k, v in h.items() if k != "norm.weight"} |
                                           {"norm.weight": {"dtype": "BF16", "shape": [64]}}, data))
    with pytest.raises(CheckpointError, match=r"header entry of tensor 'norm.weight' lacks a valid"):
        load_params(ck, progress=False)


def test_truncated_shard_names_file_and_tensor(generated, tmp_path):
    ck = _copy(generated, tmp_path / "ck")
    shard = sorted(ck.glob("model-*.safetensors"))[-1]
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: tensor '[^']+' ends at byte \d+ of the data "
                                              rf"section but the file holds only \d+"):
        load_params(ck, progress=False)
    shard.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated \(5 bytes"):
        load_params(ck, progress=False)


def test_missing_shard_and_bad_index_are_named(generated, tmp_path):
    ck = _copy(generated, tmp_path / "ck")
    victim = sorted(ck.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"points at missing shard\(s\): \['{victim.name}'\] \(first tensor"):
        load_params(ck, progress=False)
    (ck / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=rf"{INDEX_NAME}: not a valid index json"):
        load_params(ck, progress=False)
    with pytest.raises(CheckpointError, match=r"the index lists no tensor named 'nope'"):
        read_tensor(generated, "nope")
    with pytest.raises(ValueError, match=r"unknown tensor group\(s\) \['vision'\]"):
        load_params(generated, groups=("backbone", "vision"), progress=False)


def test_bad_config_keys_are_named(generated):
    raw = json.loads((generated / "config.json").read_text())
    raw["text_config"]["n_routed_expert"] = 8
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['n_routed_expert'\]"):
        ModelConfig.from_dict(raw)
    raw = json.loads((generated / "config.json").read_text())
    del raw["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match=r"required key 'hidden_size' is missing"):
        ModelConfig.from_dict(raw)
