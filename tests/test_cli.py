"""``deepinfer-jax generate`` end to end on the tiny checkpoint: the 100-request example file, input order,
per-line error records, the OpenAI layout, resume after an interruption, and the same bits as the API."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deepinfer_jax.cli import build_parser, main
from deepinfer_jax.engine.llm import LLM
from deepinfer_jax.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "requests.jsonl"
ENGINE_ARGS = ["--max-slots", "4", "--max-len", "64", "--chunk-size", "8"]  # the shape every engine test uses


def _args(ckpt, inp, out, *extra):
    return ["generate", "--model", str(ckpt), "--input", str(inp), "--output", str(out), *ENGINE_ARGS, *extra]


def _records(path):
    return [json.loads(l) for l in Path(path).read_text(encoding="utf-8").splitlines()]


def _ids_in(path):
    out = []
    for l in Path(path).read_text(encoding="utf-8").splitlines():
        o = json.loads(l)
        out.append(str(o.get("id", o.get("custom_id"))))
    return out


@pytest.fixture(scope="module")
def example_run(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "results.jsonl"
    assert main(_args(tiny_ckpt, EXAMPLES, out, "--quiet")) == 0
    return out


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_the_100_request_example(example_run):
    recs = _records(example_run)
    assert len(recs) == 100 and [r["id"] for r in recs] == _ids_in(EXAMPLES)  # input order
    assert [r["line"] for r in recs] == list(range(1, 101))
    assert not [r for r in recs if "error" in r]
    for r in recs:
        assert r["finish_reason"] in ("stop", "length") and len(r["token_ids"]) == len(r["logprobs"]) >= 1
        assert len(r["prompt_token_ids"]) + len(r["token_ids"]) <= 64
    openai = [r for r in recs if "custom_id" in r]
    assert openai and all(r["custom_id"] == r["id"] for r in openai)


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_cli_results_are_the_api_bits(example_run, tiny_ckpt):
    """Three of the 100 requests, run alone through the API with the same ids, give the same bits as they
    did inside the CLI's full batch."""
    recs = {r["id"]: r for r in _records(example_run)}
    lines = [json.loads(l) for l in EXAMPLES.read_text(encoding="utf-8").splitlines()]
    picks = [l for l in lines if "prompt" in l][:2] + [l for l in lines if "custom_id" in l][:1]
    llm = LLM(tiny_ckpt, max_slots=4, max_len=64, chunk_size=8)
    for line in picks:
        from deepinfer_jax.engine.requests import parse_line
        from deepinfer_jax.engine.encoding import encode_messages

        r = parse_line(json.dumps(line), 1)
        prompt = r.prompt if r.messages is None else encode_messages(r.messages, **r.chat)
        o = llm.generate([prompt], r.params, request_ids=[r.request_id])[0]
        rec = recs[r.request_id]
        assert o.token_ids == rec["token_ids"]
        assert np.array_equal(np.asarray(o.logprobs, np.float32).view(np.uint32),
                              np.asarray(rec["logprobs"], np.float32).view(np.uint32))


BAD_LINES = [
    {"id": "a", "prompt": "Write one sentence about the sea.", "max_tokens": 4, "temperature": 0},
    "this is not json",
    {"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 1, "logprobs": 2},
    {"id": "c", "prompt": "x", "temprature": 0.5},
    {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "A haiku"}], "max_completion_tokens": 2}},
    {"id": "e", "messages": [{"role": "wizard", "content": "?"}]},
    {"id": "a", "prompt": "the same id again"},
    {"id": "f", "prompt": list(range(3, 3 + 70))},  # longer than the 64-token context
    {"id": "g", "prompt": "Fine after all that.", "max_tokens": 2, "stop_token_ids": [10**6]},
    {"id": "h", "prompt": "The last one.", "max_tokens": 3, "temperature": 0.5, "seed": 3, "prompt_logprobs": True},
]


def _write(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n", encoding="utf-8")


def test_malformed_lines_get_error_records_and_the_rest_completes(tiny_ckpt, tmp_path, capsys):
    inp, out = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    _write(inp, BAD_LINES)
    assert main(_args(tiny_ckpt, inp, out)) == 0  # with the progress bar
    recs = _records(out)
    assert [r["line"] for r in recs] == list(range(1, 11))  # one record per line, in input order
    errors = {r["line"]: r["error"] for r in recs if "error" in r}
    assert sorted(errors) == [2, 4, 6, 7, 8, 9]
    assert errors[2].startswith("line 2: invalid JSON")
    assert errors[4] == ("line 4 (id c): unknown sampling field(s) ['temprature']; known: "
                         + str(sorted(SamplingParams.field_names())))
    assert errors[6].startswith("line 6 (id e): message 0: role must be one of")
    assert errors[7] == "line 7: duplicate id 'a' (first on line 1)"
    assert errors[8].startswith("line 8 (id f): request 'f': prompt has 70 tokens, the context holds 64")
    assert errors[9].startswith("line 9 (id g): request 'g': stop_token_ids [1000000] outside [0, 129280)")
    done = {r["id"]: r for r in recs if "error" not in r}
    assert len(done["a"]["token_ids"]) == 4 and done["a"]["finish_reason"] == "length"
    assert len(done["b"]["top_logprobs"]) == len(done["b"]["token_ids"])
    assert done["d"]["custom_id"] == "d" and len(done["d"]["token_ids"]) <= 2
    assert done["h"]["prompt_logprobs"][0] is None
    err = capsys.readouterr().err
    assert "tok_s=" in err and "4 generated, 6 error records" in err


def test_resume_after_an_interruption(tiny_ckpt, tmp_path, capsys):
    inp, out = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    _write(inp, BAD_LINES)
    assert main(_args(tiny_ckpt, inp, out, "--quiet")) == 0
    full = _records(out)
    # an interrupted run: 'd' and 'a' finished (in completion order), an error record, a torn last line
    by_id = {r["id"]: r for r in full if "error" not in r or r["id"] == "c"}  # (line 7 repeats id a)
    marked = dict(by_id["a"], text="kept from the first run")
    out.write_text(json.dumps(by_id["d"]) + "\n" + json.dumps(marked) + "\n" + json.dumps(by_id["c"]) + "\n"
                   + '{"id": "b", "tex', encoding="utf-8")
    capsys.readouterr()
    assert main(_args(tiny_ckpt, inp, out, "--quiet")) == 0
    assert "2 generated" in capsys.readouterr().err  # b and h only
    again = _records(out)
    assert [r["line"] for r in again] == list(range(1, 11))
    assert again[0]["text"] == "kept from the first run"  # line 1, id a: not regenerated
    assert again[1:] == full[1:]  # every other line: the same record (bits) in the same place
    # --no-resume starts over
    assert main(_args(tiny_ckpt, inp, out, "--quiet", "--no-resume")) == 0
    assert _records(out) == full


def test_finished_records_of_other_inputs_are_kept(tiny_ckpt, tmp_path):
    inp, out = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    _write(inp, [BAD_LINES[0]])
    other = {"id": "zz", "line": 1, "text": "from another input", "token_ids": [5]}
    out.write_text(json.dumps(other) + "\n", encoding="utf-8")
    assert main(_args(tiny_ckpt, inp, out, "--quiet")) == 0
    recs = _records(out)
    assert [r["id"] for r in recs] == ["a", "zz"] and recs[1] == other


def test_usage_errors(tmp_path, capsys):
    assert main(["generate", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    inp = tmp_path / "r.jsonl"
    _write(inp, [BAD_LINES[0]])
    assert main(["generate", "--model", str(tmp_path), "--input", str(inp), "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "cannot start the engine" in err and "no config.json" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--input", "x"])  # --output is required
    args = build_parser().parse_args(["generate", "--input", "i", "--output", "o", "--slots", "3", "--chunk", "4"])
    assert (args.max_slots, args.chunk_size, args.resume) == (3, 4, True)
