"""Do rows gathered by ``cp_async.gather_rows(..., swizzle=)`` land where a TMA-landed, re-laid block does? (GPU, seconds.)

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/attention_swizzle_probe.py

The groundwork of the attention kernel's restructure (benchmarks/NOTES.md item -32(f)): to hold two kv
blocks in wgmma layout beside q, the selected rows must land straight in the swizzled tiles, without
the 64 KB of landing slots the kernel copies them out of today. Mosaic's TMA cannot copy one row into a
tiled buffer (its slices are whole 8-row tiles), so the producer's threads would place 16-byte pieces
with cp.async at swizzled addresses they compute (``cp_async.swizzled_offset``). One CTA gathers 64
rows of a random bf16 cache by an index list (with -1 entries and duplicates) both ways, into tiles of
each swizzle, and writes both tiles out through TMA stores (which read the swizzled layout as the
wgmmas do). Exits 1 unless both equal the numpy gather bit for bit. Results: $OUT/attention_swizzle_probe.json.
The Mosaic GPU interpreter runs no inline code, so the CPU tests only lower this kernel for CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.experimental.pallas as pl  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import mosaic  # noqa: E402
from pallas_kernels.attention import cp_async  # noqa: E402

ROWS, D = 64, 512


def build(swizzle: int):
    """The probe kernel: (kv [S, D] bf16, idx [ROWS] int32) -> (cp.async-landed tile, TMA-landed tile)."""
    tiles = mosaic.tiled(swizzle, 2)
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((ROWS, D), jnp.bfloat16, swizzle)

    def body(kv_ref, idx_ref, out_a_ref, out_b_ref, scratch):
        (idx_smem, tiled_a, stage, tiled_b), (idx_bar, rows_bar) = scratch
        plgpu.copy_gmem_to_smem(idx_ref, idx_smem, idx_bar)
        plgpu.barrier_wait(idx_bar)
        cp_async.gather_rows(idx_smem, kv_ref, tiled_a, first=0, rows=ROWS, row_bytes=D * 2, swizzle=swizzle)
        for j in range(ROWS):   # the attention kernel's path: one TMA a row, then through registers
            row = jnp.maximum(idx_smem[j], 0)
            plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(row, 1)], stage.at[pl.ds(j, 1)], rows_bar)
        plgpu.barrier_wait(rows_bar)
        tiled_b[...] = plgpu.load(stage, layout=copy_layout)
        cp_async.wait_groups(0)
        plgpu.commit_smem()      # both tiles' generic-proxy writes, before the TMA stores read them
        plgpu.copy_smem_to_gmem(tiled_a, out_a_ref)
        plgpu.copy_smem_to_gmem(tiled_b, out_b_ref)
        plgpu.wait_smem_to_gmem(0)

    scratch = ((plgpu.SMEM((ROWS,), jnp.int32), plgpu.SMEM((ROWS, D), jnp.bfloat16, transforms=tiles),
                plgpu.SMEM((ROWS, D), jnp.bfloat16), plgpu.SMEM((ROWS, D), jnp.bfloat16, transforms=tiles)),
               (plgpu.Barrier(), plgpu.Barrier(num_arrivals=ROWS)))

    def entry(kv_ref, idx_ref, out_a_ref, out_b_ref):
        pl.run_scoped(lambda *s: body(kv_ref, idx_ref, out_a_ref, out_b_ref, s), *scratch)

    out = jax.ShapeDtypeStruct((ROWS, D), jnp.bfloat16)
    return plgpu.kernel(entry, out_type=(out, out), grid=(1,), grid_names=("x",))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-rows", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((args.cache_rows, D)), jnp.bfloat16)
    idx = rng.integers(0, args.cache_rows, ROWS).astype(np.int32)
    idx[[3, 17, 40]] = -1                 # skipped entries fetch row 0
    idx[[20, 21]] = idx[5]                # duplicates
    want = np.asarray(kv)[np.maximum(idx, 0)].view(np.uint16)
    rows, ok = [], True
    for swizzle in (64, 128):
        a, b = jax.block_until_ready(jax.jit(build(swizzle))(kv, jnp.asarray(idx)))
        a, b = np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)
        row = {"swizzle": swizzle, "cp_async_rows_differ": int((a != want).any(axis=1).sum()),
               "tma_rows_differ": int((b != want).any(axis=1).sum())}
        ok &= row["cp_async_rows_differ"] == 0 and row["tma_rows_differ"] == 0
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_swizzle_probe.json").write_text(json.dumps(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, indent=1))
    print("all rows in place" if ok else "MISPLACED ROWS", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
