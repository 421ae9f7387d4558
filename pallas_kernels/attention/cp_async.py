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

from pallas_kernels.mosaic import ref_type, tiled

_PIECE = 16            # bytes per cp.async (the .cg form, which bypasses L1)
_THREADS = 128         # the issuing warpgroup


def gather_rows(idx_ref, src_ref, dst_ref, *, first: int, rows: int, row_bytes: int, swizzle: int | None = None,
                dst_row: int = 0, src_col_bytes: int = 0) -> None:
    """Start copying ``src_ref[max(idx_ref[first + j], 0)]`` (``row_bytes`` of it from byte
    ``src_col_bytes`` of the row on) to row ``dst_row + j`` of ``dst_ref`` for j < rows, then commit them
    as one cp.async group of this thread (``wait_groups`` completes it).

    idx_ref: SMEM int32 [>= first + rows]; src_ref: GMEM [S, C], rows contiguous, C * itemsize >=
    src_col_bytes + row_bytes;
    dst_ref: SMEM [>= dst_row + rows, ...], row_bytes per row: contiguous (untiled) when ``swizzle`` is
    None, else allocated as ``mosaic.tiled(swizzle, itemsize)``, the wgmma tiles, each 16-byte piece
    going to its swizzled place (``swizzled_offset``; a TMA copy of one row into a tiled buffer cannot,
    its slices being whole 8-row tiles; ``benchmarks/attention_swizzle_probe.py`` checks the placement
    on a GPU). Called by all 128 threads of one warpgroup: thread t moves piece t % (row_bytes/16) of
    rows t // (row_bytes/16) + k * (128 * 16 / row_bytes)."""
    pieces = row_bytes // _PIECE
    if row_bytes % _PIECE or _THREADS % pieces:
        raise ValueError(f"row_bytes={row_bytes} must be 16 x a divisor of {_THREADS}")
    if swizzle is not None and (swizzle not in (32, 64, 128) or row_bytes % swizzle):
        raise ValueError(f"swizzle={swizzle} must be 32, 64 or 128 bytes and divide row_bytes={row_bytes}")
    src_row_bytes = src_ref.shape[-1] * src_ref.dtype.itemsize
    if src_col_bytes % _PIECE or src_col_bytes + row_bytes > src_row_bytes:
        raise ValueError(f"src_col_bytes={src_col_bytes} + row_bytes={row_bytes} must fit a {src_row_bytes}-byte "
                         "source row, at a 16-byte multiple")
    rows_per_pass = _THREADS // pieces
    if rows % rows_per_pass:
        raise ValueError(f"rows={rows} must be a multiple of {rows_per_pass} for {row_bytes}-byte rows")
    chunks = (swizzle or _PIECE) // _PIECE
    dst_type = ref_type(write=True, transforms=() if swizzle is None else tiled(swizzle, src_ref.dtype.itemsize))

    @plgpu.inline_mgpu(arg_types=(ref_type(write=False), ref_type(write=False), dst_type))
    def issue(_, idx_m, src_m, dst_m):
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

        i8, i32, i64 = (ir.IntegerType.get_signless(w) for w in (8, 32, 64))
        index = ir.IndexType.get()
        c32 = lambda v: mu.c(v, i32)      # noqa: E731
        tid = arith.remui(mu.thread_idx(), c32(_THREADS))
        row_in_pass = arith.divui(tid, c32(pieces))
        piece = arith.remui(tid, c32(pieces))
        piece_off = arith.muli(piece, c32(_PIECE))
        src = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(src_m))
        dst = mu.memref_ptr(dst_m)
        for p in range(rows // rows_per_pass):
            j = arith.addi(row_in_pass, c32(p * rows_per_pass))
            row = memref.load(idx_m, [arith.index_cast(index, arith.addi(j, c32(first)))])
            row = arith.maxsi(row, c32(0))
            src_off = arith.addi(arith.muli(arith.extui(i64, row), mu.c(src_row_bytes, i64)),
                                 arith.extui(i64, arith.addi(piece_off, c32(src_col_bytes))))
            r = arith.addi(j, c32(dst_row))
            if swizzle is None:
                dst_off = arith.addi(arith.muli(r, c32(row_bytes)), piece_off)
            else:   # swizzled_offset, on the GPU
                r8 = arith.remui(r, c32(8))
                tile = arith.addi(arith.muli(arith.divui(r, c32(8)), c32(row_bytes // swizzle)),
                                  arith.divui(piece, c32(chunks)))
                swz = arith.andi(arith.shrui(arith.muli(r8, c32(swizzle)), c32(7)), c32(chunks - 1))
                chunk = arith.xori(arith.remui(piece, c32(chunks)), swz)
                dst_off = arith.addi(arith.addi(arith.muli(tile, c32(8 * swizzle)), arith.muli(r8, c32(swizzle))),
                                     arith.muli(chunk, c32(_PIECE)))
            nvvm.cp_async_shared_global(mu.getelementptr(dst, [dst_off], i8), mu.getelementptr(src, [src_off], i8),
                                        _PIECE, nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_commit_group()

    issue(idx_ref, src_ref, dst_ref)


def swizzled_offset(row: int, piece: int, *, row_bytes: int, swizzle: int) -> int:
    """Byte offset of 16-byte piece ``piece`` of row ``row`` in a shared-memory buffer of ``row_bytes``
    rows held as Mosaic's swizzled tiles (``mosaic.tiled(swizzle, itemsize)``: 8-row tiles ``swizzle``
    bytes wide, tile-row-major, each tile's 16-byte chunks XOR-swizzled by row as Hopper's TMA does).
    The Python form of what ``gather_rows(..., swizzle=)`` computes on the GPU."""
    chunks = swizzle // _PIECE
    tile, chunk = divmod(piece, chunks)
    r8 = row % 8
    return (((row // 8) * (row_bytes // swizzle) + tile) * 8 * swizzle + r8 * swizzle
            + ((chunk ^ ((r8 * swizzle >> 7) & (chunks - 1))) * _PIECE))


def wait_groups(pending: int) -> None:
    """Block this thread until at most ``pending`` of its committed cp.async groups are in flight (its
    earlier groups' bytes are then in shared memory; a barrier arrival after this publishes them)."""

    @plgpu.inline_mgpu()
    def wait(_):
        from jaxlib.mlir.dialects import nvvm

        nvvm.cp_async_wait_group(pending)

    wait()
