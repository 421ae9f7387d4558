"""Orbax checkpoints laid out for a mesh: convert from the official safetensors, load onto any mesh.

``convert_to_orbax(src, dst, "data=1,tensor=2,expert=4")`` loads the official checkpoint straight onto
that mesh (each tensor placed on its NamedSharding as it is read) and saves it with orbax, so every
array is stored in chunks of exactly one device's shard (the zarr chunk shape is the shard shape). A
load onto the same mesh then reads each chunk once, by the one host whose device holds it; a load onto
another mesh still works (tensorstore reads the chunk ranges each new shard overlaps). Weights stay in
their stored formats (FP8 / packed FP4 / E8M0 / BF16 / F32): the conversion changes layout, never bits.

Layout of ``dst``: ``params/`` (the orbax PyTree checkpoint), ``deepinfer_layout.json`` (format, mesh,
groups, rules, padded leaves) and the source's config.json / tokenizer files, so ``dst`` is a
self-contained checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Sequence

import jax

from jax.sharding import Mesh

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.sharding import (DEFAULT_RULES, PADDED_AXES, MeshSpec, ShardingRules, abstract_params,
                                    logical_axes, make_mesh, make_place, mesh_spec_of, path_str, tree_paths,
                                    validate_model_mesh)

FORMAT = "deepinfer-orbax-v1"
LAYOUT_FILE = "deepinfer_layout.json"
PARAMS_DIR = "params"
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


class OrbaxCheckpointError(ValueError):
    """An orbax checkpoint directory that is missing, of another format, or inconsistent (names it)."""


def _checkpointer():
    import orbax.checkpoint as ocp

    # No zstd: FP8 / packed-FP4 weights barely compress, and decoding cost 3.5x the load time of the
    # uncompressed layout on the mid-size benchmark (benchmarks/load_time.py).
    return ocp.PyTreeCheckpointer(use_compression=False)


def convert_to_orbax(src_dir: str | Path, dst_dir: str | Path, mesh_spec: str | MeshSpec = "data=1", *,
                     groups: Sequence[str] = ("backbone",), rules: ShardingRules = DEFAULT_RULES,
                     devices: Sequence | None = None, overwrite: bool = False, progress: bool = True) -> Path:
    """Official safetensors checkpoint -> orbax checkpoint laid out for ``mesh_spec``. -> dst_dir.

    Needs the mesh's devices (all processes of a multi-host run call it together; each writes its own
    shards). Host memory stays at one tensor (or one layer's expert stack) at a time."""
    from deepinfer_jax.checkpoint.loader import load_params

    src, dst = Path(src_dir), Path(dst_dir)
    cfg = ModelConfig.from_json(src)
    ms = MeshSpec.parse(mesh_spec)
    validate_model_mesh(cfg, ms, rules)
    mesh = make_mesh(ms, devices)
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise OrbaxCheckpointError(f"{dst} exists and is not empty (pass overwrite=True / --overwrite)")
        if jax.process_index() == 0:
            shutil.rmtree(dst)
    params = load_params(src, cfg, groups=tuple(groups), place=make_place(cfg, mesh, rules), progress=progress)
    ckptr = _checkpointer()
    ckptr.save((dst / PARAMS_DIR).absolute(), params)
    ckptr.wait_until_finished() if hasattr(ckptr, "wait_until_finished") else None
    if jax.process_index() == 0:
        for name in _COPIED:
            if (src / name).exists():
                shutil.copy2(src / name, dst / name)
        padded = {path_str(p): list(a.shape) for p, a in tree_paths(params)
                  if any(ax in PADDED_AXES for ax in logical_axes(p))}
        layout = {"format": FORMAT, "mesh": str(ms), "groups": list(groups),
                  "rules": {k: list(v) for k, v in rules.table}, "padded_leaves": padded, "source": str(src)}
        (dst / LAYOUT_FILE).write_text(json.dumps(layout, indent=2) + "\n")
    return dst


def read_layout(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / LAYOUT_FILE
    try:
        layout = json.loads(path.read_text())
    except FileNotFoundError:
        raise OrbaxCheckpointError(f"{ckpt_dir}: no {LAYOUT_FILE}; not an orbax checkpoint written by "
                                   f"convert_to_orbax") from None
    except json.JSONDecodeError as e:
        raise OrbaxCheckpointError(f"{path}: not valid JSON ({e})") from None
    if layout.get("format") != FORMAT:
        raise OrbaxCheckpointError(f"{path}: format {layout.get('format')!r}, expected {FORMAT!r}")
    return layout


def is_orbax_checkpoint(ckpt_dir: str | Path) -> bool:
    return (Path(ckpt_dir) / LAYOUT_FILE).exists()


def load_orbax(ckpt_dir: str | Path, mesh: Mesh | str | MeshSpec | None = None, *, cfg: ModelConfig | None = None,
               rules: ShardingRules = DEFAULT_RULES, groups: Sequence[str] | None = None) -> dict:
    """The params pytree placed on ``mesh`` (default: the mesh it was laid out for, over all devices).

    Each process reads only the chunks its own devices hold. Lookup tables padded for another mesh are
    re-padded for this one (the pad rows are never read)."""
    import orbax.checkpoint as ocp

    ckpt_dir = Path(ckpt_dir)
    layout = read_layout(ckpt_dir)
    cfg = cfg or ModelConfig.from_json(ckpt_dir)
    groups = tuple(groups or layout["groups"])
    missing = sorted(set(groups) - set(layout["groups"]))
    if missing:
        raise OrbaxCheckpointError(f"{ckpt_dir}: group(s) {missing} were not converted (it holds {layout['groups']})")
    if not isinstance(mesh, Mesh):
        mesh = make_mesh(MeshSpec.parse(mesh if mesh is not None else layout["mesh"]))
    validate_model_mesh(cfg, mesh_spec_of(mesh), rules)
    target = abstract_params(cfg, groups, mesh=mesh, rules=rules)
    padded = layout.get("padded_leaves", {})

    def restore_args(path, sd):
        relax = path_str(path) in padded or any(ax in PADDED_AXES for ax in logical_axes(path))
        return ocp.ArrayRestoreArgs(sharding=sd.sharding, global_shape=sd.shape, dtype=sd.dtype, strict=not relax)

    _, treedef = jax.tree_util.tree_flatten(target)
    args = jax.tree_util.tree_unflatten(treedef, [restore_args(p, sd) for p, sd in tree_paths(target)])
    params_dir = (ckpt_dir / PARAMS_DIR).absolute()
    if not params_dir.exists():
        raise OrbaxCheckpointError(f"{ckpt_dir}: {PARAMS_DIR}/ is missing")
    try:
        restored = _checkpointer().restore(params_dir, args=ocp.args.PyTreeRestore(
            item=target, restore_args=args, partial_restore=set(groups) != set(layout["groups"])))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise OrbaxCheckpointError(f"{params_dir}: cannot restore onto mesh {mesh_spec_of(mesh)}: {e}") from e
    return _as_tuples(restored)


def _as_tuples(tree):
    """orbax may hand sequences back as lists; the params contract has ``layers`` / ``mtp`` as tuples."""
    if isinstance(tree, dict):
        return {k: tuple(_as_tuples(v) for v in tree[k]) if k in ("layers", "mtp") and isinstance(tree[k], (list, tuple))
                else _as_tuples(tree[k]) for k in tree}
    return tree


# ------------------------------------------------------------------------------------------------------
# CLI


def _convert_cli(args: argparse.Namespace) -> int:
    from deepinfer_jax.parallel.distributed import initialize_from_env

    initialize_from_env()
    try:
        dst = convert_to_orbax(args.src, args.dst, args.mesh, groups=tuple(args.groups.split(",")),
                               overwrite=args.overwrite, progress=not args.quiet)
    except (ValueError, OSError) as e:
        print(f"deepinfer-jax convert: {e}", file=sys.stderr)
        return 2
    print(f"deepinfer-jax convert: wrote {dst} laid out for mesh {MeshSpec.parse(args.mesh)}", file=sys.stderr)
    return 0


def register_cli(subparsers) -> None:
    """Adds ``deepinfer-jax convert`` to the CLI's subparsers."""
    p = subparsers.add_parser("convert", help="official safetensors checkpoint -> orbax checkpoint for a mesh",
                              description="Loads the checkpoint onto the mesh's devices and saves it with orbax, "
                                          "one chunk per device shard. Multi-host: run on every host with the "
                                          "jax.distributed environment set (see parallel/distributed.py).")
    p.add_argument("--src", required=True, help="official checkpoint directory")
    p.add_argument("--dst", required=True, help="output directory")
    p.add_argument("--mesh", default="data=1", help="e.g. data=1,tensor=2,expert=4 (must match the devices)")
    p.add_argument("--groups", default="backbone", help="comma-separated: backbone,dspark,image")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_convert_cli)


__all__ = ["convert_to_orbax", "load_orbax", "read_layout", "is_orbax_checkpoint", "OrbaxCheckpointError",
           "register_cli", "FORMAT"]
