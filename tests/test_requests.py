"""JSONL request parsing (ours and the OpenAI batch layout), error records that name the line, results
files for resuming."""

from __future__ import annotations

import json

import pytest

from deepinfer_jax.engine.requests import (LineError, ParsedRequest, finished_ids, parse_line, read_requests,
                                           read_results, result_record)
from deepinfer_jax.engine.sampling import SamplingParams


def ok(obj, line=1) -> ParsedRequest:
    r = parse_line(json.dumps(obj), line)
    assert isinstance(r, ParsedRequest), r
    return r


def err(text, line=1) -> LineError:
    r = parse_line(text if isinstance(text, str) else json.dumps(text), line)
    assert isinstance(r, LineError), r
    return r


def test_our_layout():
    r = ok({"id": "a", "prompt": "hi", "max_tokens": 3, "temperature": 0, "stop": "\n", "logprobs": 2}, 4)
    assert (r.line, r.request_id, r.prompt, r.messages, r.openai) == (4, "a", "hi", None, False)
    assert r.params == SamplingParams(max_tokens=3, temperature=0.0, stop=("\n",), logprobs=2)
    r = ok({"id": 7, "messages": [{"role": "user", "content": "x"}], "thinking": True, "reasoning_effort": "max",
            "stop_token_ids": [1, 2]})
    assert r.request_id == "7" and r.chat == {"thinking": True, "reasoning_effort": "max"}
    assert r.params.stop_token_ids == (1, 2)
    assert ok({"id": "t", "prompt": [5, 6, 7]}).prompt == [5, 6, 7]  # token ids
    assert ok({"id": "d", "prompt": "x"}).params == SamplingParams()  # defaults


def test_openai_layout():
    chat = ok({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "deepseek", "messages": [{"role": "user", "content": "hi"}],
                        "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3, "stop": ["a", "b"],
                        "presence_penalty": 0.5, "n": 1, "seed": 9}})
    assert chat.openai and chat.request_id == "c1" and chat.messages and chat.prompt is None
    assert chat.params == SamplingParams(max_tokens=5, logprobs=3, stop=("a", "b"), presence_penalty=0.5, seed=9)
    assert ok({"custom_id": "c2", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}}).params.logprobs == 0
    comp = ok({"custom_id": "c3", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "Once", "max_tokens": 2, "logprobs": 4}})  # legacy: logprobs = n
    assert comp.prompt == "Once" and comp.params.logprobs == 4 and comp.params.max_tokens == 2


@pytest.mark.parametrize("line,message", [
    ("not json", "line 9: invalid JSON (Expecting value at column 1)"),
    ("[1, 2]", "line 9: expected a JSON object, got list"),
    ({"prompt": "x"}, "line 9: missing or invalid request id ('id': a string or an integer)"),
    ({"id": True, "prompt": "x"}, "line 9: missing or invalid request id"),
    ({"custom_id": None, "body": {}}, "line 9: missing or invalid request id ('custom_id'"),
    ({"id": "a", "prompt": "x", "messages": []}, "line 9 (id a): give exactly one of 'prompt' or 'messages'"),
    ({"id": "a"}, "line 9 (id a): give exactly one of 'prompt' or 'messages'"),
    ({"id": "a", "prompt": ""}, "line 9 (id a): 'prompt' must be a non-empty string or a list of token ids"),
    ({"id": "a", "prompt": [1, "2"]}, "line 9 (id a): 'prompt' must be a non-empty string or a list of token ids"),
    ({"id": "a", "messages": {}}, "line 9 (id a): 'messages' must be a non-empty list"),
    ({"id": "a", "prompt": "x", "temprature": 0.5}, "line 9 (id a): unknown sampling field(s) ['temprature']"),
    ({"id": "a", "prompt": "x", "top_p": 0}, "line 9 (id a): SamplingParams.top_p must be in (0.0, 1.0]"),
    ({"id": "a", "prompt": "x", "max_tokens": "5"}, "line 9 (id a): SamplingParams.max_tokens must be an integer"),
    ({"id": "a", "prompt": "x", "stop": 5}, "line 9 (id a): stop must be a list or a string"),
    ({"id": "a", "prompt": "x", "thinking": True}, "line 9 (id a): ['thinking'] only apply to 'messages'"),
    ({"custom_id": "c", "body": {"messages": [{"role": "user", "content": "x"}], "n": 2}},
     "line 9 (id c): n=2 is not supported (one completion per request)"),
    ({"custom_id": "c", "body": []}, "line 9 (id c): 'body' must be an object"),
    ({"custom_id": "c", "body": {"prompt": "x"}, "extra": 1}, "line 9 (id c): unknown key(s) ['extra']"),
    ({"custom_id": "c", "method": "GET", "body": {"prompt": "x"}}, "line 9 (id c): method must be POST"),
    ({"custom_id": "c", "url": "/v1/embeddings", "body": {"prompt": "x"}}, "line 9 (id c): url must be one of"),
    ({"custom_id": "c", "url": "/v1/chat/completions", "body": {"prompt": "x"}},
     "line 9 (id c): /v1/chat/completions takes 'messages'"),
    ({"custom_id": "c", "body": {"prompt": "x", "top_logprobs": 2}}, "line 9 (id c): top_logprobs needs logprobs=true"),
])
def test_errors_name_the_line_and_the_reason(line, message):
    e = err(line, 9)
    assert e.error.startswith(message), e.error
    assert e.record() == {"id": e.request_id, "line": 9, "error": e.error}


def test_error_records_keep_the_id_when_known():
    assert err({"id": "a", "prompt": "x", "temprature": 1}).request_id == "a"
    assert err("{bad").request_id is None


def test_read_requests_numbers_lines_and_skips_blanks(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n\n   \nnope\n{"id": "b", "prompt": "y"}\n', encoding="utf-8")
    got = list(read_requests(p))
    assert [(type(r).__name__, r.line) for r in got] == [("ParsedRequest", 1), ("LineError", 4), ("ParsedRequest", 5)]


def test_results_file_for_resume(tmp_path):
    p = tmp_path / "out.jsonl"
    assert finished_ids(p) == {} and read_results(p) == []
    good = result_record(3, {"request_id": "a", "text": "t", "token_ids": [1]})
    assert good == {"id": "a", "line": 3, "text": "t", "token_ids": [1]}
    assert result_record(4, {"request_id": "c", "text": ""}, custom=True)["custom_id"] == "c"
    p.write_text(json.dumps(good) + "\n" + json.dumps({"id": "b", "line": 4, "error": "bad"}) + "\n"
                 + '{"id": "c", "text": "tor', encoding="utf-8")  # a torn last line from an interrupted run
    assert finished_ids(p) == {"a": good}
    assert len(read_results(p)) == 2
