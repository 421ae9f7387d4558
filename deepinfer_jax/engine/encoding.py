"""DeepSeek-V4.1 prompt encoding (spec §6) and the inverse split of a generated completion.

There is no Jinja template: the release builds prompts in Python (``encoding/encoding.py``). This module
follows the structure of the "adapted from the release reference" V4.1 encoder described in the spec:

* ``<｜begin▁of▁sentence｜>``; the first message is preceded by ``<｜System｜>`` when it is a system message
  or when thinking mode adds ``Reasoning Effort: {N} (range 1-100, ...)\\n\\n`` (index 0 only); later system
  messages get their own ``<｜System｜>`` and count as a user turn (they open an assistant turn).
* user text follows ``<｜User｜>``; developer messages are rendered as ``<｜User｜>`` too; ``tool`` messages are
  merged into the user turn as ``<tool_result>…</tool_result>`` blocks (blocks of one turn joined by
  "\\n\\n", tool results sorted into the order of the calls when ``tool_call_id`` says so); consecutive
  user messages merge the same way.
* after a user-like turn that an assistant turn (or a latest_reminder) follows, or that ends the
  conversation: ``<｜Assistant｜>`` then ``<think>`` (thinking mode, current turn) or ``</think>``.
  An assistant message renders ``{reasoning}</think>`` (thinking mode, only turns after the last user
  turn unless tools are present), its content, ``\\n\\n`` + the DSML calls block, then
  ``<｜end▁of▁sentence｜>``. Earlier developer messages are dropped with the reasoning.
* tools (the ``tools`` argument, or ``tools`` on a system/developer message) render the release's
  "## Tools" section after the system text; DSML tags carry V4.1's leading space
  (``<｜DSML｜ calls>``, ``<｜DSML｜ invoke name="…">``, ``<｜DSML｜ parameter name="…" string="true|false">``).

Reasoning-effort aliases are open question 4 of the spec. The default ``effort_aliases="official"``
follows the open-source encoder's README and the tech report (low 50, high 75 = default, max 100);
``effort_aliases="adapted"`` is the other encoder's table (low 25, high 50 = default, xhigh 75, max 100).
Check the ``encoding/`` folder of the checkpoint revision you serve.

Not supported (rejected with an error, not silently dropped): image content, the internal ``task``
classification tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM, USER, ASSISTANT = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_CLOSE, PARAM_CLOSE = f"</{DSML} invoke>", f"</{DSML} parameter>"

EFFORT_ALIASES: dict[str, dict[str, int]] = {
    "official": {"low": 50, "high": 75, "max": 100},
    "adapted": {"low": 25, "high": 50, "xhigh": 75, "max": 100},
}
DEFAULT_EFFORT = "high"  # both tables name their default "high" (75 resp. 50)
EFFORT_TEMPLATE = ("Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the "
                   "reasoning)\n\n")

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
_USER_LIKE = ("user", "developer")

TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
<{DSML} invoke name="$TOOL_NAME">
<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
<{DSML} invoke name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_TEMPLATE = ("## Response Format:\n\nYou MUST strictly adhere to the following schema to "
                            "reply:\n{}")


class EncodingError(ValueError):
    """A conversation that cannot be encoded; the message names the offending message index."""


class CompletionParseError(EncodingError):
    """Generated text whose DSML tool-call block is malformed (raised only with ``strict=True``)."""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------------------------------
# input validation -> canonical messages
# --------------------------------------------------------------------------------------------------

def effort_value(reasoning_effort: str | int | None, effort_aliases: str = "official") -> int:
    """The integer 1..100 the effort header carries."""
    if effort_aliases not in EFFORT_ALIASES:
        raise EncodingError(f"effort_aliases must be one of {sorted(EFFORT_ALIASES)}, got {effort_aliases!r}")
    table = EFFORT_ALIASES[effort_aliases]
    value = DEFAULT_EFFORT if reasoning_effort is None else reasoning_effort
    if isinstance(value, str):
        if value not in table:
            raise EncodingError(f"reasoning_effort {value!r} is not one of {list(table)} "
                                f"({effort_aliases} aliases) or an int 1..100")
        return table[value]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise EncodingError(f"reasoning_effort must be 1..100 or one of {list(table)}, got {value!r}")
    return value


def _text(value: Any, where: str) -> str | None:
    """Message text: a string, or a list of {"type": "text"} blocks (joined by a blank line)."""
    if value is None or isinstance(value, str):
        text = value
    elif isinstance(value, list):
        parts = []
        for j, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif kind in ("image", "image_url"):
                raise EncodingError(f"{where}: content block {j} is an image; image input is not supported")
            else:
                raise EncodingError(f"{where}: content block {j} must be {{'type': 'text', 'text': str}}, "
                                    f"got {block!r:.80}")
        text = "\n\n".join(parts)
    else:
        raise EncodingError(f"{where}: content must be a string or a list of text blocks, "
                            f"got {type(value).__name__}")
    if text is not None and IMAGE_PLACEHOLDER in text:
        raise EncodingError(f"{where}: text contains the image placeholder {IMAGE_PLACEHOLDER!r}")
    return text


def _tool_schemas(tools: Any, where: str) -> list[dict]:
    if not isinstance(tools, list):
        raise EncodingError(f"{where}: tools must be a list, got {type(tools).__name__}")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EncodingError(f"{where}: tool {j} needs a 'name' (or an OpenAI 'function' with one), "
                                f"got {tool!r:.80}")
        out.append(fn)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """-> [{"id": str | None, "name": str, "arguments": dict}] from OpenAI or flat call dicts."""
    if not isinstance(calls, list):
        raise EncodingError(f"{where}: tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EncodingError(f"{where}: tool call {j} needs a function name, got {call!r:.80}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise EncodingError(f"{where}: tool call {j} ({fn['name']}): arguments are not valid JSON "
                                    f"({e.msg} at char {e.pos})") from e
        if not isinstance(args, dict):
            raise EncodingError(f"{where}: tool call {j} ({fn['name']}): arguments must be a JSON object, "
                                f"got {type(args).__name__}")
        out.append({"id": call.get("id") or fn.get("id"), "name": fn["name"], "arguments": args})
    return out


def _canonical(messages: Any, tools: list | None) -> list[dict]:
    """Validate the input and return one dict per message with the fields rendering needs."""
    if not isinstance(messages, list) or not messages:
        raise EncodingError("messages must be a non-empty list of dicts")
    out: list[dict] = []
    open_calls: list[dict] = []  # calls of the last assistant turn still waiting for their results
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EncodingError(f"message {i}: must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise EncodingError(f"message {i}: role must be one of {list(ROLES)}, got {role!r}")
        where = f"message {i} ({role})"
        if m.get("task") is not None:
            raise EncodingError(f"{where}: the internal 'task' tokens are not supported")
        c = {"role": role, "index": i, "content": _text(m.get("content"), where)}
        if role == "assistant":
            c["reasoning"] = _text(m.get("reasoning_content"), f"{where} reasoning_content")
            c["tool_calls"] = _tool_calls(m["tool_calls"], where) if m.get("tool_calls") else []
            if c["content"] is None and not c["tool_calls"] and c["reasoning"] is None:
                raise EncodingError(f"{where}: missing 'content' (or tool_calls)")
            open_calls = list(c["tool_calls"])
        else:
            if c["content"] is None:
                raise EncodingError(f"{where}: missing 'content'")
            if role == "tool":
                if not open_calls:
                    raise EncodingError(f"{where}: a tool result with no preceding assistant tool call "
                                        "(tool messages must directly follow the assistant turn that made "
                                        "the calls, one per call)")
                call_id = m.get("tool_call_id")
                ids = [k["id"] for k in open_calls]
                if call_id is not None and any(ids):
                    if call_id not in ids:
                        raise EncodingError(f"{where}: tool_call_id {call_id!r} matches no open call "
                                            f"(open: {[k for k in ids if k]})")
                    open_calls.pop(ids.index(call_id))
                else:
                    open_calls.pop(0)
                c["tool_call_id"] = call_id
            else:
                open_calls = []
            if role in ("system", "developer"):
                if m.get("tools"):
                    c["tools"] = _tool_schemas(m["tools"], where)
                if m.get("response_format"):
                    c["response_format"] = m["response_format"]
            elif m.get("tools"):
                raise EncodingError(f"{where}: only system and developer messages may carry tools")
        out.append(c)
    if tools:
        schemas = _tool_schemas(tools, "tools")
        if any(c.get("tools") for c in out):
            raise EncodingError("tools were given both as the tools argument and on a message")
        if out[0]["role"] != "system":
            out.insert(0, {"role": "system", "index": None, "content": ""})
        out[0]["tools"] = schemas
    return out


# --------------------------------------------------------------------------------------------------
# preprocessing: tool results into user turns, dropped reasoning
# --------------------------------------------------------------------------------------------------

def _merge_user_turns(msgs: list[dict]) -> list[dict]:
    """Tool messages become <tool_result> blocks of a user turn; consecutive user turns merge."""
    merged: list[dict] = []
    call_order: dict[str, int] = {}
    for m in msgs:
        if m["role"] == "assistant" and m["tool_calls"]:
            call_order = {k["id"]: j for j, k in enumerate(m["tool_calls"]) if k["id"]}
        if m["role"] in ("user", "tool"):
            block = ("tool", m["content"], call_order.get(m.get("tool_call_id"), 0)) if m["role"] == "tool" \
                else ("text", m["content"], 0)
            if merged and merged[-1]["role"] == "user":
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "index": m["index"], "blocks": [block]})
        else:
            merged.append(m)
    for m in merged:
        if m["role"] == "user":
            # results sorted into call order; text blocks keep their places (a stable sort of the tool slots)
            tool_slots = [j for j, b in enumerate(m["blocks"]) if b[0] == "tool"]
            ordered = sorted((m["blocks"][j] for j in tool_slots), key=lambda b: b[2])
            for j, b in zip(tool_slots, ordered):
                m["blocks"][j] = b
    return merged


def _last_user_turn(msgs: list[dict]) -> int:
    """Index of the last turn that opens an assistant turn (user, developer, or a later system)."""
    for idx in range(len(msgs) - 1, -1, -1):
        if msgs[idx]["role"] in _USER_LIKE or (msgs[idx]["role"] == "system" and idx > 0):
            return idx
    return -1


def _drop_old_reasoning(msgs: list[dict]) -> list[dict]:
    """Before the last user turn: assistant reasoning removed, developer messages dropped."""
    last = _last_user_turn(msgs)
    out = []
    for idx, m in enumerate(msgs):
        if idx >= last or m["role"] in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({**m, "reasoning": None})
    return out


# --------------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------------

def _render_tools(schemas: list[dict]) -> str:
    return TOOLS_TEMPLATE.replace("{schemas}", "\n".join(_json(s) for s in schemas))


def _extras(m: dict) -> str:
    """Tools and response format appended to a system/developer text."""
    out = ""
    if m.get("tools"):
        out += "\n\n" + _render_tools(m["tools"])
    if m.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(_json(m["response_format"]))
    return out


def render_tool_calls(calls: list[dict]) -> str:
    """The DSML block of an assistant turn (without the leading blank line)."""
    invokes = []
    for call in calls:
        params = [f'<{DSML} parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f"{v if isinstance(v, str) else _json(v)}{PARAM_CLOSE}" for k, v in call["arguments"].items()]
        invokes.append(f'<{DSML} invoke name="{call["name"]}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def _where(m: dict) -> str:
    return "the tools system message" if m["index"] is None else f"message {m['index']} ({m['role']})"


def _opens_assistant_turn(msgs: list[dict], idx: int, add_generation_prompt: bool) -> bool:
    """Whether ``<｜Assistant｜>`` + think marker follows message ``idx``: after a user-like turn (user,
    developer, non-initial system) that an assistant message or a latest_reminder follows, or that ends
    the conversation (then only with a generation prompt)."""
    role = msgs[idx]["role"]
    if not (role in _USER_LIKE or (role == "system" and idx > 0)):
        return False
    if idx + 1 == len(msgs):
        return add_generation_prompt
    return msgs[idx + 1]["role"] in ("assistant", "latest_reminder")


def _check_turn_order(msgs: list[dict], add_generation_prompt: bool) -> None:
    """Every assistant message needs an open assistant turn, and so does a generation prompt."""
    header_open = False
    for idx, m in enumerate(msgs):
        if m["role"] == "assistant":
            if not header_open:
                raise EncodingError(f"{_where(m)}: an assistant turn must follow a user, tool, developer or "
                                    "non-initial system message")
            header_open = False
        header_open = header_open or _opens_assistant_turn(msgs, idx, add_generation_prompt)
    if add_generation_prompt and not header_open:
        raise EncodingError(f"{_where(msgs[-1])}: the conversation ends without an open assistant turn, so "
                            "there is nothing to generate (end with a user/tool message, or pass "
                            "add_generation_prompt=False)")


def encode_messages(messages: list[dict[str, Any]], *, thinking: bool = False,
                    reasoning_effort: str | int | None = None, tools: list | None = None,
                    add_generation_prompt: bool = True, effort_aliases: str = "official",
                    drop_thinking: bool = True) -> str:
    """OpenAI-style messages -> the V4.1 prompt string (BOS included; tokenize it with ``encode``).

    ``thinking``: thinking mode (``<think>`` generation prompt, effort header); ``reasoning_effort``: an
    int 1..100 or an alias (see module docstring); ``tools``: OpenAI tool list rendered into the first
    system message; ``add_generation_prompt``: end with ``<｜Assistant｜><think>``/``</think>`` after a
    final user turn; ``drop_thinking``: drop reasoning (and developer messages) of turns before the last
    user turn (always off when tools are present, as in the release).
    """
    effort = effort_value(reasoning_effort, effort_aliases)  # validated in chat mode too
    msgs = _merge_user_turns(_canonical(messages, tools))
    _check_turn_order(msgs, add_generation_prompt)  # on the conversation as given, before any dropping
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        # As in the release, a dropped developer message takes its assistant header with it; the reply
        # that followed is still rendered (without reasoning).
        msgs = _drop_old_reasoning(msgs)
    last_user = _last_user_turn(msgs)
    parts = [BOS]
    for idx, m in enumerate(msgs):
        role = m["role"]
        effort_text = EFFORT_TEMPLATE.format(effort) if thinking and idx == 0 else ""
        if idx == 0 and (effort_text or role == "system"):
            parts.append(SYSTEM)
        parts.append(effort_text)
        if role == "system":
            parts.append(("" if idx == 0 else SYSTEM) + m["content"] + _extras(m))
        elif role == "developer":
            parts.append(USER + m["content"] + _extras(m))
        elif role == "user":
            parts.append(USER + "\n\n".join(text if kind == "text" else f"<tool_result>{text}</tool_result>"
                                             for kind, text, _ in m["blocks"]))
        elif role == "latest_reminder":
            parts.append(LATEST_REMINDER + m["content"])
        else:  # assistant
            if thinking and (not drop or idx > last_user):
                parts.append((m["reasoning"] or "") + END_THINK)
            parts.append(m["content"] or "")
            if m["tool_calls"]:
                parts.append("\n\n" + render_tool_calls(m["tool_calls"]))
            parts.append(EOS)
        if _opens_assistant_turn(msgs, idx, add_generation_prompt):
            parts.append(ASSISTANT + (THINK if thinking and (not drop or idx >= last_user) else END_THINK))
    return "".join(parts)


# --------------------------------------------------------------------------------------------------
# completion parsing
# --------------------------------------------------------------------------------------------------

_INVOKE = re.compile(rf'<{DSML} invoke name="([^"]*)">\n?(.*?)\n?{INVOKE_CLOSE}', re.S)
_PARAM = re.compile(rf'<{DSML} parameter name="([^"]*)" string="(true|false)">(.*?){PARAM_CLOSE}', re.S)


def _parse_calls(block: str, strict: bool) -> list[dict]:
    calls = []
    for name, body in _INVOKE.findall(block):
        args: dict[str, Any] = {}
        for key, is_str, value in _PARAM.findall(body):
            if is_str == "true":
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError as e:
                if strict:
                    raise CompletionParseError(f"tool call {name!r}: parameter {key!r} is marked "
                                               f'string="false" but is not JSON: {value!r:.80}') from e
                args[key] = value  # lenient: keep the model's text rather than lose the call
        calls.append({"name": name, "arguments": args})
    return calls


def parse_completion(text: str, *, thinking: bool = False, strict: bool = False) -> dict[str, Any]:
    """Generated text (decoded with the </think> and ｜DSML｜ tokens kept) -> reasoning, content, calls.

    -> ``{"reasoning_content": str | None, "content": str, "tool_calls": [{"name", "arguments": dict}]}``.
    Text before the first ``</think>`` is the reasoning; in thinking mode a completion without one was cut
    off while reasoning, so all of it is reasoning. A ``<｜DSML｜ calls>`` block in the content is parsed
    into tool calls (string="false" values through JSON); trailing end-of-sentence markers are dropped.
    ``strict`` raises on a malformed block instead of keeping what can be read.
    """
    while text.endswith(EOS):
        text = text[: -len(EOS)]
    reasoning = None
    if END_THINK in text:
        reasoning, text = text.split(END_THINK, 1)
    elif thinking:
        return {"reasoning_content": text, "content": "", "tool_calls": []}
    if CALLS_OPEN not in text:
        return {"reasoning_content": reasoning, "content": text, "tool_calls": []}
    content, block = text.split(CALLS_OPEN, 1)
    content = content.removesuffix("\n\n")
    if CALLS_CLOSE in block:
        block, after = block.split(CALLS_CLOSE, 1)
        content += after.strip()
    elif strict:
        raise CompletionParseError(f"the {CALLS_OPEN} block is not closed (generation cut off?)")
    calls = _parse_calls(block, strict)
    if strict and block.count(f"<{DSML} invoke ") != len(calls):
        raise CompletionParseError(f"{block.count(f'<{DSML} invoke ')} invoke tags but {len(calls)} "
                                   "well-formed calls")
    return {"reasoning_content": reasoning, "content": content, "tool_calls": calls}
