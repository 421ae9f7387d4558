"""Static configuration of the Mosaic GPU sparse sink-attention kernel, and its shape limits.

The kernel's numerics depend on ``split_rows`` (where the selected entries are cut into independently
reduced splits) and on nothing else: not on the batch, not on the other queries. Pick one config per
deployment and keep it for every step shape, and a query's output is bitwise the same in any batch.
"""

from __future__ import annotations

import dataclasses

#: Rows of kv one pipeline step holds (two warpgroups take 32 each). The wgmma K dimension of p.kv is
#: this many rows, so it is fixed by the kernel's structure, not tunable.
BLOCK_ROWS = 64
#: Query heads per CTA: the wgmma M dimension. Fewer heads are zero-padded; more run as groups of 64.
HEAD_GROUP = 64
#: Hopper's shared memory per block (the limit Mosaic reports), minus a margin for barriers and the
#: compiler's reduction scratch.
SMEM_LIMIT_BYTES = 232448 - 4096


SCHEDULES = ("halves", "seesaw", "seesaw_gathered")


@dataclasses.dataclass(frozen=True)
class SparseAttentionConfig:
    """split_rows: selected entries reduced by one CTA; more entries go to more CTAs whose partial
    softmax states are merged in a fixed order. One split (split_rows >= K) writes the output straight
    from the kernel; several splits add a float32 round trip of the partial outputs through HBM but
    give the GPU more CTAs. 320 (two splits of V4.1's 640 entries) was fastest on the H200 at decode
    batch 64 (README.md)."""

    split_rows: int = 320
    #: Warpgroups issuing the row copies: 1 (measured on the H200) or 2 (halves the issue loop; passes
    #: the CPU lowering but not yet timed on a GPU, and the Mosaic GPU interpreter can starve its four
    #: warpgroup threads on a 2-core host, so the tests run it only where asked).
    producer_warpgroups: int = 1
    #: Drop the warpgroup sync Pallas inserts before every copy (and smem access); the kernel's own
    #: barriers order its buffers. A speed experiment until measured on the H200.
    no_auto_barriers: bool = False
    #: Who issues the per-row copies: "warpgroup" (Pallas' warpgroup TMA copy: every one of the 128
    #: threads arrives on the barrier behind a warpgroup sync), "warps" (``plgpu.warp_map``: each of the
    #: producer's four warps issues its own quarter of the rows, one lane per TMA) or "cp_async" (no
    #: TMA: the producer's 128 threads copy 16-byte pieces of the rows, ``cp_async.py``; GPU only, the
    #: Mosaic GPU interpreter cannot run it). On the H200 all three timed alike (README.md): the row
    #: issue is not what limits the kernel.
    row_issue: str = "warpgroup"
    #: Output columns per p.kv wgmma (a divisor of head_dim/2; larger = fewer, wider wgmmas). Splitting
    #: the output columns changes no sum, so any value gives the same bits.
    pv_cols: int = 128
    #: Accumulate p.kv into the (rescaled) running output instead of a fresh accumulator added after:
    #: 64 x pv_cols fewer live floats in the consumer, which spilled registers on the H200 (ncu
    #: 2026-12-04e: local-memory loads, long-scoreboard stalls 43 %). Other rounding of the running sum
    #: (the tensor core adds it), and GPU only: the Mosaic GPU interpreter runs no preinitialized
    #: accumulator.
    pv_in_place: bool = False
    #: FP4 variant: how consumers decode the packed E2M1 rows. "bits" places each nibble's bits in a
    #: float16 (value * 2^-14, the 2^14 folded into the row's scale; ~9 ALU ops a value, the grouped
    #: GEMM's decoder); "arith" is the earlier float polynomial (~16 ops), kept for timing both;
    #: "packed" is the grouped GEMM's inline-PTX decoder with the row's E4M3 scale as a bf16 pair
    #: (``fp4_packed.dequant_scaled``: ~4 ops a value, two values per 32-bit op; GPU only, the Mosaic GPU
    #: interpreter runs "bits" in its place). The same bf16 values every way, so the same bits. "packed"
    #: is the default since 2026-12-06: on the H100 the FP4 kernel at decode B = 64 went 61.4 -> 49.8 us
    #: and at a 1,024-query prefill 743 -> 599 us, the same error and batch invariance (README.md).
    fp4_dequant: str = "packed"
    #: Diagnostic only (GPU only; the same numerics): with both set, Mosaic GPU's in-kernel profiler
    #: records every named phase of the kernel (``jax.named_scope`` in kernel.py: "c_wait", "c_qk", ...,
    #: "p_issue") as begin/end events, one thread per warpgroup, and the first call of each compile
    #: writes a Chrome trace ``<kernel>-<ns>-trace.json`` into ``profile_dir`` (Mosaic names the file
    #: when it compiles and never overwrites it: remove it to get the next call's). ``profile_ranges`` is each
    #: warpgroup's buffer in ranges (16 B of shared memory a range and warpgroup; at least
    #: ``profile_ranges_needed``). A profiled config is another static config: it compiles separately.
    #: ``benchmarks/attention_profile_gpu.py`` runs it and summarizes the trace.
    profile_dir: str = ""
    profile_ranges: int = 0
    #: Programmatic dependent launch (GPU only; the same numerics): every thread waits on
    #: ``griddepcontrol.wait`` before reading anything, so the driver may launch the kernel while the one
    #: before it drains (``GroupedMatmulConfig.pdl``; ``Numerics.kernel_pdl``).
    pdl: bool = False
    #: How the two consumer warpgroups share a CTA's blocks (bf16 kernel only; each gives other roundings,
    #: each batch-invariant). "halves": every block through both consumers, each taking 32 of its rows for
    #: q.k and half the output columns for p.kv, the block copied from TMA landing slots into the wgmma
    #: tile (three rendezvous a block). "seesaw" (seesaw.py, after FlashMLA's sparse kernels): blocks come
    #: in pairs, consumer c takes q.k over all 64 rows of block 2i + c (N = 64 wgmmas, half as many
    #: instructions as 32-row ones), the two exchange their row maxima and p once a pair, and each applies
    #: both blocks' p to its half of the output columns; the rows land straight in the swizzled wgmma
    #: tiles by per-thread cp.async from one producer warpgroup (GPU only), each block in column halves
    #: released as soon as their last reader is done. "seesaw_gathered": the same consumers fed
    #: by TMA from rows the wrapper gathered with XLA first (an extra HBM round trip: the interpreter's
    #: form, and the GPU's check of the cp.async placement). Needs split_rows a multiple of 128; the
    #: seesaw schedules have their own producer and ignore producer_warpgroups, no_auto_barriers and
    #: row_issue.
    schedule: str = "halves"

    def __post_init__(self):
        if self.split_rows <= 0 or self.split_rows % BLOCK_ROWS:
            raise ValueError(f"SparseAttentionConfig.split_rows={self.split_rows} must be a positive multiple of "
                             f"{BLOCK_ROWS}")
        if self.producer_warpgroups not in (1, 2):
            raise ValueError(f"SparseAttentionConfig.producer_warpgroups={self.producer_warpgroups} must be 1 or 2")
        if self.pv_cols not in (32, 64, 128, 256):
            raise ValueError(f"SparseAttentionConfig.pv_cols={self.pv_cols} must be 32, 64, 128 or 256")
        if self.fp4_dequant not in ("bits", "arith", "packed"):
            raise ValueError(f"SparseAttentionConfig.fp4_dequant={self.fp4_dequant!r} must be 'bits', 'arith' "
                             "or 'packed'")
        if self.row_issue not in ("warpgroup", "warps", "cp_async"):
            raise ValueError(f"SparseAttentionConfig.row_issue={self.row_issue!r} must be 'warpgroup', 'warps' "
                             "or 'cp_async'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"SparseAttentionConfig.schedule={self.schedule!r} must be one of {SCHEDULES}")
        if self.schedule != "halves" and self.split_rows % (2 * BLOCK_ROWS):
            raise ValueError(f"SparseAttentionConfig.split_rows={self.split_rows}: the {self.schedule!r} schedule "
                             f"takes blocks in pairs, so a multiple of {2 * BLOCK_ROWS}")
        if self.profile_ranges < 0 or bool(self.profile_dir) != bool(self.profile_ranges):
            raise ValueError(f"SparseAttentionConfig: profile_dir={self.profile_dir!r} and profile_ranges="
                             f"{self.profile_ranges} must be set together (a directory and a positive count) "
                             "or not at all")

    def num_splits(self, k: int) -> int:
        return -(-k // self.split_rows)


#: Named phases (kernel.py) a consumer warpgroup records per 64-row block at most (the FP4 variant's
#: nine: c_wait, c_tile, c_tile_sync, c_qk, c_max, c_exp, c_psync, c_pv, c_sync), and once per CTA
#: (Mosaic's own "Init", c_init, c_out). The producer records fewer (Init, p_init, p_wait_free and
#: p_issue per block, p_drain).
PROFILE_SCOPES_PER_BLOCK = 9
PROFILE_SCOPES_PER_CTA = 3
#: Bytes of the profiler's buffer per range and warpgroup: a begin and an end event of two uint32 each.
PROFILE_BYTES_PER_RANGE = 16


def profile_ranges_needed(split_rows: int) -> int:
    """The least ``SparseAttentionConfig.profile_ranges`` that holds a CTA's consumer trace: its
    ranges, plus one for the profiler's 3-entry header. Too few would overrun shared memory."""
    return PROFILE_SCOPES_PER_CTA + PROFILE_SCOPES_PER_BLOCK * (split_rows // BLOCK_ROWS) + 1


def seesaw_smem_bytes(head_dim: int, split_rows: int) -> int:
    """Shared memory of the seesaw schedules' CTA (seesaw.py): q, two blocks in wgmma tiles, each
    block's p, the exchanged maxima and denominators, the split's indices."""
    bf16 = 2
    q = HEAD_GROUP * head_dim * bf16
    blocks = 2 * BLOCK_ROWS * head_dim * bf16
    probs = 2 * HEAD_GROUP * BLOCK_ROWS * bf16
    exchange = 2 * 2 * HEAD_GROUP * 4
    return q + blocks + probs + exchange + split_rows * 4


def smem_bytes(head_dim: int, split_rows: int, fp4: bool = False, profile_ranges: int = 0,
               warpgroups: int = 3) -> int:
    """Shared memory the kernel allocates for one CTA (see kernel.py for the buffers); fp4: the variant
    reading FP4 compressed rows, which adds a landing block of packed rows and its scales;
    profile_ranges: the profiler's buffer for each of the CTA's ``warpgroups`` (plus up to 8 bytes of
    alignment), 0 when not profiling."""
    bf16 = 2
    q = HEAD_GROUP * head_dim * bf16
    stage = BLOCK_ROWS * head_dim * bf16           # two 32-row TMA landing slots
    tiled = BLOCK_ROWS * head_dim * bf16           # the block in wgmma layout
    probs = HEAD_GROUP * BLOCK_ROWS * bf16
    exchange = 2 * HEAD_GROUP * 4
    idx = split_rows * 4
    fp4_rows = BLOCK_ROWS * head_dim // 2 + BLOCK_ROWS * head_dim // 16 if fp4 else 0
    profiler = warpgroups * profile_ranges * PROFILE_BYTES_PER_RANGE + 8 if profile_ranges else 0
    return q + stage + tiled + probs + exchange + idx + fp4_rows + profiler


def kernel_unsupported_reason(num_heads: int, head_dim: int, config: SparseAttentionConfig,
                              fp4: bool = False) -> str | None:
    """None if the kernel (fp4: the variant reading FP4 compressed rows) runs this shape, else why not
    (the caller then uses the XLA path)."""
    del num_heads  # any head count runs (padded / grouped to 64)
    if head_dim % 128 or head_dim < 128:
        return f"head_dim={head_dim} must be a multiple of 128 (each warpgroup owns head_dim/2 output columns)"
    if fp4 and head_dim % 256:
        return f"head_dim={head_dim}: the FP4 variant copies packed rows of head_dim/2 bytes, a multiple of 128"
    if fp4 and config.producer_warpgroups != 1:
        return "the FP4 variant has one producer warpgroup"
    if fp4 and config.schedule != "halves":
        return f"the FP4 variant has the 'halves' schedule only, not {config.schedule!r}"
    if config.schedule != "halves":
        if config.profile_ranges:
            return f"the {config.schedule!r} schedule records no profiler phases"
        need = seesaw_smem_bytes(head_dim, config.split_rows)
        if need > SMEM_LIMIT_BYTES:
            return f"head_dim={head_dim}, split_rows={config.split_rows} need {need} B of shared memory (seesaw)"
        return None
    if config.profile_ranges and config.profile_ranges < (least := profile_ranges_needed(config.split_rows)):
        return (f"profile_ranges={config.profile_ranges} cannot hold a CTA's trace at split_rows="
                f"{config.split_rows}: need {least}")
    need = smem_bytes(head_dim, config.split_rows, fp4, config.profile_ranges, 2 + config.producer_warpgroups)
    if need > SMEM_LIMIT_BYTES:
        extra = f" with profile_ranges={config.profile_ranges}" if config.profile_ranges else ""
        return f"head_dim={head_dim}, split_rows={config.split_rows}{extra} need {need} B of shared memory"
    return None
