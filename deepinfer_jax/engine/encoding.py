"""DeepSeek-V4.1 prompt encoding (spec §6): BOS, optional reasoning-effort system header, roles,
<think> / </think> generation prompt, DSML tool calls, tool results inside user turns.

Reasoning-effort aliases are an open question in the spec (§10.4); the default follows the reading of
the official notes (low 50, high 75 = default, max 100); ``effort_aliases="adapted"`` selects the other
reading (low 25, high 50, xhigh 75, max 100).
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM, USER, ASSISTANT = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
EFFORT_ALIASES = {
    "official": {"low": 50, "high": 75, "max": 100},
    "adapted": {"low": 25, "high": 50, "xhigh": 75, "max": 100},
}
DEFAULT_EFFORT = {"official": "high", "adapted": "high"}
ROLES = {"system", "developer", "user", "assistant", "tool", "latest_reminder"}


class EncodingError(ValueError):
    pass


def _effort(value: str | int | None, aliases: str) -> int:
    table = EFFORT_ALIASES[aliases]
    value = DEFAULT_EFFORT[aliases] if value is None else value
    if isinstance(value, str):
        if value not in table:
            raise EncodingError(f"reasoning_effort {value!r} is not one of {sorted(table)} (or an int 1-100)")
        return table[value]
    if not isinstance(value, int) or not 1 <= value <= 100:
        raise EncodingError(f"reasoning_effort must be 1..100, got {value!r}")
    return value


def _tool_calls(calls: list[dict]) -> str:
    out = [f"<{DSML} calls>"]
    for c in calls:
        fn = c.get("function", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        out.append(f"<{DSML} invoke name=\"{fn['name']}\">")
        for k, v in args.items():
            is_str = isinstance(v, str)
            text = v if is_str else json.dumps(v, ensure_ascii=False)
            out.append(f"<{DSML} parameter name=\"{k}\" string=\"{'true' if is_str else 'false'}\">{text}</{DSML} parameter>")
        out.append(f"</{DSML} invoke>")
    out.append(f"</{DSML} calls>")
    return "\n".join(out)


def encode_messages(messages: list[dict[str, Any]], *, thinking: bool = False,
                    reasoning_effort: str | int | None = None, tools: list | None = None,
                    add_generation_prompt: bool = True, effort_aliases: str = "official") -> str:
    if effort_aliases not in EFFORT_ALIASES:
        raise EncodingError(f"effort_aliases must be one of {sorted(EFFORT_ALIASES)}")
    if not isinstance(messages, list) or not messages:
        raise EncodingError("messages must be a non-empty list")
    parts = [BOS]
    if thinking:
        n = _effort(reasoning_effort, effort_aliases)
        parts.append(f"{SYSTEM}Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough "
                     f"the reasoning)\n\n")
    if tools:
        parts.append(("" if thinking else SYSTEM) + "## Tools\n" + json.dumps(tools, ensure_ascii=False) + "\n\n")
    last_user = max((i for i, m in enumerate(messages) if m.get("role") in ("user", "tool")), default=-1)
    pending_calls = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise EncodingError(f"message {i}: role must be one of {sorted(ROLES)}, got {m!r:.80}")
        role, content = m["role"], m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise EncodingError(f"message {i} ({role}): missing 'content'")
        if content is not None and not isinstance(content, str):
            raise EncodingError(f"message {i} ({role}): 'content' must be a string")
        if role in ("system", "developer"):
            # the first system text follows BOS (or the effort header); later ones open a System turn
            parts.append(content if i == 0 else f"{SYSTEM}{content}")
        elif role == "latest_reminder":
            parts.append(f"<｜latest_reminder｜>{content}")
        elif role == "user":
            parts.append(f"{USER}{content}")
        elif role == "tool":
            if pending_calls == 0:
                raise EncodingError(f"message {i}: a tool result with no preceding assistant tool call")
            pending_calls -= 1
            prev_tool = i > 0 and messages[i - 1].get("role") == "tool"
            parts.append(("" if prev_tool else USER) + f"<tool_result>{content}</tool_result>")
        else:  # assistant
            parts.append(ASSISTANT)
            reasoning = m.get("reasoning_content")
            # earlier turns' reasoning is dropped, unless tools are in play
            if reasoning and (tools or i > last_user):
                parts.append(f"{THINK}{reasoning}{END_THINK}")
            else:
                parts.append(END_THINK)
            parts.append(content or "")
            if m.get("tool_calls"):
                parts.append(_tool_calls(m["tool_calls"]))
                pending_calls = len(m["tool_calls"])
            parts.append(EOS)
    if add_generation_prompt:
        if messages[-1]["role"] == "assistant":
            raise EncodingError("the last message is an assistant turn; nothing to generate a reply to")
        parts.append(ASSISTANT + (THINK if thinking else END_THINK))
    return "".join(parts)


def parse_completion(text: str, thinking: bool = False) -> dict[str, Any]:
    """Split generated text into reasoning, content and DSML tool calls."""
    reasoning = None
    if END_THINK in text:
        reasoning, text = text.split(END_THINK, 1)
    elif thinking:
        return {"reasoning_content": text, "content": "", "tool_calls": []}
    calls = []
    start = f"<{DSML} calls>"
    if start in text:
        text, rest = text.split(start, 1)
        import re

        for name, body in re.findall(rf"<{DSML} invoke name=\"([^\"]+)\">(.*?)</{DSML} invoke>", rest, re.S):
            args = {}
            for k, is_str, v in re.findall(rf"<{DSML} parameter name=\"([^\"]+)\" string=\"(true|false)\">(.*?)</{DSML} parameter>",
                                           body, re.S):
                args[k] = v if is_str == "true" else json.loads(v)
            calls.append({"name": name, "arguments": args})
    return {"reasoning_content": reasoning, "content": text.strip() if calls else text, "tool_calls": calls}
