"""The Engram compressed token map (spec §2.2): token id -> id of its normalised surface form.

Each id is decoded alone; text with U+FFFD (a partial UTF-8 sequence) keys on the raw token string,
other text is normalised NFKC -> NFD -> drop combining marks -> lowercase -> collapse whitespace runs to
one space -> strip (a lone " " survives). Keys are numbered in first-appearance order over ids
0..vocab-1. Ids the tokenizer does not define decode to "" and share that key.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

_WS = re.compile(r"[ \t\r\n]+")
_MARKS = {"Mn", "Mc", "Me"}


def normalise(text: str, raw_token: str | None) -> str:
    if "\ufffd" in text:
        return raw_token if raw_token is not None else text
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if unicodedata.category(ch) not in _MARKS).lower()
    s = _WS.sub(" ", s)
    if s == " ":
        return s
    s = s.strip()
    return s if s else text


def compressed_token_map(tokenizer_json: Path | str, vocab_size: int) -> tuple[np.ndarray, int]:
    """-> (int32[vocab_size] compressed id per token id, number of distinct keys)."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = list(range(vocab_size))
    texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
    keys: dict[str, int] = {}
    out = np.empty(vocab_size, np.int32)
    for i, text in zip(ids, texts):
        key = normalise(text, tok.id_to_token(i))
        out[i] = keys.setdefault(key, len(keys))
    return out, len(keys)
