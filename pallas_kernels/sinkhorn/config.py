"""Static configuration of the Mosaic GPU Sinkhorn kernel, and its shape limits."""

from __future__ import annotations

import dataclasses

#: Threads of the kernel's one warpgroup: each holds one matrix.
WARPGROUP_THREADS = 128
#: A thread keeps its hc * hc entries (and a round's sums) in registers; 8 x 8 = 64 is plenty of room.
MAX_STREAMS = 8


@dataclasses.dataclass(frozen=True)
class SinkhornConfig:
    """block_rows: matrices per CTA (a multiple of 128: one thread each, or several in turn).
    pdl: programmatic dependent launch (``pallas_kernels.mosaic.wait_for_prior_grids``).

    A matrix's arithmetic does not depend on the block or on pdl: any config gives the same bits."""

    block_rows: int = WARPGROUP_THREADS
    pdl: bool = False

    def __post_init__(self):
        if self.block_rows <= 0 or self.block_rows % WARPGROUP_THREADS:
            raise ValueError(f"SinkhornConfig.block_rows={self.block_rows} must be a positive multiple of "
                             f"{WARPGROUP_THREADS}")


def kernel_unsupported_reason(num_streams: int) -> str | None:
    """None if the kernel runs hc x hc matrices, else why not (the caller then uses the XLA path)."""
    if not 1 <= num_streams <= MAX_STREAMS:
        return f"hc={num_streams}: the kernel keeps a matrix in one thread's registers (hc <= {MAX_STREAMS})"
    return None
