"""JSONL request records in (ours and the OpenAI batch-file layout) and result records out.

Ours, one object per line:
    {"id": "r1", "prompt": "..." | [token ids] | "messages": [...], <SamplingParams fields>,
     "thinking"?: bool, "reasoning_effort"?: str | int, "tools"?: [...]}
OpenAI batch layout (``vllm run-batch`` / the OpenAI Batch API):
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
     "body": {"messages" | "prompt", "max_tokens" | "max_completion_tokens", "temperature", "top_p",
              "seed", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", ...}}
A line that cannot be used becomes an error record naming the line and the reason; it never stops the
other requests. Results: ``{"id", "line", ...RequestOutput fields}``; errors: ``{"id", "line", "error"}``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

from deepinfer_jax.engine.sampling import SamplingParams

CHAT_OPTIONS = ("thinking", "reasoning_effort", "tools")
OPENAI_KEYS = {"custom_id", "method", "url", "body"}
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
# OpenAI body fields with no effect on one offline completion; accepted and ignored
_OPENAI_IGNORED = {"model", "stream", "user", "store", "metadata", "service_tier"}


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    line: int
    request_id: str
    prompt: str | list[int] | None
    messages: list | None
    params: SamplingParams
    chat: dict[str, Any]  # thinking / reasoning_effort / tools for messages
    openai: bool


@dataclasses.dataclass(frozen=True)
class LineError:
    line: int
    request_id: str | None
    error: str

    def record(self) -> dict:
        return error_record(self.line, self.request_id, self.error)


def error_record(line: int, request_id: str | None, error: str) -> dict:
    return {"id": request_id, "line": line, "error": error}


def result_record(line: int, output: dict, custom: bool = False) -> dict:
    """A RequestOutput.to_dict() as a result line; OpenAI-layout inputs also get their custom_id back."""
    out = dict(output)
    rid = out.pop("request_id")
    rec = {"id": rid, "line": line}
    if custom:
        rec["custom_id"] = rid
    rec.update(out)
    return rec


def _openai_fields(body: dict, where: str) -> dict:
    fields = {}
    for k, v in body.items():
        if k in _OPENAI_IGNORED:
            continue
        if k == "n":
            if v not in (None, 1):
                raise ValueError(f"{where}: n={v!r} is not supported (one completion per request)")
        elif k == "max_completion_tokens":
            fields["max_tokens"] = v
        elif k in ("logprobs", "top_logprobs"):
            continue  # below
        else:
            fields[k] = v
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if isinstance(lp, bool) or lp is None:  # chat: logprobs=true + top_logprobs=n
        if lp:
            fields["logprobs"] = 0 if top is None else top
        elif top not in (None, 0):
            raise ValueError(f"{where}: top_logprobs needs logprobs=true")
    else:  # legacy completions: logprobs=n
        fields["logprobs"] = lp
    return fields


def _sampling(fields: dict, where: str) -> SamplingParams:
    fields = dict(fields)
    for k in ("stop", "stop_token_ids"):
        v = fields.get(k)
        if v is None:
            fields.pop(k, None)
        elif isinstance(v, list):
            fields[k] = tuple(v)
        elif not (k == "stop" and isinstance(v, str)):
            raise ValueError(f"{where}: {k} must be a list{' or a string' if k == 'stop' else ''}, got {v!r}")
    return SamplingParams.from_dict(fields, where)


def _check_prompt(prompt, messages, where: str) -> None:
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if prompt is not None:
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of token ids")
    elif not (isinstance(messages, list) and messages):
        raise ValueError(f"{where}: 'messages' must be a non-empty list")


def parse_line(text: str, line: int) -> ParsedRequest | LineError | None:
    """One JSONL line -> a request, an error naming the line, or None for a blank line."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return LineError(line, None, f"line {line}: invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return LineError(line, None, f"line {line}: expected a JSON object, got {type(obj).__name__}")
    openai = "custom_id" in obj or "body" in obj
    id_key = "custom_id" if openai else "id"
    rid = obj.get(id_key)
    where = f"line {line}"
    try:
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
            raise ValueError(f"{where}: missing or invalid request id ('{id_key}': a string or an integer)")
        rid = str(rid)
        where = f"line {line} (id {rid})"
        if openai:
            unknown = sorted(set(obj) - OPENAI_KEYS)
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {unknown} in an OpenAI batch line; known: {sorted(OPENAI_KEYS)}")
            if obj.get("method", "POST") != "POST":
                raise ValueError(f"{where}: method must be POST, got {obj.get('method')!r}")
            url = obj.get("url")
            if url is not None and url not in OPENAI_URLS:
                raise ValueError(f"{where}: url must be one of {sorted(OPENAI_URLS)}, got {url!r}")
            body = obj.get("body")
            if not isinstance(body, dict):
                raise ValueError(f"{where}: 'body' must be an object")
            body = dict(body)
        else:
            body = {k: v for k, v in obj.items() if k != "id"}
        prompt, messages = body.pop("prompt", None), body.pop("messages", None)
        _check_prompt(prompt, messages, where)
        if openai and url is not None and (prompt is None) != (OPENAI_URLS[url] == "messages"):
            raise ValueError(f"{where}: {url} takes '{OPENAI_URLS[url]}'")
        chat = {k: body.pop(k) for k in CHAT_OPTIONS if k in body}
        if chat and messages is None:
            raise ValueError(f"{where}: {sorted(chat)} only apply to 'messages'")
        params = _sampling(_openai_fields(body, where) if openai else body, where)
    except (ValueError, TypeError) as e:
        return LineError(line, rid if isinstance(rid, str) else None, str(e))
    return ParsedRequest(line, rid, prompt, messages, params, chat, openai)


def read_requests(path: Path | str) -> Iterator[ParsedRequest | LineError]:
    """Every non-blank line of a JSONL file, parsed (line numbers start at 1)."""
    with open(path, encoding="utf-8") as fh:
        for i, text in enumerate(fh, start=1):
            r = parse_line(text, i)
            if r is not None:
                yield r


def read_results(path: Path | str) -> list[dict]:
    """The records of an existing results file; a torn line (an interrupted write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def finished_ids(path: Path | str) -> dict[str, dict]:
    """id -> result record, for the ids an existing results file finished (error records do not count)."""
    return {str(r["id"]): r for r in read_results(path) if r.get("id") is not None and "error" not in r}


__all__ = ["LineError", "ParsedRequest", "error_record", "finished_ids", "parse_line", "read_requests",
           "read_results", "result_record"]
