"""The public offline API, in the shape of vLLM/SGLang's: ``LLM(path).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from deepinfer_jax.checkpoint.loader import load_params
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine.encoding import encode_messages
from deepinfer_jax.engine.sampling import SamplingParams
from deepinfer_jax.engine.scheduler import EngineConfig, Request, Scheduler
from deepinfer_jax.engine.token_map import compressed_token_map
from deepinfer_jax.engine.tokenizer import Tokenizer
from deepinfer_jax.model.cache import cache_bytes
from deepinfer_jax.model.numerics import Numerics

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float]  # log p(sampled token) under the model, per generated token
    top_logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[float | None] | None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["top_logprobs"] is not None:
            d["top_logprobs"] = [{str(k): v for k, v in t.items()} for t in d["top_logprobs"]]
        return d


def _numerics(name: str | Numerics) -> Numerics:
    if isinstance(name, Numerics):
        return name
    table = {"reference": Numerics.reference(), "reference-bf16-kv": Numerics.reference(kv_quant=False),
             "exact": Numerics.exact()}
    if name not in table:
        raise ValueError(f"numerics must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _device_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:  # CPU: physical memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


class LLM:
    """Offline batch inference on one checkpoint directory (official layout)."""

    def __init__(self, model: str | Path, *, max_slots: int = 8, max_len: int = 256, chunk_size: int = 16,
                 numerics: str | Numerics = "reference", bounded_replay: bool = True, engine_seed: int = 0,
                 progress: bool = False):
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: no config.json (expected a checkpoint directory in the official "
                                    f"layout, e.g. a download of {DEFAULT_MODEL})")
        for name, v in (("max_slots", max_slots), ("max_len", max_len), ("chunk_size", chunk_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.cfg = ModelConfig.from_json(path)
        if max_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context "
                             f"({self.cfg.max_position_embeddings} positions)")
        self.numerics = _numerics(numerics)
        self._check_memory(path, max_slots, max_len)
        self.tokenizer = Tokenizer.from_dir(path)
        token_map, n_keys = compressed_token_map(path / "tokenizer.json", self.cfg.vocab_size)
        if self.cfg.engram_layer_ids and n_keys != self.cfg.engram_compressed_vocab_size:
            raise ValueError(f"{path}: the tokenizer gives {n_keys} Engram keys, config.json says "
                             f"engram_compressed_vocab_size={self.cfg.engram_compressed_vocab_size}")
        self.params = load_params(path, self.cfg, progress=progress)
        self.engine_config = EngineConfig(max_slots, max_len, chunk_size, bounded_replay, engine_seed)
        self.scheduler = Scheduler(self.params, self.cfg, self.tokenizer, token_map, self.numerics,
                                   self.engine_config)

    def _check_memory(self, path: Path, slots: int, max_len: int) -> None:
        limit = _device_memory_bytes()
        if limit is None:
            return
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        per_slot = cache_bytes(self.cfg, 1, max_len, self.numerics)
        state = self.cfg.vocab_size * 5  # token counts + seen mask per slot
        need = weights + slots * (per_slot + state)
        if need > 0.9 * limit:
            fits = max(0, int((0.9 * limit - weights) // (per_slot + state)))
            raise MemoryError(f"{slots} slots x max_len {max_len} need {need / 2**30:.2f} GiB "
                              f"(weights {weights / 2**30:.2f} GiB + {per_slot / 2**20:.1f} MiB cache per slot) but "
                              f"the device has {limit / 2**30:.2f} GiB; {fits} slots fit at this max_len")

    # ------------------------------------------------------------------------------------------------
    def _requests(self, prompts, params, ids, prompt_texts) -> list[Request]:
        n = len(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(f"got {n} prompts and {len(params)} sampling params")
        ids = list(ids) if ids is not None else [str(i) for i in range(n)]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        out = []
        for rid, p, sp, text in zip(ids, prompts, params, prompt_texts):
            out.append(Request(rid, list(p), sp, prompt=text))
        return out

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 request_ids: Sequence[str] | None = None, on_finish=None, on_step=None) -> list[RequestOutput]:
        """Prompts are raw strings (tokenized as given, BOS included only if written) or token id lists."""
        if isinstance(prompts, str):
            prompts = [prompts]
        token_prompts, texts = [], []
        for p in prompts:
            if isinstance(p, str):
                token_prompts.append(self.tokenizer.encode(p))
                texts.append(p)
            else:
                token_prompts.append([int(t) for t in p])
                texts.append(None)
        reqs = self._requests(token_prompts, sampling_params, request_ids, texts)
        wrap = (lambda r: on_finish(self._output(r))) if on_finish else None
        self.scheduler.run(reqs, on_finish=wrap, on_step=on_step)
        return [self._output(r) for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, *, thinking: bool = False,
             reasoning_effort: str | int | None = None, tools: list | None = None, **kw) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [encode_messages(c, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools) for c in convs]
        return self.generate(prompts, sampling_params, **kw)

    @staticmethod
    def _output(r: Request) -> RequestOutput:
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, r.text, list(r.generated), r.finish_reason,
                             list(r.logprobs), list(r.top_logprobs) if r.params.logprobs else None,
                             list(r.prompt_logprobs) if r.params.prompt_logprobs else None)


__all__ = ["LLM", "RequestOutput", "SamplingParams"]
