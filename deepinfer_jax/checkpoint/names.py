"""Native tensor names <-> params-pytree paths (docs/CONTRACTS.md), and safetensors dtype strings.

``layers.{L}.x.y`` -> ("layers", L, "x", "y") (the same for ``mtp.{s}``); the routed experts of a block are
stacked: ``layers.{L}.ffn.experts.{e}.w1.weight`` is row e of ("layers", L, "ffn", "experts", "w1", "weight").
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

# safetensors dtype string -> the numpy dtype the bytes are held in (and the jnp dtype of the leaf)
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I8": np.dtype(np.uint8),  # packed FP4: raw bytes, kept unsigned for the nibble arithmetic
    "U8": np.dtype(np.uint8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
}
JNP_DTYPES: dict[str, jnp.dtype] = {k: jnp.dtype(v) for k, v in DTYPES.items()}

# numpy dtype -> safetensors string; uint8 means packed FP4 (I8), the only byte tensors the checkpoints hold
_DTYPE_STRINGS: dict[np.dtype, str] = {v: k for k, v in DTYPES.items() if k != "U8"}
_DTYPE_STRINGS[np.dtype(np.int8)] = "I8"

# path components followed by an integer index in native names
_INDEXED = ("layers", "mtp")


def dtype_string(dtype) -> str:
    """numpy/jnp dtype -> safetensors dtype string (uint8 and int8 -> "I8")."""
    dt = np.dtype(dtype)
    if dt not in _DTYPE_STRINGS:
        raise ValueError(f"dtype {dt} has no safetensors dtype string here (known: {sorted(DTYPES)})")
    return _DTYPE_STRINGS[dt]


def param_path(name: str) -> tuple[tuple, int | None]:
    """'layers.3.ffn.experts.5.w1.weight' -> (('layers', 3, 'ffn', 'experts', 'w1', 'weight'), 5).

    The second item is the expert row for stacked expert leaves, else None.
    """
    parts = name.split(".")
    path: list = []
    expert = None
    i = 0
    while i < len(parts):
        p = parts[i]
        has_index = i + 1 < len(parts) and parts[i + 1].isdigit()
        if p in _INDEXED and has_index:
            path += [p, int(parts[i + 1])]
            i += 2
        elif p == "experts" and has_index:
            path.append(p)
            expert = int(parts[i + 1])
            i += 2
        else:
            path.append(p)
            i += 1
    return tuple(path), expert


def native_name(path: tuple, expert: int | None = None) -> str:
    """The inverse of ``param_path``: (('layers', 3, 'ffn', 'experts', 'w1', 'weight'), 5) -> native name."""
    parts: list[str] = []
    for k in path:
        parts.append(str(k))
        if k == "experts":
            if expert is None:
                raise ValueError(f"path {path} is a stacked expert leaf: give the expert row")
            parts.append(str(expert))
    if expert is not None and "experts" not in path:
        raise ValueError(f"path {path} has no 'experts' component for expert row {expert}")
    return ".".join(parts)
