"""The DeepSeek-V4.1 prompt encoding and the completion parser."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))

import tiny_tokenizer  # noqa: E402

from deepinfer_jax.engine.encoding import (  # noqa: E402
    CompletionParseError, EncodingError, encode_messages, parse_completion, render_tool_calls)
from deepinfer_jax.engine.tokenizer import Tokenizer  # noqa: E402

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
S, U, A, R = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
T, ET = "<think>", "</think>"


def effort(n: int) -> str:
    return f"{S}Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    tiny_tokenizer.build_tiny_tokenizer(out)
    return Tokenizer.from_dir(out)


SYS_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
MULTI_TURN = [{"role": "user", "content": "Q1"},
              {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
              {"role": "user", "content": "Q2"}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
TOOL_CONV = [{"role": "user", "content": "Weather in Hangzhou?"},
             {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
              "tool_calls": [{"id": "c1", "type": "function",
                              "function": {"name": "get_weather",
                                           "arguments": json.dumps({"city": "Hangzhou", "days": 2})}}]},
             {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:

<｜DSML｜ calls>
<｜DSML｜ invoke name="$TOOL_NAME">
<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>
...
</｜DSML｜ invoke>
<｜DSML｜ invoke name="$TOOL_NAME2">
...
</｜DSML｜ invoke>
</｜DSML｜ calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
WEATHER_CALL = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
                '<｜DSML｜ parameter name="city" string="true">Hangzhou</｜DSML｜ parameter>\n'
                '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
                '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


# ---------------------------------------------------------------------------------------------------
# exact prompts
# ---------------------------------------------------------------------------------------------------

def test_chat_mode():
    assert encode_messages(SYS_USER) == f"{B}{S}Be brief.{U}Hi{A}{ET}"
    assert encode_messages(SYS_USER[1:]) == f"{B}{U}Hi{A}{ET}"
    assert encode_messages(SYS_USER, add_generation_prompt=False) == f"{B}{S}Be brief.{U}Hi"


def test_thinking_mode_and_effort():
    assert encode_messages(SYS_USER, thinking=True) == f"{B}{effort(75)}Be brief.{U}Hi{A}{T}"
    assert encode_messages(SYS_USER[1:], thinking=True) == f"{B}{effort(75)}{U}Hi{A}{T}"
    for value, n in [("low", 50), ("high", 75), ("max", 100), (37, 37), (1, 1), (100, 100)]:
        assert encode_messages(SYS_USER, thinking=True, reasoning_effort=value) == \
            f"{B}{effort(n)}Be brief.{U}Hi{A}{T}"
    # the other reading of the aliases (spec open question 4)
    for value, n in [(None, 50), ("low", 25), ("high", 50), ("xhigh", 75), ("max", 100)]:
        assert encode_messages(SYS_USER, thinking=True, reasoning_effort=value, effort_aliases="adapted") == \
            f"{B}{effort(n)}Be brief.{U}Hi{A}{T}"
    # chat mode has no effort header even when an effort is given
    assert encode_messages(SYS_USER, reasoning_effort="max") == f"{B}{S}Be brief.{U}Hi{A}{ET}"


def test_multi_turn_drops_earlier_reasoning():
    assert encode_messages(MULTI_TURN, thinking=True) == \
        f"{B}{effort(75)}{U}Q1{A}{ET}A1{E}{U}Q2{A}{T}"
    assert encode_messages(MULTI_TURN, thinking=True, drop_thinking=False) == \
        f"{B}{effort(75)}{U}Q1{A}{T}r1{ET}A1{E}{U}Q2{A}{T}"
    assert encode_messages(MULTI_TURN) == f"{B}{U}Q1{A}{ET}A1{E}{U}Q2{A}{ET}"
    # the turn after the last user message keeps its reasoning (a prefilled answer)
    assert encode_messages(MULTI_TURN[:2], thinking=True, add_generation_prompt=False) == \
        f"{B}{effort(75)}{U}Q1{A}{T}r1{ET}A1{E}"


def test_system_developer_reminder_and_merged_user_turns():
    conv = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
            {"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "answer", "reasoning_content": "old"},
            {"role": "system", "content": "mid"}, {"role": "user", "content": "next"}]
    assert encode_messages(conv, thinking=True) == \
        f"{B}{effort(75)}a{S}b{U}hi\n\nthere{A}{ET}answer{E}{S}mid{U}next{A}{T}"
    # a later system message opens the assistant turn itself
    assert encode_messages(conv[:6]) == f"{B}{S}a{S}b{U}hi\n\nthere{A}{ET}answer{E}{S}mid{A}{ET}"
    dev = [{"role": "developer", "content": "rules"}, {"role": "assistant", "content": "ok"},
           {"role": "user", "content": "go"}]
    assert encode_messages(dev) == f"{B}{U}rules{A}{ET}ok{E}{U}go{A}{ET}"
    # thinking mode drops the earlier developer turn, header included, but keeps the reply (as the release)
    assert encode_messages(dev, thinking=True) == f"{B}{effort(75)}ok{E}{U}go{A}{T}"
    # the release renders a trailing reminder after the assistant header it follows
    assert encode_messages([{"role": "user", "content": "hi"}, {"role": "latest_reminder", "content": "rem"}],
                           thinking=True) == f"{B}{effort(75)}{U}hi{A}{T}{R}rem"


def test_tools_calls_and_results():
    prompt = encode_messages(TOOL_CONV, tools=[WEATHER_TOOL])
    assert prompt == (f"{B}{S}\n\n{TOOLS_SECTION}{U}Weather in Hangzhou?{A}{ET}\n\n{WEATHER_CALL}{E}"
                      f'{U}<tool_result>{{"temp": 21}}</tool_result>{A}{ET}')
    # tools switch reasoning dropping off: the tool-calling turn keeps its reasoning in thinking mode
    thinking = encode_messages([{"role": "system", "content": "sys"}] + TOOL_CONV, tools=[WEATHER_TOOL],
                               thinking=True)
    assert thinking == (f"{B}{effort(75)}sys\n\n{TOOLS_SECTION}{U}Weather in Hangzhou?{A}{T}Look it up.{ET}"
                        f'\n\n{WEATHER_CALL}{E}{U}<tool_result>{{"temp": 21}}</tool_result>{A}{T}')
    # tools carried on the system message are the same thing
    on_message = [{"role": "system", "content": "sys", "tools": [WEATHER_TOOL]}] + TOOL_CONV
    assert encode_messages(on_message, thinking=True) == thinking


def test_tool_results_follow_the_call_order():
    calls = [{"id": k, "function": {"name": "lookup", "arguments": {"q": k}}} for k in ("a", "b")]
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "user", "content": "thanks"}]
    prompt = encode_messages(conv)
    assert prompt.endswith(f"{U}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nthanks{A}{ET}")
    assert '<｜DSML｜ invoke name="lookup">\n<｜DSML｜ parameter name="q" string="true">a</｜DSML｜ parameter>' \
        in prompt
    no_args = render_tool_calls([{"name": "now", "arguments": {}}])
    assert no_args == '<｜DSML｜ calls>\n<｜DSML｜ invoke name="now">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'


# ---------------------------------------------------------------------------------------------------
# through the tokenizer
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, conv", [
    ({}, SYS_USER), ({"thinking": True, "reasoning_effort": "max"}, MULTI_TURN),
    ({"tools": [WEATHER_TOOL], "thinking": True}, TOOL_CONV),
    ({}, [{"role": "user", "content": "写一个函数 🤖\n```py\ndef f(): pass\n```"}]),
])
def test_encoded_prompt_round_trips_through_the_tokenizer(tok, kw, conv):
    prompt = encode_messages(conv, **kw)
    ids = tok.encode(prompt)
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[-1] == tok.token_to_id(T if kw.get("thinking") else ET)
    assert ids.count(tok.token_to_id(A)) == prompt.count(A)
    if kw.get("tools"):
        assert ids.count(tok.token_to_id("｜DSML｜")) == prompt.count("｜DSML｜")


# ---------------------------------------------------------------------------------------------------
# parsing completions
# ---------------------------------------------------------------------------------------------------

def test_parse_completion_splits_reasoning_content_and_calls():
    assert parse_completion("plan</think>The answer is 4." + E) == \
        {"reasoning_content": "plan", "content": "The answer is 4.", "tool_calls": []}
    assert parse_completion("Just text") == {"reasoning_content": None, "content": "Just text", "tool_calls": []}
    # thinking mode cut off before </think>: all reasoning
    assert parse_completion("still thinking", thinking=True) == \
        {"reasoning_content": "still thinking", "content": "", "tool_calls": []}
    out = parse_completion("Look it up.</think>\n\n" + WEATHER_CALL + E)
    assert out == {"reasoning_content": "Look it up.", "content": "",
                   "tool_calls": [{"name": "get_weather", "arguments": {"city": "Hangzhou", "days": 2}}]}


def test_parse_inverts_the_assistant_rendering():
    turn = {"role": "assistant", "reasoning_content": "why\nbecause", "content": "Calling two tools.",
            "tool_calls": [{"name": "search", "arguments": {"q": "jax 0.11", "k": 5, "filters": {"lang": ["en"]},
                                                            "exact": True, "note": None}},
                           {"name": "now", "arguments": {}}]}
    conv = [{"role": "user", "content": "go"}, turn]
    prompt = encode_messages(conv, thinking=True, add_generation_prompt=False)
    generated = prompt.split(f"{A}{T}", 1)[1]  # what the model would have produced after the header
    parsed = parse_completion(generated, thinking=True)
    assert parsed == {"reasoning_content": turn["reasoning_content"], "content": turn["content"],
                      "tool_calls": turn["tool_calls"]}


def test_parse_works_on_the_engines_default_text(tok):
    # the engine streams text with skip_special_tokens=True: </think> and ｜DSML｜ must survive that
    generated = "Look it up.</think>\n\n" + WEATHER_CALL + E
    text = tok.decode(tok.encode(generated), skip_special_tokens=True)
    assert text == generated[: -len(E)]
    assert parse_completion(text)["tool_calls"] == [{"name": "get_weather",
                                                     "arguments": {"city": "Hangzhou", "days": 2}}]


def test_parse_malformed_calls():
    bad_json = ('</think><｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
                '<｜DSML｜ parameter name="n" string="false">not json</｜DSML｜ parameter>\n'
                '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert parse_completion(bad_json)["tool_calls"] == [{"name": "f", "arguments": {"n": "not json"}}]
    with pytest.raises(CompletionParseError, match="parameter 'n' is marked string=\"false\" but is not JSON"):
        parse_completion(bad_json, strict=True)
    cut = "</think>x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n"
    assert parse_completion(cut) == {"reasoning_content": "", "content": "x", "tool_calls": []}
    with pytest.raises(CompletionParseError, match="not closed"):
        parse_completion(cut, strict=True)


# ---------------------------------------------------------------------------------------------------
# input errors
# ---------------------------------------------------------------------------------------------------

USER = {"role": "user", "content": "a"}


@pytest.mark.parametrize("messages, kw, match", [
    ([], {}, "messages must be a non-empty list"),
    ([USER, {"role": "robot", "content": "b"}], {}, "message 1: role must be one of"),
    ([USER, "hello"], {}, "message 1: must be a dict"),
    ([{"role": "user"}], {}, r"message 0 \(user\): missing 'content'"),
    ([USER, {"role": "assistant"}], {}, r"message 1 \(assistant\): missing 'content' \(or tool_calls\)"),
    ([USER, {"role": "tool", "content": "b"}], {}, r"message 1 \(tool\): a tool result with no preceding"),
    ([USER, {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "name": "f", "arguments": {}}]},
      {"role": "tool", "tool_call_id": "y", "content": "r"}], {}, "tool_call_id 'y' matches no open call"),
    ([USER, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]},
      {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}], {}, r"message 3 \(tool\): a tool result"),
    ([USER, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{oops"}]}], {},
     r"message 1 \(assistant\): tool call 0 \(f\): arguments are not valid JSON"),
    ([USER, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "[1]"}]}], {},
     "arguments must be a JSON object"),
    ([{"role": "assistant", "content": "x"}, USER], {}, r"message 0 \(assistant\): an assistant turn must follow"),
    ([USER, {"role": "assistant", "content": "x"}], {}, "nothing to generate"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "image input"),
    ([{"role": "user", "content": "see <｜deepseek_image｜>"}], {}, "image placeholder"),
    ([{"role": "user", "content": "a", "tools": [WEATHER_TOOL]}], {}, "only system and developer"),
    ([{"role": "system", "content": "s", "tools": [WEATHER_TOOL]}, USER], {"tools": [WEATHER_TOOL]},
     "tools were given both"),
    ([USER], {"tools": [{"type": "function", "function": {}}]}, "tools: tool 0 needs a 'name'"),
    ([USER], {"thinking": True, "reasoning_effort": 0}, "reasoning_effort must be 1..100"),
    ([USER], {"thinking": True, "reasoning_effort": 101}, "reasoning_effort must be 1..100"),
    ([USER], {"thinking": True, "reasoning_effort": True}, "reasoning_effort must be 1..100"),
    ([USER], {"reasoning_effort": "medium"}, "reasoning_effort 'medium' is not one of"),
    ([USER], {"thinking": True, "reasoning_effort": "xhigh"}, "'xhigh' is not one of .* \\(official aliases\\)"),
    ([USER], {"effort_aliases": "vllm"}, "effort_aliases must be one of"),
    ([{"role": "user", "content": "a", "task": "query"}], {}, "'task' tokens are not supported"),
])
def test_encoding_errors_name_the_problem(messages, kw, match):
    with pytest.raises(EncodingError, match=match):
        encode_messages(messages, **kw)
