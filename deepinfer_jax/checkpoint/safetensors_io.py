"""A raw safetensors reader/writer for the official sharded layout.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the data. Reading it directly (memory-mapped, one tensor at a time) handles F8_E8M0, which
safetensors builds before 0.5 lack, and keeps host memory at one tensor plus the page cache.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np

from deepinfer_jax.checkpoint.names import DTYPES

INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or disagrees with the config; the message names it."""


class SafetensorsFile:
    """One shard: parsed header + a read-only memory map."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"shard {self.path} does not exist") from None
        size = self.path.stat().st_size
        raw = self._fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{self.path}: truncated (no 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{self.path}: corrupt header length {n} (file is {size} bytes)")
        try:
            header = json.loads(self._fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt JSON header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self.data_start = 8 + n
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        data_len = size - self.data_start
        for name, e in header.items():
            try:
                lo, hi = e["data_offsets"]
                dtype, shape = e["dtype"], e["shape"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: header entry for {name!r} lacks dtype/shape/data_offsets") from None
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype!r}")
            want = math.prod(shape) * DTYPES[dtype].itemsize
            if not (0 <= lo <= hi) or hi - lo != want:
                raise CheckpointError(f"{self.path}: tensor {name!r} offsets [{lo}, {hi}) do not hold "
                                      f"{dtype}{list(shape)} ({want} bytes)")
            if hi > data_len:
                raise CheckpointError(f"{self.path}: truncated: tensor {name!r} ends at byte {hi} of the data "
                                      f"section but the file holds only {data_len}")

    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor, copied out of the memory map (so the map can close; one tensor of host memory)."""
        e = self.header[name]
        lo, hi = e["data_offsets"]
        dt = DTYPES[e["dtype"]]
        if hi == lo:
            return np.zeros(e["shape"], dt)
        view = np.frombuffer(self._mm, dtype=dt, count=(hi - lo) // dt.itemsize, offset=self.data_start + lo)
        out = view.reshape(e["shape"]).copy()
        del view
        return out

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_index(ckpt_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index json (or the single model.safetensors)."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_NAME
    if not index.exists():
        single = ckpt_dir / "model.safetensors"
        if single.exists():
            with SafetensorsFile(single) as f:
                return {n: single.name for n in f.names()}
        raise CheckpointError(f"{ckpt_dir}: neither {INDEX_NAME} nor model.safetensors exists")
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid index json ({e!r})") from None
    missing = sorted({s for s in weight_map.values() if not (ckpt_dir / s).exists()})
    if missing:
        raise CheckpointError(f"{index} points at missing shard(s): {missing}")
    return dict(weight_map)


def write_checkpoint(out_dir: Path, tensors: dict[str, np.ndarray], dtypes: dict[str, str],
                     max_shard_bytes: int) -> list[Path]:
    """Write shards ``model-000NN-of-000MM.safetensors`` and the index json, in the given tensor order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in tensors.items():
        nbytes = arr.nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    paths, weight_map, total = [], {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for n in names:
            a = tensors[n]
            if a.dtype.itemsize != DTYPES[dtypes[n]].itemsize:
                raise ValueError(f"{n}: array dtype {a.dtype} does not fit safetensors dtype {dtypes[n]}")
            header[n] = {"dtype": dtypes[n], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
            offset += a.nbytes
            weight_map[n] = fname
        header["__metadata__"] = {"format": "pt"}
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)  # the data section starts 8-byte aligned, as the reference writer does
        with open(out_dir / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(hjson)))
            fh.write(hjson)
            for n in names:
                fh.write(np.ascontiguousarray(tensors[n]).tobytes())
        total += offset
        paths.append(out_dir / fname)
    (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
    return paths
