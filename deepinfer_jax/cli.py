"""``deepinfer-jax``: batch generation from JSONL (and the tools that plug in)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-v41"


def _generate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from deepinfer_jax.engine.encoding import EncodingError, encode_messages
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.engine.requests import LineError, finished_ids, read_requests

    out_path = Path(args.output)
    done = finished_ids(out_path) if args.resume else set()
    parsed = list(read_requests(Path(args.input)))
    llm = LLM(args.model, max_slots=args.slots, max_len=args.max_len, chunk_size=args.chunk,
              numerics=args.numerics, bounded_replay=not args.no_bounded_replay, progress=not args.quiet)
    results: dict[int, dict] = {}
    jobs = []  # (line, request id, token ids, params, openai)
    seen_ids = set(done)
    for r in parsed:
        if isinstance(r, LineError):
            results[r.line] = r.record()
            continue
        if r.request_id in done:
            continue
        if r.request_id in seen_ids:
            results[r.line] = LineError(r.line, r.request_id, f"line {r.line}: duplicate id {r.request_id!r}").record()
            continue
        seen_ids.add(r.request_id)
        try:
            text = r.prompt if r.prompt is not None else encode_messages(r.messages, **r.chat)
            ids = llm.tokenizer.encode(text)
            if len(ids) >= args.max_len:
                raise ValueError(f"prompt has {len(ids)} tokens; the context holds {args.max_len} (--max-len)")
        except (EncodingError, ValueError, TypeError, KeyError) as e:
            results[r.line] = LineError(r.line, r.request_id, f"line {r.line} (id {r.request_id}): {e}").record()
            continue
        jobs.append((r.line, r.request_id, ids, r.params, text))
    mode = "a" if args.resume and out_path.exists() else "w"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(jobs), unit="req", desc="generate", disable=args.quiet)
    tokens = [0]
    t0 = time.time()
    pending = sorted(results)  # lines whose record is ready, written in input order
    order = sorted([j[0] for j in jobs] + pending)
    next_i = [0]

    with open(out_path, mode, encoding="utf-8") as fh:
        def flush():
            while next_i[0] < len(order) and order[next_i[0]] in results:
                fh.write(json.dumps(results[order[next_i[0]]], ensure_ascii=False) + "\n")
                next_i[0] += 1
            fh.flush()

        line_of = {rid: (line, text) for line, rid, _, _, text in jobs}

        def on_finish(o):
            rec = o.to_dict()
            line, text = line_of[o.request_id]
            rec = {"id": rec.pop("request_id"), **rec, "prompt": text}
            results[line] = rec
            bar.update(1)
            flush()

        def on_step(n):
            tokens[0] += n
            bar.set_postfix(tok_s=f"{tokens[0] / max(time.time() - t0, 1e-9):.1f}")

        flush()
        if jobs:
            llm.generate([j[2] for j in jobs], [j[3] for j in jobs], request_ids=[j[1] for j in jobs],
                         on_finish=on_finish, on_step=on_step)
        flush()
    bar.close()
    errors = sum(1 for r in results.values() if "error" in r)
    print(f"{len(jobs)} requests generated, {errors} error records, {len(done)} skipped (already done); "
          f"{tokens[0]} tokens in {time.time() - t0:.1f} s -> {out_path}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepinfer-jax", description="DeepSeek-V4.1-Flash offline batch inference")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="JSONL requests in, JSONL results out (input order)")
    g.add_argument("--model", default=str(DEFAULT_TINY), help="checkpoint directory (default: the embedded tiny one)")
    g.add_argument("--input", required=True, help="requests JSONL (ours or the OpenAI batch layout)")
    g.add_argument("--output", required=True, help="results JSONL")
    g.add_argument("--slots", type=int, default=8, help="decode slots (fixed batch shape)")
    g.add_argument("--max-len", type=int, default=256, help="context length per slot (prompt + output)")
    g.add_argument("--chunk", type=int, default=16, help="prefill chunk size")
    g.add_argument("--numerics", default="reference", choices=["reference", "reference-bf16-kv", "exact"])
    g.add_argument("--no-bounded-replay", action="store_true", help="full prefill in every layer")
    g.add_argument("--no-resume", dest="resume", action="store_false",
                   help="overwrite the output instead of skipping ids it already holds")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=_generate)
    for mod in ("deepinfer_jax.compare", "deepinfer_jax.planner", "deepinfer_jax.checkpoint.orbax_io"):
        try:
            register = __import__(mod, fromlist=["register_cli"]).register_cli
        except (ImportError, AttributeError):
            continue
        register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
