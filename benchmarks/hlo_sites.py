"""Count the kernels of a compiled program by the model site that made them (no GPU needed).

    ../aotenv/bin/python benchmarks/compile_probe.py --prefill "" --decode 64 --hlo-dir /tmp/hlo
    python3 benchmarks/hlo_sites.py /tmp/hlo/decode_B_64_context_4096.hlo.txt --layer 3 --depth 4

Reads the optimized HLO text that ``compile_probe.py --hlo-dir`` writes and counts the entry
computation's kernel launches (fusions, custom calls such as the Mosaic kernels, sorts, library GEMMs)
by their ``op_name`` metadata, with the layer number folded out (``L/...``), so a change to the glue
around the kernels can be checked for how many launches a step it adds or removes before a GPU run.
A launch on the H200 costs ~3-7 us of GPU time even when it moves almost nothing (session 15's
decode timeline: ~1,000 launches besides the expert GEMMs, ~6 ms of a 26.9 ms step).

``--bytes`` ranks sites by the bytes their launches name instead: each launch's result plus its distinct
operands, at their HLO shapes. For the memory-bound XLA kernels of a prefill chunk that is a lower bound
on what they move (a fusion that reads an operand twice counts it once) and a guide to where the time
goes before a trace; for GEMMs and the Mosaic kernels it says nothing about time. Launches inside a
conditional's branches (the indexer's live-width top-k and its fallback, nested) are counted in every
branch, marked ``[cond]``: one branch runs a call, so their sum over-counts.

``--list`` prints the entry computation's launches in program order instead, each with its whole site
(the op_name, the layer folded out) and the shapes of its result and first operands: what a step does,
launch by launch (``--layer`` picks one layer's).
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
_DEF = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) [\w\-]+\(")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2|f8e8m0fnu|f4e2m1fn)"
                    r"\[([\d,]*)\]")
_BITS = dict(pred=8, s4=4, u4=4, s8=8, u8=8, s16=16, u16=16, s32=32, u32=32, s64=64, u64=64, f16=16, bf16=16,
             f32=32, f64=64, f8e4m3fn=8, f8e5m2=8, f8e8m0fnu=8, f4e2m1fn=4)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=(%[\w.\-]+)")


def shape_bytes(shape_text: str) -> int:
    """Bytes of every array in an HLO shape (a tuple counts all its elements)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BITS[dtype] // 8
    return total


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name (the entry under "ENTRY")."""
    out, name = {}, None
    for line in hlo_text.split("\n"):
        if line.startswith("ENTRY"):
            name = "ENTRY"
            out[name] = []
        elif line.startswith("%") and line.rstrip().endswith("{"):
            name = line[1:].split(" ", 1)[0]
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def launch_bytes(hlo_text: str) -> list[tuple[str, str, int, bool]]:
    """(kind, op_name, bytes, in_branch) for each launch of the entry computation and of the branches
    of its conditionals; bytes: the result plus the distinct operands (instruction names resolve
    module-wide)."""
    comps = computations(hlo_text)
    sizes = {name: shape_bytes(shape) for name, shape in _result_shapes(comps).items()}
    branches, todo = [], ["ENTRY"]
    while todo:   # conditionals nest (a fallback inside a live-width branch)
        found = [b.strip().lstrip("%") for line in comps.get(todo.pop(), []) for m in _BRANCHES.finditer(line)
                 for b in (m.group(1) or m.group(2)).split(",")]
        new = [b for b in dict.fromkeys(found) if b not in branches]
        todo += new
        branches += new
    out = []
    for comp in ["ENTRY", *branches]:
        for line in comps.get(comp, []):
            if (launch := launch_of(line)) is None or (d := _DEF.match(line)) is None:
                continue
            moved = shape_bytes(d.group(2)) + sum(sizes.get(o, 0) for o in _operands(line, d))
            out.append((*launch, moved, comp != "ENTRY"))
    return out


def launch_listing(hlo_text: str) -> list[tuple[str, str, str, list[str]]]:
    """(kind, op_name, result shape, operand shapes) for each launch of the entry computation, in order."""
    comps = computations(hlo_text)
    shapes = _result_shapes(comps)
    out = []
    for line in comps.get("ENTRY", []):
        if (launch := launch_of(line)) is None or (d := _DEF.match(line)) is None:
            continue
        out.append((*launch, d.group(2), [shapes.get(o, "?") for o in _operands(line, d)]))
    return out


def _result_shapes(comps: dict[str, list[str]]) -> dict[str, str]:
    """Every instruction's result shape text, by name (names resolve module-wide)."""
    return {d.group(1): d.group(2) for lines in comps.values() for line in lines
            if (d := _DEF.match(line)) is not None}


def _operands(line: str, d: re.Match) -> list[str]:
    """The distinct operand names of an instruction line (``d``: its ``_DEF`` match), in order."""
    return list(dict.fromkeys(re.findall(r"%([\w.\-]+)", line[d.end():].split(")", 1)[0])))


def entry_launches(hlo_text: str) -> list[tuple[str, str]]:
    """(kind, op_name) for each launching instruction of the ENTRY computation."""
    start = hlo_text.index("\nENTRY")
    body = hlo_text[start:hlo_text.index("\n}\n", start)]
    return [launch for line in body.split("\n") if (launch := launch_of(line)) is not None]


def launch_of(line: str) -> tuple[str, str] | None:
    """(kind, op_name) of an instruction line that launches a kernel, else None."""
    if (m := _LAUNCH.match(line)) is None:
        return None
    kind = m.group(1)
    if kind == "custom-call" and (t := _TARGET.search(line)) is not None:
        kind = f"custom-call:{t.group(1)}"
    name = _OP_NAME.search(line)
    return kind, name.group(1) if name else ""


def site(op_name: str, depth: int) -> str:
    parts = _LAYER.sub("L/", op_name.split(")/", 1)[-1] if op_name.startswith("jit(") else op_name).split("/")
    return "/".join(parts[:depth])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", type=Path)
    ap.add_argument("--layer", type=int, default=None, help="only this layer's launches")
    ap.add_argument("--depth", type=int, default=3, help="op_name components to group by")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--bytes", action="store_true", help="rank sites by the bytes their launches name")
    ap.add_argument("--list", action="store_true", help="the launches in program order, with their shapes")
    args = ap.parse_args(argv)

    if args.list:
        rows = launch_listing(args.hlo.read_text())
        if args.layer is not None:
            rows = [r for r in rows if f"/layer{args.layer}/" in f"/{r[1]}"]
        for i, (kind, name, result, operands) in enumerate(rows):
            where = site(name, 99)
            print(f"{i:4d} {kind[:24]:24s} {where[:80]:80s} -> {result[:48]}  <- {', '.join(o[:32] for o in operands[:4])}")
        return 0

    if args.bytes:
        rows = launch_bytes(args.hlo.read_text())
        if args.layer is not None:
            rows = [r for r in rows if f"/layer{args.layer}/" in f"/{r[1]}"]
        total = collections.Counter()
        count = collections.Counter()
        for kind, name, moved, in_branch in rows:
            key = (kind, site(name, args.depth) + (" [cond]" if in_branch else ""))
            total[key] += moved
            count[key] += 1
        print(f"{len(rows)} launches, {sum(total.values()) / 1e9:.2f} GB named"
              + (f" in layer {args.layer}" if args.layer is not None else ""))
        for (kind, where), moved in total.most_common(args.top):
            print(f"{moved / 1e9:9.3f} GB {count[kind, where]:5d}  {kind:28s} {where}")
        return 0

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
