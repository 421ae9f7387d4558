"""Where a grouped-GEMM config stops: lowering, XLA compile, or the kernel run (GPU; ~1 min a config).

    PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 150 python3 benchmarks/grouped_gemm_phase_probe.py 2 4

Why: sweep round 8's second config (``consumers=4``) never returned, on an H200 (2026-12-05, session
15) and on an H100 (session 16), while the first config (2 consumers) took 2.5 s to its first result.
A hung kernel and a compile that does not end look the same from the sweep. This runs the FP4 decode
GEMM at 64 tokens x top-6 (8x256x128x8, persistent, "subnormal") once per consumer count given, and
prints a line after each phase, so the last line printed says which one did not finish.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_gemm.config import GroupedMatmulConfig
from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

G, N, K, TOKENS, TOP_K = 384, 2304, 5120, 64, 6


def main(argv: list[str]) -> int:
    key = jax.random.key(0)
    w = jax.random.randint(key, (G, N, K // 2), 0, 256, dtype=jnp.int32).astype(jnp.uint8)
    s = jnp.full((G, N, K // 32), 120, jnp.uint8)        # E8M0 2^-7: small finite values
    gid = jax.random.randint(key, (TOKENS * TOP_K,), 0, G)
    x = jax.random.normal(key, (TOKENS * TOP_K, K), jnp.bfloat16)
    ref = None
    for consumers in (int(a) for a in (argv or ["2", "4"])):
        cfg = GroupedMatmulConfig(block_m=8, block_n=256, block_k=128, stages=8, persistent=True,
                                  fp4_dequant="subnormal", consumers=consumers)
        f = jax.jit(lambda x, g, w, s, cfg=cfg: grouped_matmul_pallas(x, w, g, s, out_dtype=jnp.float32, config=cfg))
        t = time.time()
        lowered = f.lower(x, gid, w, s)
        print(f"consumers={consumers}: lowered in {time.time() - t:.1f} s", flush=True)
        t = time.time()
        compiled = lowered.compile()
        print(f"consumers={consumers}: compiled in {time.time() - t:.1f} s", flush=True)
        t = time.time()
        y = jax.block_until_ready(compiled(x, gid, w, s))
        print(f"consumers={consumers}: ran in {time.time() - t:.3f} s", flush=True)
        t = time.time()
        for _ in range(10):
            y = compiled(x, gid, w, s)
        jax.block_until_ready(y)
        same = None if ref is None else bool(jnp.array_equal(y, ref))
        ref = y if ref is None else ref
        print(f"consumers={consumers}: {(time.time() - t) * 100:.3f} ms a call (op, 10 calls); "
              f"same bits as the first: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
