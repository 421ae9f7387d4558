"""Tokenizer, incremental decoding, the Engram token map, and the prompt encoding."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))

from deepinfer_jax.engine.encoding import EncodingError, encode_messages, parse_completion  # noqa: E402
from deepinfer_jax.engine.token_map import compressed_token_map, normalise  # noqa: E402
from deepinfer_jax.engine.tokenizer import IncrementalDecoder, Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer.from_dir(tiny_ckpt)


def test_special_ids_are_the_official_ones(tok):
    # spec §6: the V4 tokenizer test sequence
    text = "<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>"
    ids = tok.encode(text)
    assert ids[0] == 128803 and 128804 in ids and 128821 in ids and 128822 in ids and ids[-1] == 1
    for t, i in [("<｜begin▁of▁sentence｜>", 0), ("<｜▁pad▁｜>", 2), ("<｜System｜>", 128799), ("｜DSML｜", 128825),
                 ("<｜deepseek_image｜>", 129264)]:
        assert tok.token_to_id(t) == i
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", ["plain words and   spaces\n\tnewlines", "def f(x):\n    return x ** 2  # 平方",
                                  "emoji 🤖🌊 and ünïcödé", "混合 mixed 文本 text"])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_incremental_decoder_matches_full_decode(tok):
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = [int(i) for i in rng.integers(3, 860, size=15)]
        dec = IncrementalDecoder(tok)
        text = "".join(dec.push(i) for i in ids)
        full = tok.decode(ids)
        assert full.startswith(text) and (text == full or full.endswith("\ufffd"))


def test_valid_mask_and_token_map(tok, tiny_ckpt, tiny_cfg):
    mask = tok.valid_token_mask(tiny_cfg.vocab_size)
    assert mask[:3].all() and mask[128803] and not mask[5000]
    table, n = compressed_token_map(tiny_ckpt / "tokenizer.json", tiny_cfg.vocab_size)
    assert n == tiny_cfg.engram_compressed_vocab_size
    assert table[5000] == table[6000]  # undefined ids share the "" key
    assert normalise("  Héllo\n\tWorld ", None) == "hello world" and normalise(" ", None) == " "
    assert normalise("a\ufffd", "raw") == "raw"
    again, _ = compressed_token_map(tiny_ckpt / "tokenizer.json", tiny_cfg.vocab_size)
    assert np.array_equal(table, again)


def test_tokenizer_build_is_deterministic():
    import tiny_tokenizer

    assert tiny_tokenizer.tokenizer_json() == tiny_tokenizer.tokenizer_json()


B, U, A, S = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"


def test_encoding_chat_and_thinking():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_messages(msgs) == f"{B}Be brief.{U}Hi{A}</think>"
    effort = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert encode_messages(msgs, thinking=True) == f"{B}{S}{effort.format(75)}Be brief.{U}Hi{A}<think>"
    assert effort.format(100) in encode_messages(msgs, thinking=True, reasoning_effort="max")
    assert effort.format(50) in encode_messages(msgs, thinking=True, reasoning_effort="high", effort_aliases="adapted")


def test_encoding_multi_turn_drops_old_reasoning_and_tools():
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "thought"},
            {"role": "user", "content": "Q2"}]
    assert encode_messages(msgs) == f"{B}{U}Q1{A}</think>A1<｜end▁of▁sentence｜>{U}Q2{A}</think>"
    calls = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "", "tool_calls": [{"name": "get", "arguments": {"city": "Hz", "n": 2}}]},
             {"role": "tool", "content": "21C"}]
    s = encode_messages(calls)
    assert '<｜DSML｜ invoke name="get">' in s and '<｜DSML｜ parameter name="city" string="true">Hz' in s
    assert s.endswith(f"{U}<tool_result>21C</tool_result>{A}</think>")
    parsed = parse_completion("plan</think>ok" + s[s.index("<｜DSML｜ calls>"):s.index("<｜end")])
    assert parsed["reasoning_content"] == "plan" and parsed["tool_calls"] == [{"name": "get", "arguments": {"city": "Hz", "n": 2}}]


def test_encoding_errors_name_the_message():
    with pytest.raises(EncodingError, match="message 1: role must be one of"):
        encode_messages([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(EncodingError, match="message 0 \\(user\\): missing 'content'"):
        encode_messages([{"role": "user"}])
    with pytest.raises(EncodingError, match="a tool result with no preceding assistant tool call"):
        encode_messages([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(EncodingError, match="reasoning_effort must be 1..100"):
        encode_messages([{"role": "user", "content": "a"}], thinking=True, reasoning_effort=0)
