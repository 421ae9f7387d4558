"""The checkpoint's HF fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) behind a small
interface, and an incremental detokenizer for streaming.

As in the release's tokenizer_config.json (add_bos_token false), ``encode`` adds nothing: the prompt
encoding (``engine.encoding``) writes BOS itself. Special-token text inside ``encode``'s input is
tokenised as the special token, which is how the encoded prompt's markers become their ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

DEFAULT_BOS = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS = "<｜end▁of▁sentence｜>"
DEFAULT_PAD = "<｜▁pad▁｜>"
REPLACEMENT_CHAR = "\ufffd"


def _token_content(value, key: str, path: Path) -> str | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {key!r} must be a string or an object with 'content', got {value!r}")


class Tokenizer:
    """``hf``: the ``tokenizers.Tokenizer``; bos/eos/pad: token strings (defaults: DeepSeek's)."""

    def __init__(self, hf: HFTokenizer, *, bos: str = DEFAULT_BOS, eos: str = DEFAULT_EOS,
                 pad: str | None = DEFAULT_PAD, source: str = "tokenizer"):
        self.hf = hf
        self.source = source
        self.bos_id = self._require(bos, "bos")
        self.eos_id = self._require(eos, "eos")
        # V4's tokenizer_config uses EOS as pad, V4.1's config.json says id 2 (spec §10.5); either way a
        # missing pad token is not fatal for single-sequence inference.
        self.pad_id = None if pad is None else self.hf.token_to_id(pad)
        self._vocab = self.hf.get_vocab(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, ckpt_dir: str | Path) -> "Tokenizer":
        ckpt_dir = Path(ckpt_dir)
        path = ckpt_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the checkpoint directory must hold tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error alone does not say which file
            raise ValueError(f"{path}: not a loadable HF tokenizer.json ({e})") from e
        names = {"bos": DEFAULT_BOS, "eos": DEFAULT_EOS, "pad": DEFAULT_PAD}
        cfg_path = ckpt_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path}: invalid JSON at line {e.lineno}: {e.msg}") from e
            for name in names:
                key = f"{name}_token"
                if key in cfg:
                    names[name] = _token_content(cfg[key], key, cfg_path)
            if cfg.get("add_bos_token") or cfg.get("add_eos_token"):
                raise ValueError(f"{cfg_path}: add_bos_token/add_eos_token are set; this engine expects "
                                 "the release's false (the prompt encoding writes BOS)")
        return cls(hf, **names, source=str(path))

    def _require(self, token: str | None, what: str) -> int:
        i = None if token is None else self.hf.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.source}: no {what} token {token!r}")
        return i

    # lookups
    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(int(token_id))

    @property
    def max_token_id(self) -> int:
        return max(self._vocab.values())

    # text <-> ids
    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def valid_token_mask(self, vocab_size: int) -> np.ndarray:
        """bool[vocab_size]: ids this tokenizer defines (the engine masks the others out of sampling)."""
        ids = np.fromiter(self._vocab.values(), np.int64, count=len(self._vocab))
        if ids.max() >= vocab_size:
            raise ValueError(f"{self.source} defines token id {int(ids.max())}, beyond vocab_size {vocab_size}")
        mask = np.zeros(vocab_size, bool)
        mask[ids] = True
        return mask


class IncrementalDecoder:
    """Streams the text of a growing id sequence: ``push(id)`` returns the text that id completes.

    Text is held back while the decoded tail ends in U+FFFD (an incomplete multi-byte character, or a
    token whose text depends on the next one); ``flush()`` returns whatever is still held at the end, so
    the pieces of all pushes plus ``flush()`` concatenate to ``tok.decode(ids)``. A push re-decodes only
    the window from the previously emitted piece on (the scheme vLLM uses): O(window), not O(sequence),
    and the one-piece overlap gives decoders that treat a sequence start specially the context they need.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""    # everything emitted so far
        self._prefix = 0  # window start: the first id of the last emitted piece
        self._read = 0    # ids before this are fully emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        done = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        full = self.tok.decode(self.ids[self._prefix:], self.skip)
        if full.endswith(REPLACEMENT_CHAR) or not full.startswith(done):
            return ""
        piece = full[len(done):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """The held-back text (a sequence that ends inside a character ends in U+FFFD, as decode does)."""
        full = self.tok.decode(self.ids, self.skip)
        if not full.startswith(self.text):
            raise RuntimeError("the tokenizer's decoder rewrote already streamed text; "
                               f"streamed {self.text[-40:]!r}, full decode ends {full[-40:]!r}")
        piece = full[len(self.text):]
        self._prefix = self._read = len(self.ids)
        self.text = full
        return piece
