"""The tiny tokenizer, the tokenizer wrapper and its incremental decoder, and the Engram token map."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "checkpoints"))

import tiny_tokenizer  # noqa: E402

from deepinfer_jax.engine.token_map import compressed_token_map, token_key  # noqa: E402
from deepinfer_jax.engine.tokenizer import IncrementalDecoder, Tokenizer  # noqa: E402

VOCAB = 129280  # the V4.1 vocabulary the tiny config keeps
N_REGULAR_END = tiny_tokenizer.FIRST_REGULAR_ID + tiny_tokenizer.BPE_VOCAB  # first id after the regular ones


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    tiny_tokenizer.build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


# ---------------------------------------------------------------------------------------------------
# the built tokenizer
# ---------------------------------------------------------------------------------------------------

OFFICIAL_IDS = {  # spec §6
    "<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2,
    "<｜place▁holder▁no▁0｜>": 128000, "<｜place▁holder▁no▁3｜>": 128003,
    "<｜System｜>": 128799, "<｜fim▁hole｜>": 128800, "<｜fim▁begin｜>": 128801, "<｜fim▁end｜>": 128802,
    "<｜User｜>": 128803, "<｜Assistant｜>": 128804, "<|EOT|>": 128805, "<think>": 128821, "</think>": 128822,
    "｜DSML｜": 128825, "<｜latest_reminder｜>": 128828, "<｜action｜>": 128829, "<｜query｜>": 128830,
    "<｜authority｜>": 128831, "<｜domain｜>": 128832, "<｜title｜>": 128836, "<｜extracted_url｜>": 128844,
    "<｜read_url｜>": 128845, "<｜deepseek_image｜>": 129264,
}


def test_special_tokens_have_their_official_ids(tok):
    for content, i in OFFICIAL_IDS.items():
        assert tok.token_to_id(content) == i, content
        assert tok.id_to_token(i) == content
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    tool_ids = [tok.token_to_id(c) for _, c, _ in tiny_tokenizer.SPECIAL_TOKENS if "tool" in c]
    assert tool_ids == list(range(128806, 128815))
    repo_ids = [i for i, c, _ in tiny_tokenizer.SPECIAL_TOKENS if "repo" in c or "file" in c]
    assert sorted(repo_ids) == list(range(128815, 128821))
    # "｜" is U+FF5C and "▁" U+2581, not look-alikes
    assert "\uff5c" in tok.id_to_token(128803) and "\u2581" in tok.id_to_token(0)


def test_v4_reference_sequence_uses_the_special_ids(tok):
    # the V4 tokenizer test of spec §6; the ordinary ids differ (tiny BPE), the special ones may not
    ids = tok.encode("<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>")
    specials = [i for i in ids if i >= N_REGULAR_END or i < 3]
    assert specials == [128803, 128804, 128821, 128822, 1]
    assert ids[0] == 128803 and ids[-1] == 1


def test_config_files_have_the_release_keys(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    assert cfg["legacy"] is True and cfg["clean_up_tokenization_spaces"] is False
    assert cfg["model_max_length"] == 1048576 and cfg["unk_token"] is None
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<｜begin▁of▁sentence｜>",
                                                                      "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
    spec = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["type"] == "BPE" and spec["decoder"]["type"] == "ByteLevel"
    assert spec["pre_tokenizer"]["pretokenizers"][-1] == {"type": "ByteLevel", "add_prefix_space": False,
                                                          "trim_offsets": True, "use_regex": False}


def test_regular_ids_are_small_and_the_gap_is_undefined(tok):
    mask = tok.valid_token_mask(VOCAB)
    assert 1000 <= N_REGULAR_END - 3 <= 2000  # "about 1,000-2,000" regular tokens
    assert mask[:N_REGULAR_END].all()
    assert not mask[N_REGULAR_END:128000].any()
    assert mask.sum() == N_REGULAR_END + len(tiny_tokenizer.SPECIAL_TOKENS) - 3
    assert not mask[128823] and not mask[129265:].any() and mask[129264]
    assert tok.decode([5000]) == ""  # undefined ids decode to nothing
    with pytest.raises(ValueError, match="defines token id 129264, beyond vocab_size 1000"):
        tok.valid_token_mask(1000)


def test_build_is_deterministic_across_processes(tmp_path, tok_dir):
    # separate processes with different hash seeds: any dependence on set/dict order would show
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, str(ROOT / "checkpoints" / "tiny_tokenizer.py"), str(tmp_path / seed)],
                       check=True, env=env, timeout=120)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        ref = (tok_dir / name).read_bytes()
        assert (tmp_path / "1" / name).read_bytes() == ref
        assert (tmp_path / "2" / name).read_bytes() == ref


def test_committed_checkpoint_tokenizer_is_current(tiny_ckpt, tok_dir):
    """The committed tiny checkpoint must hold exactly what build_tiny_tokenizer writes now."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tiny_ckpt / name).read_bytes() == (tok_dir / name).read_bytes(), (
            f"{tiny_ckpt / name} is stale: regenerate the checkpoint with python checkpoints/make_tiny.py")


ROUND_TRIP_TEXTS = [
    "plain words and   spaces\n\tnewlines\r\n and trailing space ",
    "def f(x):\n    return x ** 2  # 平方\n\nprint(f(12345678))",
    "emoji 🤖🌊👩‍👩‍👧 and ünïcödé, Ελληνικά, русский, العربية",
    "混合 mixed 文本 text，全角标点！カタカナ",
    "control \x00\x01\x1f and \ufffd replacement and \u200b zero width",
    "<｜User｜>special <think>markers</think> inside<｜Assistant｜> text",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < VOCAB for i in ids) and tok.bos_id not in ids  # no BOS added


def test_skip_special_tokens_keeps_the_reasoning_and_dsml_markers(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜><think>r</think>a ｜DSML｜<｜end▁of▁sentence｜>")
    assert tok.decode(ids) == "q<think>r</think>a ｜DSML｜"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<｜begin▁of▁sentence｜><｜User｜>")


def test_from_dir_errors_name_the_file(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}), encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer_config.json: add_bos_token"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<nope>"}), encoding="utf-8")
    with pytest.raises(ValueError, match="no eos token '<nope>'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{\n  oops", encoding="utf-8")
    with pytest.raises(ValueError, match="invalid JSON at line 2"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------------
# incremental decoding
# ---------------------------------------------------------------------------------------------------

def _stream(tok, ids, skip=True):
    dec = IncrementalDecoder(tok, skip)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


def test_incremental_decoder_equals_full_decode_on_random_ids(tok):
    rng = np.random.default_rng(0)
    defined = np.flatnonzero(tok.valid_token_mask(VOCAB))
    byte_tokens = np.arange(3, 3 + 256)  # partial UTF-8 sequences: the hard case for streaming
    for trial in range(200):
        pool = byte_tokens if trial % 2 else defined
        ids = [int(i) for i in rng.choice(pool, size=int(rng.integers(1, 40)))]
        for skip in (True, False):
            pieces, tail = _stream(tok, ids, skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip), (trial, ids)


def test_incremental_decoder_never_splits_a_character(tok):
    text = "a🤖b你好🌊"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # the emoji really are spread over several byte tokens
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) == text and tail == ""
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some pushes had to wait for the rest of a character


def test_incremental_decoder_flushes_an_unfinished_character(tok):
    ids = tok.encode("ok🤖")[:-1]  # cut inside the emoji
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) == "ok" and tail.endswith("\ufffd")
    assert "".join(pieces) + tail == tok.decode(ids)


# ---------------------------------------------------------------------------------------------------
# the Engram compressed token map
# ---------------------------------------------------------------------------------------------------

_RUST_WHITESPACE = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
                       "\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def _key_by_hand(text: str, raw: str | None) -> str:
    """Spec §2.2 spelled out with unicodedata: an independent check of the tokenizers-based key."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) not in ("Mn", "Mc", "Me"))
    s = "".join(c.lower() for c in s)  # per character, as the Rust normaliser does (no final sigma)
    s = re.sub(r"[ \t\r\n]+", " ", s)
    if s == " ":
        return s
    i, j = 0, len(s)
    while i < j and s[i] in _RUST_WHITESPACE:
        i += 1
    while j > i and s[j - 1] in _RUST_WHITESPACE:
        j -= 1
    return s[i:j] or text


@pytest.mark.parametrize("text, key", [
    ("  Héllo\n\tWorld ", "hello world"), (" ", " "), ("\n\n", " "), ("\t \r\n", " "), ("", ""),
    ("ΟΣ", "οσ"),             # per-character lowercase: no final sigma
    ("a\x1c", "a\x1c"),       # U+001C is not Rust whitespace (Python's str.strip would remove it)
    ("ﬁ", "fi"), ("Ａ", "a"), ("\u00a0", " "), ("x\u3000", "x"), ("É", "e"),
    ("\u0301", "\u0301"),     # a lone combining mark normalises to "", which falls back to the text
])
def test_token_key_normalisation(text, key):
    assert token_key(text, None) == key
    assert _key_by_hand(text, None) == key


def test_token_key_of_partial_utf8_is_the_raw_token():
    assert token_key("\ufffd", "ä½") == "ä½"
    with pytest.raises(ValueError, match="partial UTF-8"):
        token_key("a\ufffd", None)


def test_token_map_on_the_tiny_tokenizer(tok, tok_dir):
    table, n = compressed_token_map(tok_dir / "tokenizer.json", VOCAB)
    assert table.dtype == np.int32 and table.shape == (VOCAB,)
    # an independent recount (unicodedata instead of the tokenizers normalisers)
    keys: dict[str, int] = {}
    expect = [keys.setdefault(_key_by_hand(tok.decode([i], False), tok.id_to_token(i)), len(keys))
              for i in range(N_REGULAR_END + 1)]
    assert table[:N_REGULAR_END + 1].tolist() == expect
    assert n == len(set(table.tolist())) == table.max() + 1
    assert n == 1242  # golden for this corpus and tokenizers version: a change here changes the tiny model
    # BOS, EOS and pad are the first three keys; pad = map[2] (spec §2.2)
    assert table[:3].tolist() == [0, 1, 2]
    # every undefined id shares the "" key, first met at the first undefined id
    undefined = ~tok.valid_token_mask(VOCAB)
    assert (table[undefined] == table[N_REGULAR_END]).all() and undefined[N_REGULAR_END]
    # case/space variants of a word share a key; partial UTF-8 byte tokens keep their own
    the = {tok.token_to_id(t) for t in ("the", "Ġthe", "The", "ĠThe")} - {None}
    assert len(the) >= 3 and len({int(table[i]) for i in the}) == 1
    partial = [i for i in range(3, 3 + 256) if "\ufffd" in tok.decode([i])]
    assert len({int(table[i]) for i in partial}) == len(partial)
    # stable: a second build gives the same table
    again, n_again = compressed_token_map(tok_dir / "tokenizer.json", VOCAB)
    assert n_again == n and np.array_equal(table, again)


def test_token_map_errors(tok_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        compressed_token_map(tmp_path / "tokenizer.json", VOCAB)
    with pytest.raises(ValueError, match="defines token id 129264, beyond the model's vocab_size 129000"):
        compressed_token_map(tok_dir / "tokenizer.json", 129000)


def test_committed_checkpoint_config_matches_its_token_map(tiny_ckpt, tiny_cfg):
    _, n = compressed_token_map(tiny_ckpt / "tokenizer.json", tiny_cfg.vocab_size)
    assert n == tiny_cfg.engram_compressed_vocab_size
