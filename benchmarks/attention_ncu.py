"""Attention-kernel launches for Nsight Compute (ncu) on the GPU machine: where the decode kernel's time goes.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:mosaic \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        -o $OUT/att python3 benchmarks/attention_ncu.py decode-tma decode-cp
    ncu --import $OUT/att.ncu-rep --page details > $OUT/att_details.txt
    ncu --import $OUT/att.ncu-rep --launch-skip 1 --launch-count 1 --page source --print-source sass --csv \
        > $OUT/att_sass.csv
    python3 benchmarks/grouped_gemm_ncu.py --summarize $OUT/att_sass.csv

Why: at decode B=64 the kernel reaches 16-20 % of copy bandwidth whoever issues the row copies (one TMA
per row from a warpgroup, from four warps, or per-thread cp.async: all within 10 % of each other on
2026-12-04), and a fit of the prefill timings gives ~25 us per CTA beyond ~4 us per 64-row block, so
the row issue is not the limit. Cases (argv, in launch order; each launches twice, compile + one more):
decode-tma / decode-cp: B=64, one query each, 640 rows (128 window + 512 selected of an 8k context),
split 320, the TMA and the cp.async row issue; decode-acc / decode-pv64: the register-pressure variants
(p.kv accumulated in place; 64-column p.kv wgmmas); prefill-tma / prefill-acc: B=1, 256 queries, split 640.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attention_gpu import H, SCALE, WINDOW, make_idx, make_kv, make_q  # noqa: E402  (the timing script's problem)
from pallas_kernels.attention.config import SparseAttentionConfig  # noqa: E402
from pallas_kernels.attention.kernel import sparse_sink_attention_pallas  # noqa: E402

CASES = {"decode-tma": (64, 1, SparseAttentionConfig(320)),
         "decode-cp": (64, 1, SparseAttentionConfig(320, row_issue="cp_async")),
         "decode-acc": (64, 1, SparseAttentionConfig(320, pv_cols=256, pv_in_place=True)),
         "decode-pv64": (64, 1, SparseAttentionConfig(320, pv_cols=64)),
         "prefill-tma": (1, 256, SparseAttentionConfig(640)),
         "prefill-acc": (1, 256, SparseAttentionConfig(640, pv_cols=256, pv_in_place=True))}


def problem(b: int, t: int, context: int = 8192):
    """q, kv, idx (the 128 window rows + 512 distinct selected rows of an 8k context) and sink, as
    ``attention_gpu.py``'s decode section builds them."""
    rng = np.random.default_rng(0)
    s = WINDOW + context
    return (make_q(jax.random.key(2), b, t), make_kv(jax.random.key(1), b, s), make_idx(rng, b, t, s),
            jnp.asarray(rng.standard_normal(H), jnp.float32))


def main(names: list[str]) -> None:
    for name in names:
        b, t, cfg = CASES[name]
        q, kv, idx, sink = problem(b, t)
        print(name, cfg, flush=True)
        for _ in range(2):
            jax.block_until_ready(sparse_sink_attention_pallas(q, kv, idx, sink, SCALE, cfg))


if __name__ == "__main__":
    main(sys.argv[1:] or ["decode-tma"])
