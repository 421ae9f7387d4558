"""Static configuration of the Mosaic GPU index-score kernel, and its shape limits.

A score's arithmetic is fixed by the kernel's structure (one wgmma per head over the 128-dim dot, heads
summed in order 0, 1, ..., H-1 in fp32), not by the tile sizes or the batch: any config gives the same
bits for a query, so a config is a speed choice only.
"""

from __future__ import annotations

import dataclasses

#: Queries per consumer warpgroup (the wgmma M dimension); a CTA has two consumers.
QUERY_ROWS = 64
#: Hopper's shared memory per block, minus a margin for barriers.
SMEM_LIMIT_BYTES = 232448 - 4096


@dataclasses.dataclass(frozen=True)
class IndexScoresConfig:
    """block_s: keys per CTA (the wgmma N dimension; the fp32 accumulator and the running sum each take
    block_s / 2 registers per thread). stages: query-head tiles in flight per CTA. decode_tiles: the
    decode kernel's ``DecodeIndexConfig.tiles`` (the op runs it at T = 1)."""

    block_s: int = 128
    stages: int = 3
    decode_tiles: int = 1

    def __post_init__(self):
        if self.block_s not in (64, 128):
            raise ValueError(f"IndexScoresConfig.block_s={self.block_s} must be 64 or 128")
        if self.stages < 2:
            raise ValueError(f"IndexScoresConfig.stages={self.stages} must be at least 2")

    @property
    def block_t(self) -> int:
        return 2 * QUERY_ROWS


def smem_bytes(num_heads: int, head_dim: int, config: IndexScoresConfig) -> int:
    bf16, f32 = 2, 4
    q_ring = config.stages * config.block_t * head_dim * bf16
    keys = config.block_s * head_dim * bf16
    weights = num_heads * config.block_t * f32
    counts = config.block_t * 4          # each query's visible-key count (int32)
    out = config.block_t * config.block_s * f32
    return q_ring + keys + weights + counts + out


def kernel_unsupported_reason(num_heads: int, head_dim: int, config: IndexScoresConfig) -> str | None:
    """None if the kernel runs this shape, else why not (the caller then uses the XLA path)."""
    if head_dim != 128:
        return f"head_dim={head_dim}: the kernel's tiles hold 128-dim rows (V4.1's index_head_dim)"
    if (need := smem_bytes(num_heads, head_dim, config)) > SMEM_LIMIT_BYTES:
        return f"{num_heads} heads, block_s={config.block_s}, stages={config.stages} need {need} B of shared memory"
    return None


@dataclasses.dataclass(frozen=True)
class DecodeIndexConfig:
    """The decode kernel's shape (a speed choice only: a score's arithmetic is the same in every form).

    tiles: key tiles a CTA scores. 1 is the session-34 form (one warpgroup loads q, the head weights and
    one 256-key tile, then computes: no overlap inside a CTA). More: a producer warpgroup streams
    ``tile_keys``-key tiles through a ``stages``-deep ring while two consumer warpgroups score half of
    each, so q and the weights are loaded once a CTA and a tile's copy overlaps the scoring of the one
    before. 128-key tiles (64 KB less shared memory at 2 stages) let two CTAs share an SM."""

    tiles: int = 1
    stages: int = 2
    tile_keys: int = 256

    def __post_init__(self):
        # 5 or more tiles hung in the Mosaic GPU interpreter of jax 0.12.1 even when only the first was
        # visible (two threads in barrier waits; cause not found: the attention kernel's FP4 variant hangs
        # there too and runs on the GPU), so the forms the CPU tests can check are the ones allowed
        if not 1 <= self.tiles <= 4:
            raise ValueError(f"DecodeIndexConfig.tiles={self.tiles} must be 1 to 4")
        if self.stages < 2:
            raise ValueError(f"DecodeIndexConfig.stages={self.stages} must be at least 2")
        if self.tile_keys not in (128, 256) or (self.tiles == 1 and self.tile_keys != 256):
            raise ValueError(f"DecodeIndexConfig.tile_keys={self.tile_keys} must be 128 or 256 (256 with tiles=1)")


    @classmethod
    def parse(cls, spec: str) -> "DecodeIndexConfig":
        """'tiles[x tile_keys[x stages]]', e.g. '1', '4x128x3' (the benchmarks' --forms)."""
        parts = [int(v) for v in spec.split("x")]
        return cls(tiles=parts[0], tile_keys=parts[1] if len(parts) > 1 else 256,
                   stages=parts[2] if len(parts) > 2 else 2)


def decode_smem_bytes(num_heads: int, head_dim: int, config: DecodeIndexConfig) -> int:
    keys = (1 if config.tiles == 1 else config.stages) * config.tile_keys * head_dim * 2
    return num_heads * head_dim * 2 + keys + config.tiles * config.tile_keys * 4


def decode_unsupported_reason(num_heads: int, head_dim: int) -> str | None:
    """None if the decode kernel (``decode.py``: one query a batch row) runs this shape, else why not."""
    if head_dim != 128:
        return f"head_dim={head_dim}: the kernel's tiles hold 128-dim rows (V4.1's index_head_dim)"
    if num_heads % 8 or not 8 <= num_heads <= 256:
        return f"{num_heads} heads: the wgmma N side takes a multiple of 8 up to 256"
    return None
