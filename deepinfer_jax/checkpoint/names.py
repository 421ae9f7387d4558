"""Native tensor names <-> params-pytree paths (docs/CONTRACTS.md), and safetensors dtype strings."""

from __future__ import annotations

import ml_dtypes
import numpy as np

# safetensors dtype string -> (numpy dtype as held in memory, bytes per element)
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
        if p in ("layers", "mtp") and i + 1 < len(parts) and parts[i + 1].isdigit():
            path += [p, int(parts[i + 1])]
            i += 2
            continue
        if p == "experts" and i + 1 < len(parts) and parts[i + 1].isdigit():
            path.append(p)
            expert = int(parts[i + 1])
            i += 2
            continue
        path.append(p)
        i += 1
    return tuple(path), expert
