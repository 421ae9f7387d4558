"""The index-score kernel on the GPU: correctness, batch invariance and speed against the XLA path.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/indexer_gpu.py        # ~1-2 min on the H200
    python benchmarks/indexer_gpu.py --queries 128 --keys 300 --configs 128x2   # CPU: the interpreter

Shapes are V4.1-Flash's indexer (32 heads of 128) at a prefill chunk of 2048 queries over S keys, the
chunk being the last of an S-token prompt at compression ratio 1 (query t sees S - 2048 + t + 1 keys),
so the kernel skips the tiles above the causal edge; "full" times every key visible. Prints, in one
run: the kernel's and the XLA path's ms, their ratio, the kernel's useful TFLOP/s (visible dots only)
against a dense bf16 matmul measured here, and checks (exit 1 on a failure):

* the kernel against the float32 reference within 1e-5 of the largest score (fp32 summation order);
* a batch row alone == the same row in a batch of 2, bitwise;
* the scores of visible keys with tile skipping == without, bitwise; every unseen key's score -inf.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/indexer_gpu.py --decode   # the decode kernel

runs the decode kernel (``decode.index_scores_decode_pallas``: one query a batch row, B = 64 over S keys,
32 and 64 heads) instead, in each ``--decode-forms`` form (``DecodeIndexConfig``): the same checks
(reference, a row alone against in the batch, visible scores with tiles skipped, -inf where unseen,
every form the first form's bits), then each form's ms against the XLA path's and the bytes it must
read (the keys) over its time, as a fraction of a copy's bandwidth measured here. The "fp4" form
(``decode_fp4``: the index cache as stored, 68 B a key) has the same checks against the reference over
the decoded keys and is timed against XLA's decode of the cache followed by the first form.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from timing import device_ms, median_ms   # benchmarks/timing.py (the script's folder is on sys.path)
from pallas_kernels.indexer import IndexScoresConfig, index_scores_reference, index_scores_xla
from pallas_kernels.indexer.kernel import index_scores_pallas

H, D = 32, 128


def dense_tflops(n: int = 8192) -> float:
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    return 2 * n ** 3 / median_ms(f, a) / 1e9


def inputs(key, b: int, t: int, s: int, heads: int = H):
    kq, kk, kw = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, t, heads, D), jnp.bfloat16), jax.random.normal(kk, (b, s, D), jnp.bfloat16),
            jax.random.normal(kw, (b, t, heads), jnp.float32))


def copy_tb_s(n_bytes: int = 1 << 30) -> float:
    """Read + write bandwidth of a device copy (TB/s), timed as the decode kernels are (``device_ms``)."""
    a = jnp.ones((n_bytes // 4,), jnp.float32)
    return 2 * n_bytes / device_ms(jax.jit(lambda a: a + 1), a, reps=10)[0] / 1e9


def kernel_checks(full, ref, alone, alone_in_batch, skipped, visible) -> dict:
    """The checks every kernel run prints: the kernel's scores against the reference, a row alone against
    the same row in the batch, visible scores with tiles skipped against without, -inf where unseen."""
    return dict(rel_err_vs_reference=float(np.abs(full - ref).max() / np.abs(ref).max()),
                batch_invariant=bool(np.array_equal(alone, alone_in_batch)),
                skip_keeps_visible_bits=bool(np.array_equal(skipped[visible], full[visible])),
                unseen_are_minus_inf=bool(np.all(np.isneginf(skipped[~visible]))))


def checks_pass(checks: dict) -> bool:
    """Within 1e-5 of the reference (fp32 summation order) and every bitwise check true."""
    return checks["rel_err_vs_reference"] < 1e-5 and all(v for c, v in checks.items() if c != "rel_err_vs_reference")


def write_results(out: str, name: str, res: dict) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps(res, indent=1))


def decode_checks(score, ref, b: int, s: int):
    """The decode kernels' checks (``kernel_checks``) for ``score(rows, n_visible) -> [rows, S]``, the form
    under test on batch rows ``rows``, against ``ref`` [B, S]; every row sees a different prefix of the S
    keys. -> (checks, scores with every key visible, scores with the prefixes, the prefixes)."""
    n_vis = jnp.arange(b, dtype=jnp.int32) * (s // b) + 1
    one = slice(min(5, b - 1), min(5, b - 1) + 1)   # the row run alone
    full = np.asarray(score(slice(None), None))
    skipped = np.asarray(score(slice(None), n_vis))
    checks = kernel_checks(full, ref, np.asarray(score(one, None)), full[one], skipped,
                           np.arange(s)[None, :] < np.asarray(n_vis)[:, None])
    return checks, full, skipped, n_vis


def stored_index_keys(k_bsd):
    """bf16 keys -> (the index cache as stored: packed E2M1 values, E8M0 scales; its decoded bf16 keys)."""
    from deepinfer_jax.model import kv_codec

    stored = jax.jit(lambda k: kv_codec.encode(kv_codec.INDEX_K, k.astype(jnp.float32), True, jnp.bfloat16))(k_bsd)
    return stored, jax.jit(lambda st: kv_codec.decode(kv_codec.INDEX_K, st, jnp.bfloat16))(stored)


def fp4_rows(kern, b: int, keys: list[int], copy: float) -> tuple[dict, list[dict], bool]:
    """The FP4 form (``decode_fp4``: the index cache as stored) at 32 and 64 heads: its checks against the
    reference over the decoded keys (informational: whether it has the bf16 kernel's bits), then its time
    against the model's path without it (XLA's decode of the cache, then the bf16 kernel ``kern``), and
    its bytes (68 a key) over its time as a fraction of copy."""
    from deepinfer_jax.model import kv_codec
    from pallas_kernels.indexer.decode_fp4 import index_scores_decode_fp4_pallas

    fp4 = jax.jit(index_scores_decode_fp4_pallas)
    decoded_then_bf16 = jax.jit(lambda q, st, w: kern(q, kv_codec.decode(kv_codec.INDEX_K, st, jnp.bfloat16), w, None))
    checks, rows, ok = {}, [], True
    for h in (32, 64):
        q, k, w = inputs(jax.random.key(h), b, 1, keys[0], heads=h)
        stored, k_dec = stored_index_keys(k)
        c, full, _, _ = decode_checks(
            lambda r, nv: fp4(q[r, 0], stored["values"][r], stored["scale"][r], w[r, 0], nv),
            np.asarray(index_scores_reference(q, k_dec, w))[:, 0], b, keys[0])
        ok &= checks_pass(c)
        c["bf16_kernels_bits"] = bool(np.array_equal(full, np.asarray(kern(q[:, 0], k_dec, w[:, 0], None))))
        checks[f"fp4_heads{h}"] = c
        print(f"checks, FP4 form, {h} heads: {c}", flush=True)
        for s in keys:
            q, k, w = inputs(jax.random.key(s + h), b, 1, s, heads=h)
            stored, _ = stored_index_keys(k)
            base_ms, _ = device_ms(decoded_then_bf16, q[:, 0], stored, w[:, 0], reps=10)
            ms, timer = device_ms(fp4, q[:, 0], stored["values"], stored["scale"], w[:, 0], reps=10)
            frac = b * s * (D // 2 + D // 32) / ms / 1e9 / copy
            rows.append(dict(heads=h, keys=s, form="fp4", kernel_ms=ms, decode_then_bf16_kernel_ms=base_ms,
                             speedup_vs_decode_then_bf16=base_ms / ms, copy_fraction=frac, timer=timer))
            print(f"decode B={b} H={h} S={s:6d} form fp4      : kernel {ms * 1e3:7.1f} us, decode + bf16 kernel "
                  f"{base_ms * 1e3:7.1f} us ({base_ms / ms:.2f}x, {timer}), stored keys read at {frac:.0%} of copy",
                  flush=True)
    return checks, rows, ok


def decode_main(args) -> int:
    from pallas_kernels.indexer.config import DecodeIndexConfig
    from pallas_kernels.indexer.decode import index_scores_decode_pallas

    b, keys = args.batch, [int(v) for v in args.keys.split(",")]
    forms = {}
    specs = args.decode_forms.split(",")
    with_fp4 = "fp4" in specs
    for spec in (s for s in specs if s != "fp4"):
        cfg = DecodeIndexConfig.parse(spec)
        forms[spec] = jax.jit(lambda *a, cfg=cfg: index_scores_decode_pallas(*a, config=cfg))
    first = next(iter(forms))
    kern = forms[first]
    res = dict(jax=jax.__version__, device=str(jax.devices()[0]), copy_tb_s=copy_tb_s(), rows=[], checks={})
    print(f"{res['device']}; jax {res['jax']}; copy {res['copy_tb_s']:.2f} TB/s", flush=True)
    ok = True
    xla = jax.jit(lambda q, k, w: index_scores_xla(q, k, w))
    for h in (32, 64):
        q, k, w = inputs(jax.random.key(h), b, 1, keys[0], heads=h)
        checks, full, skipped, n_vis = decode_checks(lambda r, nv: kern(q[r, 0], k[r], w[r, 0], nv),
                                                     np.asarray(index_scores_reference(q, k, w))[:, 0], b, keys[0])
        for spec, other in list(forms.items())[1:]:   # every form: the first form's bits, skips included
            checks[f"form_{spec}_same_bits"] = bool(
                np.array_equal(np.asarray(other(q[:, 0], k, w[:, 0], None)), full)
                and np.array_equal(np.asarray(other(q[:, 0], k, w[:, 0], n_vis)), skipped))
        res["checks"][f"heads{h}"] = checks
        ok &= checks_pass(checks)
        print(f"checks, {h} heads: {checks}", flush=True)
        for s in keys:
            q, k, w = inputs(jax.random.key(s + h), b, 1, s, heads=h)
            # tens of microseconds: device time where CUPTI has it, not the wall clock's launch overhead
            xla_ms, _ = device_ms(xla, q, k, w, reps=10)
            for spec, form in forms.items():
                ms, timer = device_ms(form, q[:, 0], k, w[:, 0], None, reps=10)
                frac = b * s * D * 2 / ms / 1e9 / res["copy_tb_s"]
                row = dict(heads=h, keys=s, form=spec, kernel_ms=ms, xla_ms=xla_ms, speedup_vs_xla=xla_ms / ms,
                           copy_fraction=frac, timer=timer)
                res["rows"].append(row)
                print(f"decode B={b} H={h} S={s:6d} form {spec:9s}: kernel {ms * 1e3:7.1f} us, XLA "
                      f"{xla_ms * 1e3:7.1f} us ({xla_ms / ms:.2f}x, {timer}), keys read at {frac:.0%} of copy",
                      flush=True)
    if with_fp4:
        checks, rows, fp4_ok = fp4_rows(kern, b, keys, res["copy_tb_s"])
        res["checks"].update(checks)
        res["rows"] += rows
        ok &= fp4_ok
    write_results(args.out, "indexer_gpu_decode.json", res)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", action="store_true", help="the decode kernel (B = 64, one query a row)")
    ap.add_argument("--queries", type=int, default=2048)
    ap.add_argument("--keys", default="8192,32784")
    ap.add_argument("--configs", default="128x3,64x4", help="block_s x stages, comma-separated")
    ap.add_argument("--batch", type=int, default=64, help="with --decode: batch rows (queries)")
    ap.add_argument("--decode-forms", default="1,2x256x2,4x256x2,4x128x3,fp4",
                    help="with --decode: DecodeIndexConfig forms as tiles[x tile_keys x stages], the first "
                    "the reference for the same-bits checks; 'fp4': the FP4 form over the cache as stored "
                    "(decode_fp4), timed against XLA's decode of the cache + the first form")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    t = args.queries
    interpreter = None
    if jax.default_backend() != "gpu":   # a smoke run of this script: the kernel in the interpreter
        from pallas_kernels.interpret import gpu_interpreter

        interpreter = gpu_interpreter()   # (held: its contexts close when it is collected)
    if args.decode:
        if args.keys == ap.get_default("keys"):
            args.keys = "4352,33024"     # a 4k and a 32k context's index entries at ratio 1 (256-aligned)
        rc = decode_main(args)
        if interpreter is not None:
            interpreter.close()
        return rc
    configs = [IndexScoresConfig(*(int(v) for v in c.split("x"))) for c in args.configs.split(",")]
    res = dict(jax=jax.__version__, device=str(jax.devices()[0]), dense_tflops=dense_tflops(), rows=[], checks={})
    print(f"{res['device']}; jax {res['jax']}; dense bf16 {res['dense_tflops']:.0f} TFLOP/s", flush=True)

    # checks, at S = the first key count
    s = int(args.keys.split(",")[0])
    q, k, w = inputs(jax.random.key(0), 2, t, s)
    n_vis = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + (s - t + 1), (2, t))
    kern = jax.jit(lambda q, k, w, nv: index_scores_pallas(q, k, w, nv, config=configs[0]))
    full = np.asarray(kern(q, k, w, None))
    res["checks"] = kernel_checks(full, np.asarray(index_scores_reference(q, k, w)),
                                  np.asarray(kern(q[1:], k[1:], w[1:], None)), full[1:],
                                  np.asarray(kern(q, k, w, n_vis)),
                                  np.arange(s)[None, None, :] < np.asarray(n_vis)[:, :, None])
    print(f"checks: {res['checks']}", flush=True)
    del q, k, w, full

    xla = jax.jit(index_scores_xla)
    for s in (int(v) for v in args.keys.split(",")):
        q, k, w = inputs(jax.random.key(s), 1, t, s)
        causal = jnp.arange(t, dtype=jnp.int32)[None] + (s - t + 1)
        xla_ms = median_ms(xla, q, k, w)
        for cfg in configs:
            kern = jax.jit(lambda q, k, w, nv, cfg=cfg: index_scores_pallas(q, k, w, nv, config=cfg))
            for label, nv in (("full", None), ("causal", causal)):
                ms = median_ms(kern, q, k, w, nv)
                vis = t * s if nv is None else int(causal.sum())
                tflops = 2 * vis * H * D / ms / 1e9
                row = dict(keys=s, config=f"{cfg.block_s}x{cfg.stages}", visibility=label, kernel_ms=ms,
                           xla_ms=xla_ms, speedup_vs_xla=xla_ms / ms, tflops=tflops,
                           dense_fraction=tflops / res["dense_tflops"])
                res["rows"].append(row)
                print(f"S={s:6d} {row['config']:6s} {label:6s}: kernel {ms:7.3f} ms, XLA {xla_ms:7.3f} ms "
                      f"({xla_ms / ms:.2f}x), {tflops:6.1f} TFLOP/s = {row['dense_fraction']:.0%} of dense",
                      flush=True)
    write_results(args.out, "indexer_gpu.json", res)
    if interpreter is not None:
        interpreter.close()
    return 0 if checks_pass(res["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
