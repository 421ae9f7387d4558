"""``deepinfer-jax``: batch generation from JSONL (and the subcommands other modules plug in)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-v41"


def _prepare(llm, parsed, done: dict) -> tuple[dict[int, dict], list, dict[str, tuple[int, bool]]]:
    """-> (error records by line, requests to run, id -> (line, openai layout))."""
    from deepinfer_jax.engine.encoding import EncodingError, encode_messages
    from deepinfer_jax.engine.requests import LineError

    errors: dict[int, dict] = {}
    jobs, where = [], {}
    first_line: dict[str, int] = {}
    for r in parsed:
        if isinstance(r, LineError):
            errors[r.line] = r.record()
            continue
        if r.request_id in first_line:
            errors[r.line] = LineError(r.line, r.request_id, f"line {r.line}: duplicate id {r.request_id!r} "
                                                             f"(first on line {first_line[r.request_id]})").record()
            continue
        first_line[r.request_id] = r.line
        if r.request_id in done:
            continue
        try:
            prompt = r.prompt if r.messages is None else encode_messages(r.messages, **r.chat)
            jobs.extend(llm.make_requests([prompt], r.params, [r.request_id]))
        except (EncodingError, ValueError, TypeError) as e:
            msg = str(e)
            prefix = f"line {r.line} (id {r.request_id})"
            errors[r.line] = LineError(r.line, r.request_id, msg if msg.startswith(prefix) else f"{prefix}: {msg}").record()
            continue
        where[r.request_id] = (r.line, r.openai)
    return errors, jobs, where


def _write_ordered(path: Path, records: list[dict]) -> None:
    """Atomically replace the results file (a crash leaves the old file, never a half-written one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _generate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.engine.requests import finished_ids, read_requests, read_results, result_record

    in_path, out_path = Path(args.input), Path(args.output)
    if not in_path.exists():
        print(f"deepinfer-jax: input file {in_path} does not exist", file=sys.stderr)
        return 2
    parsed = list(read_requests(in_path))
    previous = read_results(out_path) if args.resume else []
    done = finished_ids(out_path) if args.resume else {}
    try:
        llm = LLM(args.model, max_slots=args.max_slots, max_len=args.max_len, chunk_size=args.chunk_size,
                  numerics=args.numerics, bounded_replay=not args.no_bounded_replay, engine_seed=args.engine_seed,
                  progress=not args.quiet, mesh=args.mesh, device_memory=args.device_memory,
                  compile_cache=args.compile_cache)
    except (OSError, ValueError, MemoryError) as e:
        print(f"deepinfer-jax: cannot start the engine: {e}", file=sys.stderr)
        return 2
    errors, jobs, where = _prepare(llm, parsed, done)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    if not args.resume or not out_path.exists():
        out_path.write_text("", encoding="utf-8")
    new: dict[str, dict] = {}
    bar = tqdm(total=len(jobs), unit="req", desc="generate", disable=args.quiet)
    t0, n_tokens = time.perf_counter(), [0]
    # While running, finished records are appended as they come (so an interrupted run loses nothing
    # finished and a rerun resumes); at the end the file is rewritten in input order.
    with open(out_path, "a", encoding="utf-8") as fh:
        def on_finish(o):
            line, openai = where[o.request_id]
            rec = result_record(line, o.to_dict(), custom=openai)
            new[o.request_id] = rec
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()
            bar.update(1)

        def on_tokens(n):
            n_tokens[0] += n
            bar.set_postfix(tok_s=f"{n_tokens[0] / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)

        if jobs:
            llm.run(jobs, on_finish=on_finish, on_tokens=on_tokens)
    bar.close()

    by_line: dict[int, dict] = dict(errors)
    known_ids = set()
    for r in parsed:
        rid = getattr(r, "request_id", None)
        if rid is None or r.line in errors:
            continue
        known_ids.add(rid)
        by_line[r.line] = new.get(rid) or done[rid]
    # finished records of ids that are not in this input are kept (after the input's), never dropped
    extra = [rec for rec in previous if "error" not in rec and rec.get("id") is not None
             and str(rec["id"]) not in known_ids]
    _write_ordered(out_path, [by_line[k] for k in sorted(by_line)] + extra)
    elapsed = time.perf_counter() - t0
    print(f"deepinfer-jax: {len(jobs)} generated, {len(errors)} error records, "
          f"{len([r for r in parsed if getattr(r, 'request_id', None) in done and r.line not in errors])} "
          f"already done; {n_tokens[0]} tokens in {elapsed:.1f} s ({n_tokens[0] / max(elapsed, 1e-9):.1f} tok/s) "
          f"-> {out_path}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepinfer-jax", description="DeepSeek-V4.1-Flash offline batch inference")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="JSONL requests in, JSONL results out (input order)",
                       description="Each input line is a request (ours or the OpenAI batch layout); each output "
                                   "line its result, in input order, or an error record for that line.")
    g.add_argument("--model", default=str(DEFAULT_TINY), help="checkpoint directory (default: the embedded tiny one)")
    g.add_argument("--input", required=True, help="requests JSONL")
    g.add_argument("--output", required=True, help="results JSONL")
    g.add_argument("--max-slots", "--slots", dest="max_slots", type=int, default=8,
                   help="decode slots: the fixed batch of every step (default 8)")
    g.add_argument("--max-len", type=int, default=256, help="context per slot, prompt + output (default 256)")
    g.add_argument("--chunk-size", "--chunk", dest="chunk_size", type=int, default=16,
                   help="prefill chunk (default 16)")
    g.add_argument("--numerics", default="reference", choices=["reference", "reference-bf16-kv", "exact"])
    g.add_argument("--no-bounded-replay", action="store_true",
                   help="full prefill in every layer (bounded replay is an approximation, on by default)")
    g.add_argument("--engine-seed", type=int, default=0, help="folded into every request's sampling key")
    g.add_argument("--mesh", default=None,
                   help="run over a device mesh of this process's devices, e.g. data=2,tensor=2,expert=2 "
                        "(slots split over data; missing axes are 1; default: one device)")
    g.add_argument("--device-memory", default=None,
                   help="usable bytes per device for the memory check, e.g. 139GiB (default: what the device "
                        "reports)")
    g.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep compiled programs in DIR (jax's persistent compilation cache): later runs with the "
                        "same model and shapes skip compiling, and on a GPU reuse the first run's autotuned "
                        "kernel choices for XLA's GEMMs (default: no cache)")
    g.add_argument("--no-resume", dest="resume", action="store_false",
                   help="overwrite the output instead of skipping the ids it already finished")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
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
