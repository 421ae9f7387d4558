"""The indexer's top-k methods on the GPU: the same indices, and their speed at prefill-chunk shapes.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/topk_gpu.py      # ~1 min on the H200
    python benchmarks/topk_gpu.py --rows 64 --keys 4104                 # CPU, small

Rows of random scores with ties and -inf tails (a chunk's causal edge: query t sees S - T + t + 1 keys),
k = 512 (V4.1-Flash's index_topk). For each S it times ``topk_indices_xla`` with method "sort" (the
baseline: XLA's segmented radix sort), "top_k" and "select" at 1, 2 and 4 bits a counting pass, and
prints each one's ms and its ratio to the sort. Exits 1 if any method's indices differ from the sort's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from timing import median_ms   # benchmarks/timing.py (the script's folder is on sys.path)
from pallas_kernels.topk.select import select_topk
from pallas_kernels.topk.xla import topk_indices_xla


def _scores(rows: int, keys: int, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((1, rows, keys)).astype(np.float32)
    s[..., ::7] = np.round(s[..., ::7] * 4) / 4          # ties
    visible = keys - rows + np.arange(rows)[:, None] + 1  # a chunk at the end of the prompt
    s[0][np.arange(keys)[None, :] >= visible] = -np.inf
    return jnp.asarray(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048, help="queries in the chunk")
    ap.add_argument("--keys", default="4104,8200,16392", help="comma-separated S (index keys)")
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for topk_gpu.json")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; rows {args.rows}, k {args.k}")
    methods = {"sort": functools.partial(topk_indices_xla, method="sort"),
               "top_k": functools.partial(topk_indices_xla, method="top_k")}
    for bits in (1, 2, 4):
        methods[f"select/{bits}bit"] = functools.partial(select_topk, bits_per_pass=bits)
    results, failed = [], False
    for keys in map(int, args.keys.split(",")):
        s = _scores(args.rows, keys)
        want = None
        for name, fn in methods.items():
            f = jax.jit(lambda s, fn=fn: fn(s, args.k))
            got = np.asarray(f(s))
            if want is None:
                want = got
            same = bool(np.array_equal(got, want))
            failed |= not same
            ms = median_ms(f, s)
            results.append({"keys": keys, "method": name, "ms": ms, "same_as_sort": same})
        base = next(r["ms"] for r in results if r["keys"] == keys and r["method"] == "sort")
        for r in results:
            if r["keys"] == keys:
                print(f"S {keys:6d}  {r['method']:13s} {r['ms']:8.3f} ms  sort / this {base / r['ms']:5.2f}x"
                      f"  {'same indices' if r['same_as_sort'] else 'DIFFERENT INDICES'}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "topk_gpu.json").write_text(json.dumps(
        {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": args.rows, "k": args.k,
         "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
