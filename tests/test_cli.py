"""The CLI end to end on the tiny checkpoint: input order, error records, OpenAI layout, resume."""

from __future__ import annotations

import json

from deepinfer_jax.cli import main
from deepinfer_jax.engine.requests import parse_line, LineError


def test_parse_line_errors_name_the_line():
    assert isinstance(parse_line("not json", 3), LineError) and "line 3: invalid JSON" in parse_line("not json", 3).error
    e = parse_line('{"id": "a", "prompt": "x", "messages": []}', 4)
    assert "line 4 (id a): give exactly one of 'prompt' or 'messages'" == e.error
    e = parse_line('{"prompt": "x"}', 5)
    assert "missing request id" in e.error
    e = parse_line('{"custom_id": "c", "body": {"messages": [{"role": "user", "content": "hi"}], "n": 2}}', 6)
    assert "n=2 is not supported" in e.error
    ok = parse_line('{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
                    '[{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "logprobs": true, '
                    '"top_logprobs": 2, "stop": "x"}}', 7)
    assert ok.request_id == "c" and ok.params.max_tokens == 3 and ok.params.logprobs == 2 and ok.params.stop == ("x",)
    assert parse_line("   ", 8) is None


def test_generate_jsonl_order_errors_and_resume(tiny_ckpt, tmp_path):
    inp = tmp_path / "req.jsonl"
    lines = [
        {"id": "a", "prompt": "Write one sentence about the sea.", "max_tokens": 4, "temperature": 0},
        "this is not json",
        {"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 1},
        {"id": "c", "prompt": "x", "temprature": 0.5},
        {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "A haiku"}], "max_tokens": 2}},
        {"id": "e", "messages": [{"role": "wizard", "content": "?"}]},
    ]
    inp.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(tiny_ckpt), "--input", str(inp), "--output", str(out), "--slots", "2",
            "--max-len", "64", "--chunk", "8", "--quiet"]
    assert main(args) == 0
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r.get("id") for r in recs] == ["a", None, "b", "c", "d", "e"]  # input order
    assert recs[1]["line"] == 2 and "invalid JSON" in recs[1]["error"]
    assert "unknown sampling field(s) ['temprature']" in recs[3]["error"]
    assert "message 0: role must be one of" in recs[5]["error"]
    assert len(recs[0]["token_ids"]) == 4 and recs[0]["finish_reason"] == "length"
    assert len(recs[4]["token_ids"]) == 2
    first = {r["id"]: r for r in recs if "error" not in r}
    # resume: finished ids are skipped, nothing is regenerated, the file is not rewritten
    assert main(args) == 0
    again = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r for r in again if "error" not in r] == list(first.values())
