"""A raw safetensors reader/writer for the official sharded layout (spec §5.1).

A shard is an 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets},
"__metadata__": {...}}, then the data section (offsets are relative to its start). The checkpoint is
``model-000NN-of-000MM.safetensors`` shards plus ``model.safetensors.index.json``
({"metadata": {"total_size": bytes}, "weight_map": {name: shard file}}).

Reading the format directly (memory-mapped, one tensor at a time) handles F8_E8M0, which the
safetensors package cannot hand to numpy, and keeps host memory at one tensor plus the page cache.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from pathlib import Path

import numpy as np

from deepinfer_jax.checkpoint.names import DTYPES

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors limit; the real V4.1 shards' headers are < 1 MB
# Experts of one block are kept in one shard when they fit (the loader stacks them per block).
_EXPERT_GROUP = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.\d+\.")


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or disagrees with the config; the message names it."""


def _parse_header(path: Path, fh, size: int) -> tuple[dict, dict, int]:
    raw = fh.read(8)
    if len(raw) < 8:
        raise CheckpointError(f"{path}: truncated ({size} bytes, no 8-byte header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{path}: corrupt header length {n} (file is {size} bytes)")
    try:
        header = json.loads(fh.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    data_len = size - 8 - n
    for name, e in header.items():
        try:
            lo, hi = (int(x) for x in e["data_offsets"])
            dtype, shape = e["dtype"], [int(x) for x in e["shape"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: header entry of tensor {name!r} lacks a valid dtype/shape/data_offsets "
                                  f"({e!r})") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (known: {sorted(DTYPES)})")
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has a negative dimension in shape {shape}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if not 0 <= lo <= hi or hi - lo != want:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} offsets [{lo}, {hi}) do not hold "
                                  f"{dtype}{shape} ({want} bytes)")
        if hi > data_len:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {hi} of the data section but "
                                  f"the file holds only {data_len}")
        e["shape"], e["data_offsets"] = shape, [lo, hi]
    return header, metadata, 8 + n


class SafetensorsFile:
    """One shard: its parsed, validated header and a read-only memory map of the file."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"shard {self.path} does not exist") from None
        self._mm = None
        try:
            size = self.path.stat().st_size
            self.header, self.metadata, self.data_start = _parse_header(self.path, self._fh, size)
            if size > 0:
                self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._fh.close()
            raise

    def names(self) -> list[str]:
        """Tensor names in header order."""
        return list(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def _entry(self, name: str) -> dict:
        try:
            return self.header[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r} in this shard") from None

    def dtype(self, name: str) -> str:
        return self._entry(name)["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def nbytes(self, name: str) -> int:
        lo, hi = self._entry(name)["data_offsets"]
        return hi - lo

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (dtype from ``names.DTYPES``), copied out of the map: one tensor of host memory."""
        e = self._entry(name)
        lo, hi = e["data_offsets"]
        dt = DTYPES[e["dtype"]]
        if hi == lo:
            return np.zeros(e["shape"], dt)
        view = np.frombuffer(self._mm, dtype=dt, count=(hi - lo) // dt.itemsize, offset=self.data_start + lo)
        out = view.reshape(e["shape"]).copy()
        del view  # the map can only close once no array views it
        return out

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_index(ckpt_dir: Path | str) -> dict[str, str]:
    """tensor name -> shard file name, from the index json (or a single model.safetensors).

    Raises CheckpointError naming the index for a malformed file and every shard it lists that is missing.
    """
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_NAME
    if not index.exists():
        single = ckpt_dir / SINGLE_NAME
        if single.exists():
            with SafetensorsFile(single) as f:
                return {n: single.name for n in f.names()}
        raise CheckpointError(f"{ckpt_dir}: neither {INDEX_NAME} nor {SINGLE_NAME} exists")
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of name -> shard file")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid index json ({e!r})") from None
    missing = sorted(s for s in set(weight_map.values()) if not (ckpt_dir / s).is_file())
    if missing:
        raise CheckpointError(f"{index} points at missing shard(s): {missing} (first tensor there: "
                              f"{next(n for n, s in weight_map.items() if s == missing[0])})")
    return dict(weight_map)


def _plan_shards(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
    """Greedy packing in the given order; a block's experts form one unit, split only if it exceeds a shard."""
    units: dict[str, list[str]] = {}
    for name in tensors:
        m = _EXPERT_GROUP.match(name)
        units.setdefault(m.group(1) if m else name, []).append(name)
    shards: list[list[str]] = [[]]
    size = 0
    for names in units.values():
        unit_bytes = sum(tensors[n].nbytes for n in names)
        if shards[-1] and size + unit_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        for n in names:  # a unit larger than one shard spills tensor by tensor
            if shards[-1] and size + tensors[n].nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(n)
            size += tensors[n].nbytes
    return shards


def write_checkpoint(out_dir: Path | str, tensors: dict[str, np.ndarray], dtypes: dict[str, str],
                     max_shard_bytes: int) -> list[Path]:
    """Write ``model-000NN-of-000MM.safetensors`` shards and the index json; -> the shard paths.

    ``dtypes`` gives each tensor's safetensors dtype string (the array must have that element size).
    Within a shard the data are laid out by element size, largest first, so every tensor is aligned to
    its element size (as the safetensors package does); the header keeps the given order.
    Existing files of the same names are overwritten; other shards in ``out_dir`` are left alone.
    """
    out_dir = Path(out_dir)
    for n, a in tensors.items():
        if n not in dtypes or dtypes[n] not in DTYPES:
            raise ValueError(f"tensor {n!r}: no known safetensors dtype given ({dtypes.get(n)!r})")
        if a.dtype.itemsize != DTYPES[dtypes[n]].itemsize:
            raise ValueError(f"tensor {n!r}: array dtype {a.dtype} does not fit safetensors dtype {dtypes[n]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(tensors, max_shard_bytes)
    paths, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data_order = sorted(names, key=lambda n: -tensors[n].dtype.itemsize)  # stable: ties keep given order
        offsets, offset = {}, 0
        for n in data_order:
            offsets[n] = [offset, offset + tensors[n].nbytes]
            offset += tensors[n].nbytes
        header: dict = {"__metadata__": {"format": "pt"}}
        for n in names:
            header[n] = {"dtype": dtypes[n], "shape": list(tensors[n].shape), "data_offsets": offsets[n]}
            weight_map[n] = fname
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)  # the data section starts 8-byte aligned, as the safetensors writer does
        with open(out_dir / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(hjson)))
            fh.write(hjson)
            for n in data_order:
                fh.write(np.ascontiguousarray(tensors[n]).reshape(-1).view(np.uint8).data)
        total += offset
        paths.append(out_dir / fname)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths
