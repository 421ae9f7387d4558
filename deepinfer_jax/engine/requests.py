"""JSONL request records in (ours and the OpenAI batch-file layout) and result records out.

Our layout, one object per line: {"id", "prompt" | "messages", <SamplingParams fields>, "thinking"?,
"reasoning_effort"?}. OpenAI batch layout: {"custom_id", "method", "url", "body": {"prompt" | "messages",
"max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs", ...}}.
A line that cannot be parsed becomes an error record naming the line and the reason; it never stops
the other requests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

from deepinfer_jax.engine.sampling import SamplingParams

_CHAT_KEYS = {"thinking", "reasoning_effort", "tools"}
# OpenAI body fields -> ours
_OPENAI_RENAME = {"max_completion_tokens": "max_tokens", "n": None, "model": None, "stream": None, "user": None}


@dataclasses.dataclass
class ParsedRequest:
    line: int
    request_id: str
    prompt: str | None
    messages: list | None
    params: SamplingParams
    chat: dict[str, Any]
    openai: bool


@dataclasses.dataclass
class LineError:
    line: int
    request_id: str | None
    error: str

    def record(self) -> dict:
        return {"id": self.request_id, "line": self.line, "error": self.error}


def _params(fields: dict, where: str, openai: bool) -> SamplingParams:
    fields = dict(fields)
    if openai:
        for k, v in _OPENAI_RENAME.items():
            if k in fields:
                val = fields.pop(k)
                if k == "n" and val not in (None, 1):
                    raise ValueError(f"{where}: n={val} is not supported (one completion per request)")
                if v:
                    fields[v] = val
        if fields.pop("logprobs", False):
            fields["logprobs"] = int(fields.pop("top_logprobs", 0) or 0)
        else:
            fields.pop("top_logprobs", None)
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    for k in ("stop", "stop_token_ids"):
        if k in fields:
            if not isinstance(fields[k], list):
                raise ValueError(f"{where}: {k} must be a list")
            fields[k] = tuple(fields[k])
    return SamplingParams.from_dict(fields, where)


def parse_line(text: str, line: int) -> ParsedRequest | LineError | None:
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return LineError(line, None, f"line {line}: invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return LineError(line, None, f"line {line}: expected a JSON object, got {type(obj).__name__}")
    openai = "custom_id" in obj
    rid = obj.get("custom_id") if openai else obj.get("id")
    where = f"line {line}"
    try:
        if rid is None or not isinstance(rid, (str, int)):
            raise ValueError(f"{where}: missing request id ('{'custom_id' if openai else 'id'}')")
        rid = str(rid)
        where = f"line {line} (id {rid})"
        if openai:
            unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {unknown}")
            body = obj.get("body")
            if not isinstance(body, dict):
                raise ValueError(f"{where}: 'body' must be an object")
        else:
            body = {k: v for k, v in obj.items() if k != "id"}
        prompt, messages = body.pop("prompt", None), body.pop("messages", None)
        if (prompt is None) == (messages is None):
            raise ValueError(f"{where}: give exactly one of 'prompt' or 'messages'")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        if messages is not None and not (isinstance(messages, list) and messages):
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        chat = {k: body.pop(k) for k in list(body) if k in _CHAT_KEYS}
        params = _params(body, where, openai)
    except (ValueError, TypeError) as e:
        return LineError(line, None if rid is None else str(rid), str(e))
    return ParsedRequest(line, rid, prompt, messages, params, chat, openai)


def read_requests(path: Path) -> Iterator[ParsedRequest | LineError]:
    with open(path, encoding="utf-8") as fh:
        for i, text in enumerate(fh, start=1):
            r = parse_line(text, i)
            if r is not None:
                yield r


def finished_ids(output: Path) -> set[str]:
    """Ids with a complete result record in an existing output file (for resuming)."""
    done: set[str] = set()
    if not output.exists():
        return done
    for text in output.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            continue  # a torn last line from an interrupted run
        if isinstance(rec, dict) and rec.get("id") is not None and "error" not in rec:
            done.add(str(rec["id"]))
    return done
