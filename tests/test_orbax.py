"""Orbax checkpoints: conversion from the official format keeps every byte, lays each array out in
one chunk per device shard, loads onto the mesh it was made for and onto others; two processes of a
simulated 2-host run each read only about their half; the errors name the directory."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from deepinfer_jax.checkpoint.orbax_io import (LAYOUT_FILE, OrbaxCheckpointError, convert_to_orbax, load_orbax,
                                               read_layout)
from deepinfer_jax.sharding import ShardingError, make_mesh, tree_paths
from test_sharding import ROOT, mesh_test_config, multidev, run_multidevice, run_two_processes


def _bytes_equal(loaded, ref) -> list:
    """Paths whose loaded leaf differs from the reference (a padded table compares on its real rows)."""
    bad = []
    for (path, a), b in zip(tree_paths(loaded), jax.tree.leaves(ref)):
        a = np.asarray(a)[tuple(slice(0, n) for n in b.shape)]
        if a.dtype != b.dtype or not np.array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8)):
            bad.append(path)
    return bad


def write_synthetic_checkpoint(cfg, out: Path, seed: int = 0) -> Path:
    """An official-format checkpoint of ``cfg`` with random, properly quantized tensors (make_tiny's
    generator; every vocabulary row defined, so nothing compresses away)."""
    sys.path.insert(0, str(ROOT / "checkpoints"))
    from make_tiny import make_tensors
    from deepinfer_jax.checkpoint.safetensors_io import write_checkpoint

    tensors, dtypes = make_tensors(cfg, np.arange(cfg.vocab_size), seed)
    total = sum(a.nbytes for a in tensors.values())
    write_checkpoint(out, tensors, dtypes, max_shard_bytes=math.ceil(total / 3))
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return out


# ------------------------------------------------------------------------------------------------------
# One device


@pytest.fixture(scope="module")
def tiny_orbax(tmp_path_factory, tiny_ckpt):
    dst = tmp_path_factory.mktemp("orbax") / "tiny"
    return convert_to_orbax(tiny_ckpt, dst, "data=1", progress=False)


def test_round_trip_is_bitwise(tiny_orbax, tiny_params):
    params = load_orbax(tiny_orbax)
    assert jax.tree.structure(params) == jax.tree.structure(tiny_params)
    assert isinstance(params["layers"], tuple)
    assert _bytes_equal(params, tiny_params) == []
    assert jax.tree.leaves(params)[0].dtype == jax.tree.leaves(tiny_params)[0].dtype


def test_layout_record_and_copied_files(tiny_orbax, tiny_ckpt):
    layout = read_layout(tiny_orbax)
    assert layout["mesh"] == "data=1,tensor=1,expert=1" and layout["groups"] == ["backbone"]
    assert layout["rules"]["experts"] == ["tensor", "expert"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_orbax / name).read_bytes() == (tiny_ckpt / name).read_bytes()


def test_errors_name_the_directory(tiny_orbax, tiny_ckpt, tmp_path):
    with pytest.raises(OrbaxCheckpointError, match=f"{tiny_ckpt}: no {LAYOUT_FILE}"):
        load_orbax(tiny_ckpt)
    with pytest.raises(OrbaxCheckpointError, match="exists and is not empty"):
        convert_to_orbax(tiny_ckpt, tiny_orbax, "data=1", progress=False)
    with pytest.raises(ShardingError, match="needs 8 devices"):
        convert_to_orbax(tiny_ckpt, tmp_path / "x", "expert=8", progress=False)
    with pytest.raises(OrbaxCheckpointError, match=r"group\(s\) \['dspark'\] were not converted"):
        load_orbax(tiny_orbax, groups=("backbone", "dspark"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / LAYOUT_FILE).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(OrbaxCheckpointError, match="format 'something-else'"):
        load_orbax(bad)


def test_cli_convert(tiny_ckpt, tmp_path):
    from deepinfer_jax.cli import main

    dst = tmp_path / "cli"
    assert main(["convert", "--src", str(tiny_ckpt), "--dst", str(dst), "--mesh", "data=1", "--quiet"]) == 0
    assert read_layout(dst)["mesh"] == "data=1,tensor=1,expert=1"
    assert main(["convert", "--src", str(tiny_ckpt), "--dst", str(dst), "--quiet"]) == 2  # not empty


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_multidevice_suite():
    run_multidevice(__file__, "multidev_")


# ------------------------------------------------------------------------------------------------------
# 8 simulated devices, and two processes of 4


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from deepinfer_jax.checkpoint.loader import load_params

    cfg = mesh_test_config()
    src = write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("src") / "ckpt")
    dst = convert_to_orbax(src, tmp_path_factory.mktemp("orbax") / "ckpt", "tensor=2,expert=4", progress=False)
    return cfg, src, dst, jax.tree.map(np.asarray, load_params(src, cfg, place=lambda p, a: a, progress=False))


@multidev
def test_multidev_chunks_are_the_mesh_shards(synthetic):
    import orbax.checkpoint as ocp

    cfg, src, dst, ref = synthetic
    meta = ocp.PyTreeCheckpointer().metadata((dst / "params").absolute())
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    experts = tree["layers"][1]["ffn"]["experts"]["w1"]["weight"]
    assert experts.storage.chunk_shape == (cfg.n_routed_experts // 8, *experts.shape[1:])
    table = tree["layers"][0]["engram"]["embed"]["weight"]
    assert table.shape[0] == 6128 and table.storage.chunk_shape == (6128 // 8, cfg.engram_head_dim)
    # Arrays replicated over some axes are written by their replicas in parallel (orbax's replica-
    # parallel save): a device's shard is then a whole number of chunks, never a part of one.
    wq_b = tree["layers"][1]["attn"]["wq_b"]["weight"]
    shard = (wq_b.shape[0] // 2, wq_b.shape[1])  # heads split over tensor=2, replicated over expert=4
    assert all(s % c == 0 for s, c in zip(shard, wq_b.storage.chunk_shape))
    assert wq_b.storage.chunk_shape[0] <= shard[0] and wq_b.storage.chunk_shape[1] == shard[1]


@multidev
@pytest.mark.parametrize("mesh", ["tensor=2,expert=4", "expert=8", "data=8", "one device"])
def test_multidev_loads_onto_any_mesh(mesh, synthetic):
    cfg, src, dst, ref = synthetic
    target = make_mesh("data=1", jax.devices()[:1]) if mesh == "one device" else mesh
    params = load_orbax(dst, target)
    assert _bytes_equal(params, ref) == []
    rows = params["layers"][0]["engram"]["embed"]["weight"].shape[0]
    assert rows == (6126 if mesh == "one device" else 6128)  # re-padded for the target mesh
    if mesh == "expert=8":
        assert params["layers"][1]["ffn"]["experts"]["w1"]["weight"].addressable_shards[0].data.shape[0] == 1


# Runs in each of two processes with 4 CPU devices: load onto the 2x4 (tensor x expert) mesh, whose
# tensor axis crosses the processes; check this process's shards and count the bytes it read.
_CHILD = r"""
import json, os, sys
from deepinfer_jax.parallel.distributed import initialize_from_env
spec = initialize_from_env()
import jax, numpy as np
from deepinfer_jax.checkpoint.orbax_io import load_orbax
from deepinfer_jax.checkpoint.loader import load_params
def rchar():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
jax.block_until_ready(load_orbax(sys.argv[1], "tensor=2,expert=4"))  # warm: lazy imports read .pyc files
before = rchar()
params = load_orbax(sys.argv[1], "tensor=2,expert=4")
jax.block_until_ready(params)
read = rchar() - before  # bytes this process read through read()/pread(): the checkpoint's, now
ref = load_params(sys.argv[2], progress=False, place=lambda p, a: a)
bad = 0
for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    for s in a.addressable_shards:  # compare on the real rows (a padded table's pad rows are never read)
        lo = [i.start or 0 for i in s.index]
        hi = [max(l, min(n if i.stop is None else i.stop, m)) for l, i, n, m in zip(lo, s.index, a.shape, b.shape)]
        got = np.asarray(s.data)[tuple(slice(0, h - l) for l, h in zip(lo, hi))]
        bad += not np.array_equal(got.view(np.uint8), b[tuple(map(slice, lo, hi))].view(np.uint8))
print(json.dumps({"process": jax.process_index(), "read": read, "bad_shards": bad}))
"""


@multidev
def test_multidev_two_processes_read_only_their_shards(synthetic, tmp_path):
    cfg, src, dst, ref = synthetic
    stored = sum(f.stat().st_size for f in (dst / "params").rglob("*") if f.is_file())
    results = run_two_processes(_CHILD, dst, src)
    assert [r["bad_shards"] for r in results] == [0, 0]
    for r in results:
        # Each host's devices hold half the vocabulary rows, half the experts, half the Engram rows
        # and the heads of its tensor index; only the replicated weights and the metadata are read by
        # both (measured ~0.3-0.4 of the stored bytes per process; reading everything would be ~1).
        print(f"process {r['process']} read {r['read'] / stored:.2f} of the stored bytes")
        assert 0.1 * stored < r["read"] < 0.6 * stored, (r, stored)
