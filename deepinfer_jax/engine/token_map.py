"""The Engram compressed token map (spec §2.2): token id -> id of its normalised surface form.

Every id is decoded alone with the raw ``tokenizers`` backend (special tokens kept). Text holding U+FFFD
(a token that is part of a multi-byte character) is keyed by its raw token string; other text by
NFKC -> NFD -> drop combining marks (Mn/Mc/Me) -> lowercase -> ``[ \\t\\r\\n]+`` to one space -> strip,
except that a text that is exactly one space after the collapse stays " "; an empty result falls back
to the decoded text. Keys are numbered in first-appearance order over ids 0..vocab_size-1.

The normaliser is the ``tokenizers`` one (as the reference builds it), not ``unicodedata``: its Lowercase
maps each character on its own (no final-sigma rule) and its Strip trims Rust's ``char::is_whitespace``
set (which, unlike ``str.strip``, keeps U+001C..U+001F); both change keys of real vocabulary entries.

Ids the tokenizer does not define (the tiny checkpoint leaves 1,403..127,999 and a few special-range ids
undefined) decode to "" and therefore all share the single key "".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

REPLACEMENT_CHAR = "\ufffd"

# Everything up to the whitespace collapse; Strip runs separately so that a lone " " can be kept.
_BEFORE_STRIP = normalizers.Sequence([
    normalizers.NFKC(),
    normalizers.NFD(),
    normalizers.StripAccents(),
    normalizers.Lowercase(),
    normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
])
_STRIP = normalizers.Strip()


def token_key(text: str, raw_token: str | None) -> str:
    """The Engram key of one token: ``text`` is its decoded text, ``raw_token`` its vocabulary string."""
    if REPLACEMENT_CHAR in text:
        if raw_token is None:
            raise ValueError(f"a token decodes to {text!r} (partial UTF-8) but has no vocabulary string")
        return raw_token
    collapsed = _BEFORE_STRIP.normalize_str(text)
    if collapsed == " ":
        return collapsed
    key = _STRIP.normalize_str(collapsed)
    return key if key else text


def compressed_token_map(tokenizer_json: Path | str, vocab_size: int) -> tuple[np.ndarray, int]:
    """-> (int32[vocab_size] compressed id of each token id, number of distinct keys)."""
    path = Path(tokenizer_json)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json to build the Engram token map from")
    tok = Tokenizer.from_file(str(path))
    top = max(tok.get_vocab(with_added_tokens=True).values())
    if top >= vocab_size:
        raise ValueError(f"{path} defines token id {top}, beyond the model's vocab_size {vocab_size}")
    texts = tok.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    table = np.empty(vocab_size, np.int32)
    for i, text in enumerate(texts):
        key = token_key(text, tok.id_to_token(i) if REPLACEMENT_CHAR in text else None)
        table[i] = keys.setdefault(key, len(keys))
    return table, len(keys)
