"""The checkpoint's HF fast tokenizer (``tokenizer.json``) behind a small interface."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"


class Tokenizer:
    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        self.bos_id = self._require(BOS)
        self.eos_id = self._require(EOS)
        self.pad_id = self.hf.token_to_id(PAD)

    @classmethod
    def from_dir(cls, ckpt_dir: str | Path) -> "Tokenizer":
        path = Path(ckpt_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: the checkpoint directory must hold tokenizer.json")
        return cls(HFTokenizer.from_file(str(path)))

    def _require(self, token: str) -> int:
        i = self.hf.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer has no {token!r} token")
        return i

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """No BOS is added (add_bos_token is false in the release); the prompt encoding writes it."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def valid_token_mask(self, vocab_size: int) -> np.ndarray:
        """bool[vocab]: ids this tokenizer defines (the engine never samples the others)."""
        mask = np.zeros(vocab_size, bool)
        ids = np.fromiter(self.hf.get_vocab(with_added_tokens=True).values(), np.int64)
        mask[ids[ids < vocab_size]] = True
        return mask


class IncrementalDecoder:
    """Text of a growing id sequence, emitted without splitting a multi-byte character."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        full = self.tok.decode(self.ids, self.skip)
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next byte(s)
        new = full[len(self.text):]
        self.text = full
        return new
