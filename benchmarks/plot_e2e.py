"""Plot the e2e H200 results (benchmarks/e2e_gpu.py output) for the README.

    python benchmarks/plot_e2e.py [benchmarks/results/e2e_gpu_2026-12-05_merged.json] [docs/e2e_h200.png]

Left: decode tokens/s per batch and context, annotated with the step's fewest bytes over its time as a
fraction of the measured copy bandwidth. Right: prefill tokens/s with and without bounded replay.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def runs(results: dict) -> list[dict]:
    """The runs in a results file: a merged file holds several under run_*, a plain one is one run."""
    return [v for k, v in results.items() if k.startswith("run_")] or [results]


def rows(results: dict, section: str) -> list[dict]:
    out = []
    for run in runs(results):
        got = run["sections"].get(section)
        if isinstance(got, list):
            out += [r for r in got if "error" not in r]
    return out


def latest_decode_rows(results: dict) -> list[dict]:
    """One decode row per (batch, context): the last run's, whichever of its two decode sections holds it
    (a decode section that failed at its largest batch keeps the batches before it under "(partial)"),
    with ``own_routing_bytes`` where that run's experts section counted the step's own routing."""
    out = {}
    for run in runs(results):
        counted = run["sections"].get("experts") or []
        own = {(e["batch"], e["context"]): e["total_bytes_own_routing"]
               for e in ([counted] if isinstance(counted, dict) else counted) if "error" not in e}
        for r in rows(run, "kernels-decode (partial)") + rows(run, "decode"):
            key = (r["batch"], r["context"])
            out[key] = dict(r, own_routing_bytes=own.get(key))
    return list(out.values())


def copy_share(row: dict, copy: float | None) -> float | None:
    """The row's bytes over its time as a share of copy bandwidth: its own run's ceiling where it has one
    (the ceilings vary by run), on the bytes its own routing read where they were counted (else the
    expected bytes of uniform routing)."""
    share = row.get("hbm_fraction") or (row["bytes"]["total"] / (row["ms_per_step"] * 1e-3) / copy if copy else None)
    if share and row.get("own_routing_bytes"):
        share *= row["own_routing_bytes"] / row["bytes"]["total"]
    return share


def main(argv=None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    src = Path(argv[0]) if argv else ROOT / "benchmarks" / "results" / "e2e_gpu_2026-12-05_merged.json"
    dst = Path(argv[1]) if len(argv) > 1 else ROOT / "docs" / "e2e_h200.png"
    res = json.loads(src.read_text())
    copy = next((r["copy_Bps"] for r in runs(res) if "copy_Bps" in r), None)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    decode = latest_decode_rows(res)
    for ctx in sorted({r["context"] for r in decode}):
        pts = sorted((r["batch"], r["tokens_per_s"], copy_share(r, copy)) for r in decode if r["context"] == ctx)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"context {ctx}")
        for b, tps, share in pts:
            if share:
                ax1.annotate(f"{share:.0%}", (b, tps), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax1.set(xscale="log", yscale="log", xlabel="batch (slots)", ylabel="decode tokens/s",
            title="decode (labels: bytes/time as a share of copy BW)")
    ax1.legend()
    prefill = {(r["prompt"], r["bounded_replay"]): r for r in rows(res, "prefill")}   # later runs win
    prompts = sorted({p for p, _ in prefill})
    width = 0.38
    for i, br in enumerate((False, True)):
        vals = [prefill[p, br]["tokens_per_s"] for p in prompts]
        ax2.bar([j + (i - 0.5) * width for j in range(len(prompts))], vals, width,
                label="bounded replay " + ("on" if br else "off"))
    ax2.set_xticks(range(len(prompts)), [f"{p} tokens" for p in prompts])
    chunks = "/".join(str(c) for c in sorted({r.get("chunk", 1024) for r in prefill.values()}))
    ax2.set(ylabel="prefill tokens/s", title=f"prefill, one prompt, chunk {chunks}")
    ax2.legend(loc="lower center")
    layers = runs(res)[0]["slice"]["layers"]
    fig.suptitle(f"DeepSeek-V4.1-Flash real-width {layers}-layer slice on one H200 (benchmarks/e2e_gpu.py)")
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=80)
    print(f"wrote {dst}")
    return dst


if __name__ == "__main__":
    main()
