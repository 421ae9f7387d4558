"""Row gathers with per-thread ``cp.async`` (16 bytes a thread) instead of one TMA per row.

On the H200 the attention kernel's per-row TMA copies cost ~280 ns a row from HBM and ~100 ns from L2
per CTA, whoever issues them (a warpgroup, or four warps from one lane each: measured 2026-12-04e,
both ~16-20 % of copy bandwidth). These copies are what the SIMT gathers of FlashMLA-style sparse
kernels do instead: every thread of the producer warpgroup moves 16-byte pieces of the selected rows
straight into shared memory, a warp covering 512 contiguous bytes of one row.

Mosaic GPU picks ``cp.async`` only for pre-Hopper GPUs, so these helpers emit it through
``plgpu.inline_mgpu``. The Mosaic GPU interpreter cannot run inline Mosaic code: the kernel's CPU tests
cover the TMA modes, and CUDA lowering plus the H200 run (``benchmarks/attention_gpu.py``) cover this.
"""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.mosaic import ref_type

_PIECE = 16            # bytes per cp.async (the .cg form, which bypasses L1)
_THREADS = 128         # the issuing warpgroup


def gather_rows(idx_ref, src_ref, dst_ref, *, first: int, rows: int, row_bytes: int) -> None:
    """Start copying ``src_ref[max(idx_ref[first + j], 0)]`` to ``dst_ref[j]`` for j < rows, then commit
    them as one cp.async group of this thread (``wait_groups`` completes it).

    idx_ref: SMEM int32 [>= first + rows]; src_ref: GMEM [S, row_bytes / itemsize], rows contiguous;
    dst_ref: SMEM [rows, ...] contiguous (untiled), row_bytes per row. Called by all 128 threads of one
    warpgroup: thread t moves piece t % (row_bytes/16) of rows t // (row_bytes/16) + k * (128 * 16 /
    row_bytes)."""
    pieces = row_bytes // _PIECE
    if row_bytes % _PIECE or _THREADS % pieces:
        raise ValueError(f"row_bytes={row_bytes} must be 16 x a divisor of {_THREADS}")
    rows_per_pass = _THREADS // pieces
    if rows % rows_per_pass:
        raise ValueError(f"rows={rows} must be a multiple of {rows_per_pass} for {row_bytes}-byte rows")

    @plgpu.inline_mgpu(arg_types=(ref_type(write=False), ref_type(write=False), ref_type(write=True)))
    def issue(_, idx_m, src_m, dst_m):
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

        i8, i32, i64 = (ir.IntegerType.get_signless(w) for w in (8, 32, 64))
        index = ir.IndexType.get()
        tid = arith.remui(mu.thread_idx(), mu.c(_THREADS, i32))
        row_in_pass = arith.divui(tid, mu.c(pieces, i32))
        piece_off = arith.muli(arith.remui(tid, mu.c(pieces, i32)), mu.c(_PIECE, i32))
        src = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(src_m))
        dst = mu.memref_ptr(dst_m)
        for p in range(rows // rows_per_pass):
            j = arith.addi(row_in_pass, mu.c(p * rows_per_pass, i32))
            row = memref.load(idx_m, [arith.index_cast(index, arith.addi(j, mu.c(first, i32)))])
            row = arith.maxsi(row, mu.c(0, i32))
            src_off = arith.addi(arith.muli(arith.extui(i64, row), mu.c(row_bytes, i64)), arith.extui(i64, piece_off))
            dst_off = arith.addi(arith.muli(j, mu.c(row_bytes, i32)), piece_off)
            nvvm.cp_async_shared_global(mu.getelementptr(dst, [dst_off], i8), mu.getelementptr(src, [src_off], i8),
                                        _PIECE, nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_commit_group()

    issue(idx_ref, src_ref, dst_ref)


def wait_groups(pending: int) -> None:
    """Block this thread until at most ``pending`` of its committed cp.async groups are in flight (its
    earlier groups' bytes are then in shared memory; a barrier arrival after this publishes them)."""

    @plgpu.inline_mgpu()
    def wait(_):
        from jaxlib.mlir.dialects import nvvm

        nvvm.cp_async_wait_group(pending)

    wait()
