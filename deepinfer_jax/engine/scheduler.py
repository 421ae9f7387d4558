"""Continuous batching over a fixed number of slots with two fixed step shapes.

* prefill step [slots, chunk]: every slot still in its prompt feeds its next ``chunk`` prompt tokens
  (chunks are cut from position 0, so a request's chunking depends on the request alone); other
  slots are padding (position -1) and their caches are untouched;
* decode step [slots, 1]: every generating slot feeds its last token.
The sampler runs inside the jitted step. Because every step has one of two shapes, nothing recompiles
after warm-up, and because every op is row-local a request's tokens and logprobs are bitwise the same
whatever the other slots hold (tests/test_invariance.py).

The host reads each step's sampled tokens before preparing the next step: the Engram n-gram hash of
the new token is int64 host arithmetic (``model.engram_hash``), so the next step's inputs need it.
While the device runs step N the host has nothing else to prepare; JAX's async dispatch overlaps the
rest (argument transfer, output bookkeeping).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine.sampling import (PARAM_DTYPES, SamplingParams, params_row, request_seed,
                                           row_keys, sample, seed_words)
from deepinfer_jax.engine.tokenizer import IncrementalDecoder, Tokenizer
from deepinfer_jax.model.cache import init_cache
from deepinfer_jax.model.engram_hash import engram_rows
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.transformer import forward_hidden, lm_head


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    # filled while running
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prefilled: int = 0


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8
    max_len: int = 256
    chunk_size: int = 16
    bounded_replay: bool = True  # DeepInfer's default (spec §7): an approximation, see README
    engine_seed: int = 0


def _step(params, cfg: ModelConfig, numerics: Numerics, decode: bool, want_prompt_lp: bool, state, inp,
          valid_v, engine_key):
    cache, counts, seen = state
    rows = jnp.arange(counts.shape[0])
    admit = inp["admit"]
    counts = jnp.where(admit[:, None], 0, counts)
    seen = jnp.where(admit[:, None], False, seen)
    tok, pos = inp["tokens"], inp["positions"]
    in_valid = pos >= 0
    seen = seen.at[rows[:, None], jnp.where(in_valid, tok, counts.shape[1])].set(True, mode="drop")
    if decode:  # decode inputs are the tokens generated last step
        counts = counts.at[rows, jnp.where(in_valid[:, 0], tok[:, 0], counts.shape[1])].add(1, mode="drop")
    h, cache = forward_hidden(params, cfg, cache, tok, pos, inp["engram_rows"], numerics,
                              None if decode else inp["replay_mask"])
    last = inp["last_index"]
    h_last = h[rows, last][:, None]
    logits = lm_head(params, h_last)[:, 0]
    keys = row_keys(engine_key, inp["seeds"], inp["sample_positions"])
    token, lp, top_ids, top_lp = sample(logits, valid_v, counts, seen, inp["sampling"], keys)
    out = {"token": token, "logprob": lp, "top_ids": top_ids, "top_logprobs": top_lp}
    if want_prompt_lp:
        all_logp = jax.nn.log_softmax(jnp.where(valid_v, lm_head(params, h), -jnp.inf), axis=-1)
        nxt = inp["prompt_next"]
        out["prompt_logprobs"] = jnp.take_along_axis(all_logp, jnp.maximum(nxt, 0)[..., None], axis=-1)[..., 0]
    return (cache, counts, seen), out


class Scheduler:
    def __init__(self, params, cfg: ModelConfig, tokenizer: Tokenizer, token_map: np.ndarray, numerics: Numerics,
                 config: EngineConfig):
        self.params, self.cfg, self.tok, self.numerics, self.ec = params, cfg, tokenizer, numerics, config
        self.token_map = np.asarray(token_map, np.int64)
        self.pad_comp = int(self.token_map[cfg.engram_pad_token_id])
        self.valid_v = jnp.asarray(tokenizer.valid_token_mask(cfg.vocab_size))
        self.engine_key = jax.random.key(config.engine_seed, impl="threefry2x32")
        s = config.max_slots
        self.state = (init_cache(cfg, s, config.max_len, numerics),
                      jnp.zeros((s, cfg.vocab_size), jnp.int32), jnp.zeros((s, cfg.vocab_size), bool))
        self.steps = {}
        for decode in (False, True):
            for plp in (False, True):
                self.steps[(decode, plp)] = jax.jit(
                    functools.partial(_step, cfg=cfg, numerics=numerics, decode=decode, want_prompt_lp=plp),
                    donate_argnames=("state",))

    # ------------------------------------------------------------------------------------------------
    def compile_count(self) -> int:
        return sum(f._cache_size() for f in self.steps.values())

    def _engram(self, req: Request, start: int, n: int) -> np.ndarray:
        ids = (req.prompt_ids + req.generated)[: start + n]
        comp = self.token_map[np.asarray(ids, np.int64)]
        hist = comp[max(0, start - (self.cfg.engram_max_ngram_size - 1)):start]
        return engram_rows(self.cfg, comp[start:start + n], hist, self.pad_comp)

    def _inputs(self, slots: list[Request | None], decode: bool, admitted: set[int]) -> tuple[dict, list]:
        cfg, s = self.cfg, self.ec.max_slots
        t = 1 if decode else self.ec.chunk_size
        ne, nc = len(cfg.engram_layer_ids), cfg.engram_columns
        tokens = np.zeros((s, t), np.int32)
        pos = np.full((s, t), -1, np.int32)
        rows = np.zeros((s, t, ne, nc), np.int32)
        replay = np.zeros((s, t), bool)
        last = np.zeros(s, np.int32)
        prompt_next = np.full((s, t), -1, np.int32)
        seeds = np.zeros((s, 2), np.uint32)
        sample_pos = np.zeros(s, np.int32)
        sampling = {k: np.zeros(s, dt) for k, dt in PARAM_DTYPES.items()}
        sampling["top_p"][:] = 1.0
        sampling["repetition_penalty"][:] = 1.0
        samples: list[tuple[int, Request]] = []  # (slot, request) rows whose sample is used
        for b, req in enumerate(slots):
            if req is None:
                continue
            n_prompt = len(req.prompt_ids)
            if decode:
                if req.prefilled < n_prompt:
                    continue
                p = n_prompt + len(req.generated) - 1
                tokens[b, 0] = req.generated[-1]
                pos[b, 0] = p
                rows[b, :1] = self._engram(req, p, 1)
                n = 1
            else:
                if req.prefilled >= n_prompt:
                    continue
                start = req.prefilled
                n = min(t, n_prompt - start)
                tokens[b, :n] = req.prompt_ids[start:start + n]
                pos[b, :n] = np.arange(start, start + n)
                rows[b, :n] = self._engram(req, start, n)
                w = cfg.sliding_window
                replay[b, :n] = (pos[b, :n] >= n_prompt - w) if self.ec.bounded_replay else True
                nxt = req.prompt_ids[start + 1:start + n + 1]
                prompt_next[b, :len(nxt)] = nxt
            last[b] = n - 1
            self._fill_sampling(b, req, seeds, sample_pos, sampling, int(pos[b, n - 1]) + 1)
            if not decode and req.prefilled + n < n_prompt:
                continue  # a middle chunk: its sample is not used
            samples.append((b, req))
        inp = {"tokens": tokens, "positions": pos, "engram_rows": rows, "replay_mask": replay, "last_index": last,
               "prompt_next": prompt_next, "seeds": seeds, "sample_positions": sample_pos,
               "sampling": sampling, "admit": np.array([b in admitted for b in range(s)])}
        return inp, samples

    def _fill_sampling(self, b, req, seeds, sample_pos, sampling, position):
        seeds[b] = seed_words(request_seed(req.params, req.request_id))
        sample_pos[b] = position
        for k, v in params_row(req.params).items():
            sampling[k][b] = v

    # ------------------------------------------------------------------------------------------------
    def _finish_check(self, req: Request, dec: IncrementalDecoder) -> None:
        p = req.params
        tid = req.generated[-1]
        req.text += dec.push(tid)
        if not p.ignore_eos and tid == self.tok.eos_id:
            req.finish_reason = "stop"
        elif tid in p.stop_token_ids:
            req.finish_reason = "stop"
        elif p.stop and any(s in req.text for s in p.stop):
            cut = min(req.text.index(s) for s in p.stop if s in req.text)
            req.text = req.text[:cut]
            req.finish_reason = "stop"
        elif len(req.generated) >= p.max_tokens:
            req.finish_reason = "length"
        elif len(req.prompt_ids) + len(req.generated) >= self.ec.max_len:
            req.finish_reason = "length"  # the context is full

    def run(self, requests: list[Request], on_finish: Callable[[Request], None] | None = None,
            on_step: Callable[[int], None] | None = None) -> list[Request]:
        """Run every request to completion; ``on_finish`` is called as each one finishes."""
        for r in requests:
            if len(r.prompt_ids) == 0:
                raise ValueError(f"request {r.request_id!r}: empty prompt")
            if len(r.prompt_ids) >= self.ec.max_len:
                raise ValueError(f"request {r.request_id!r}: prompt has {len(r.prompt_ids)} tokens, the context "
                                 f"holds {self.ec.max_len} (max_len); at least one token must be generated")
            bad = [t for t in r.prompt_ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"request {r.request_id!r}: token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")
        waiting = deque(requests)
        slots: list[Request | None] = [None] * self.ec.max_slots
        decoders: dict[int, IncrementalDecoder] = {}
        while waiting or any(slots):
            admitted = set()
            for b in range(len(slots)):
                if slots[b] is None and waiting:
                    slots[b] = waiting.popleft()
                    decoders[b] = IncrementalDecoder(self.tok)
                    admitted.add(b)
            prefilling = any(r is not None and r.prefilled < len(r.prompt_ids) for r in slots)
            decode = not prefilling
            want_plp = (not decode) and any(r is not None and r.params.prompt_logprobs
                                            and r.prefilled < len(r.prompt_ids) for r in slots)
            inp, samples = self._inputs(slots, decode, admitted)
            self.state, out = self.steps[(decode, want_plp)](self.params, state=self.state, inp=inp,
                                                             valid_v=self.valid_v, engine_key=self.engine_key)
            out = jax.device_get(out)  # the one sync per step: the sampled tokens
            n_tok = 0
            for b, req in enumerate(slots):
                if req is None or decode or req.prefilled >= len(req.prompt_ids):
                    continue
                n = min(self.ec.chunk_size, len(req.prompt_ids) - req.prefilled)
                if req.params.prompt_logprobs:
                    if req.prefilled == 0:
                        req.prompt_logprobs.append(None)
                    m = min(n, len(req.prompt_ids) - 1 - req.prefilled)
                    req.prompt_logprobs += [float(x) for x in out["prompt_logprobs"][b, :m]]
                req.prefilled += n
            for b, req in samples:
                tid = int(out["token"][b])
                req.generated.append(tid)
                req.logprobs.append(float(out["logprob"][b]))
                if req.params.logprobs:
                    k = req.params.logprobs
                    req.top_logprobs.append({int(i): float(v) for i, v in
                                             zip(out["top_ids"][b, :k], out["top_logprobs"][b, :k])})
                n_tok += 1
                self._finish_check(req, decoders[b])
                if req.finish_reason is not None:
                    slots[b] = None
                    if on_finish:
                        on_finish(req)
            if on_step:
                on_step(n_tok)
        return requests

