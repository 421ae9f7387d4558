"""Count the kernels of a compiled program by the model site that made them (no GPU needed).

    ../aotenv/bin/python benchmarks/compile_probe.py --prefill "" --decode 64 --hlo-dir /tmp/hlo
    python3 benchmarks/hlo_sites.py /tmp/hlo/decode_B_64_context_4096.hlo.txt --layer 3 --depth 4

Reads the optimized HLO text that ``compile_probe.py --hlo-dir`` writes and counts the entry
computation's kernel launches (fusions, custom calls such as the Mosaic kernels, sorts, library GEMMs)
by their ``op_name`` metadata, with the layer number folded out (``L/...``), so a change to the glue
around the kernels can be checked for how many launches a step it adds or removes before a GPU run.
A launch on the H200 costs ~3-7 us of GPU time even when it moves almost nothing (session 15's
decode timeline: ~1,000 launches besides the expert GEMMs, ~6 ms of a 26.9 ms step).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_LAUNCH = re.compile(r"\s*(?:ROOT )?\S+ = .*? (fusion|custom-call|sort|cublas-gemm|gemm|copy|scatter|gather)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_LAYER = re.compile(r"layer\d+/")


def entry_launches(hlo_text: str) -> list[tuple[str, str]]:
    """(kind, op_name) for each launching instruction of the ENTRY computation."""
    start = hlo_text.index("\nENTRY")
    body = hlo_text[start:hlo_text.index("\n}\n", start)]
    out = []
    for line in body.split("\n"):
        if (m := _LAUNCH.match(line)) is None:
            continue
        kind = m.group(1)
        if kind == "custom-call" and (t := _TARGET.search(line)) is not None:
            kind = f"custom-call:{t.group(1)}"
        name = _OP_NAME.search(line)
        out.append((kind, name.group(1) if name else ""))
    return out


def site(op_name: str, depth: int) -> str:
    parts = _LAYER.sub("L/", op_name.split(")/", 1)[-1] if op_name.startswith("jit(") else op_name).split("/")
    return "/".join(parts[:depth])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", type=Path)
    ap.add_argument("--layer", type=int, default=None, help="only this layer's launches")
    ap.add_argument("--depth", type=int, default=3, help="op_name components to group by")
    ap.add_argument("--top", type=int, default=60)
    args = ap.parse_args(argv)

    launches = entry_launches(args.hlo.read_text())
    if args.layer is not None:
        launches = [(k, n) for k, n in launches if f"/layer{args.layer}/" in f"/{n}"]
    counts = collections.Counter((k, site(n, args.depth)) for k, n in launches)
    print(f"{len(launches)} launches" + (f" in layer {args.layer}" if args.layer is not None else ""))
    for (kind, where), n in counts.most_common(args.top):
        print(f"{n:5d}  {kind:28s} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
