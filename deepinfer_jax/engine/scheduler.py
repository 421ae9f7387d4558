"""Continuous batching over a fixed number of slots with two fixed step shapes.

* prefill step [slots, chunk]: every slot still in its prompt feeds its next ``chunk`` prompt tokens;
  chunks are cut from position 0, so where a request's chunks start depends on the request alone;
  slots that are generating sit the step out (position -1), so a decode token is always computed by the
  decode program and a prompt chunk always by the prefill program, whatever the neighbours do;
* decode step [slots, 1]: every generating slot feeds its last sampled token.

The sampler runs on the device after each model step (its first stage inside the step's program, the
rest as small programs of its own: ``sampling``), and the sampled token stays on the device: the pick
program writes it into the slot's ``next_token``, and the next decode step reads it from there and
advances the Engram history with it (Engram rows are hashed in-graph, ``engram_device``). So the host
launches step N+1 before it reads step N's results (JAX async dispatch): the loop is launch(N+1), then
read(N), and the only host sync is that read of finished tokens. A request that stops on EOS or a stop
string at step N therefore has one wasted row in step N+1, which is discarded; limits known in advance
(max_tokens, the context) free the slot at launch time.

Every step has one of two shapes (plus one program for prompt logprobs and the sampler's few), so
nothing recompiles after warm-up; every op is row-local, so a request's tokens and logprobs are bitwise the same whatever the
other slots hold (tests/test_invariance.py). An admitted slot gets its window ring emptied in the
prefill step (model/cache.py ``reset_slots``): with bounded replay the upper layers' ring would otherwise
show the previous occupant's rows to the new request.

SWA bounded replay (spec §7, decoder side; default on, an approximation): in prefill, layers above the
last KV-source layer run only on each request's last ``sliding_window`` prompt tokens. Requests that ask
for prompt logprobs get a full prefill (every position needs its real hidden state).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax import platform
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine import sampling
from deepinfer_jax.engine.engram_device import advance_history, engram_rows_device, engram_tables
from deepinfer_jax.engine.sampling import (SamplingParams, empty_rows, request_seed, row_keys, seed_words,
                                           set_row)
from deepinfer_jax.engine.tokenizer import IncrementalDecoder, Tokenizer
from deepinfer_jax.model.cache import init_cache, reset_slots
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.transformer import forward_hidden, lm_head


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """The model as the engine sees it (tests substitute a toy model with the same signatures).

    hidden(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics, replay_mask_bt)
        -> (h_btd, new_cache);  head(params, h_btd) -> fp32 logits_btv;
    init_cache(cfg, batch, max_len, numerics) -> cache pytree (every leaf has the slot dim first);
    reset_slots(cache, reset_b) -> the cache with those slots emptied for a new occupant;
    readable(tree) -> the step results the host reads (sampled tokens, logprobs, prompt logprobs), laid
        out so that every process can read all of them: on a mesh that spans several processes each one
        runs the same loop and needs every slot's token for its stop rules (parallel/engine.py).
    split_at_replay: ``hidden`` also takes ``part="lower"`` / ``part="upper", carry=...`` (transformer.
    forward_hidden): prefill then runs as two programs and skips the upper one when no row of the step
    lies in its replay window, which is what makes bounded replay save compute (spec §7)."""

    hidden: Callable
    head: Callable
    init_cache: Callable
    reset_slots: Callable
    readable: Callable = lambda tree: tree  # one process: whatever layout the step produced
    split_at_replay: bool = False


REAL_MODEL = ModelFns(forward_hidden, lm_head, init_cache, reset_slots, split_at_replay=True)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8
    max_len: int = 256  # tokens per slot: prompt + output
    chunk_size: int = 16
    bounded_replay: bool = True  # DeepInfer's default (spec §7): an approximation, see the module doc
    engine_seed: int = 0
    # XLA:GPU's excess precision: True lets it keep values the program rounds (bf16, fp8, fp4) in float32
    # where it fuses; False (default) rounds as the program says (``platform.step_compiler_options``)
    excess_precision: bool = False
    # More XLA compile options for every program, as (name, value) pairs over the platform's, e.g.
    # (("xla_gpu_enable_command_buffer", ""),) to launch kernels one by one instead of as a CUDA graph
    # (benchmarks/NOTES.md item -23: a graph whose buffers move is re-recorded at every call). Any
    # DebugOptions field; an unknown name fails at the first compile.
    xla_options: tuple[tuple[str, bool | int | float | str], ...] = ()

    def __post_init__(self):
        for name in ("max_slots", "max_len", "chunk_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.excess_precision, bool):
            raise ValueError(f"excess_precision must be true or false, got {self.excess_precision!r}")
        if self.chunk_size > self.max_len:
            raise ValueError(f"chunk_size {self.chunk_size} exceeds max_len {self.max_len}")
        if not isinstance(self.xla_options, tuple) or not all(
                isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) and isinstance(o[1], (bool, int, float, str))
                for o in self.xla_options):
            raise ValueError(f"xla_options must be a tuple of (name, bool | int | float | str) pairs, "
                             f"got {self.xla_options!r}")
        if isinstance(self.engine_seed, bool) or not isinstance(self.engine_seed, int) \
                or not 0 <= self.engine_seed < 2**32:
            raise ValueError(f"engine_seed must be an integer in [0, 2^32), got {self.engine_seed!r}")


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    # results, filled as the request runs
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # host bookkeeping: prompt tokens launched, samples launched (ahead of what has been read back)
    fed: int = 0
    launched: int = 0
    decoder: IncrementalDecoder | None = None
    seed_words: np.ndarray | None = None  # the sampling seed as two uint32 words


@dataclasses.dataclass(eq=False)
class _Row:
    slot: int
    request: Request
    sampled: bool  # this row's sample is one of the request's tokens
    prompt_span: tuple[int, int] | None = None  # (start, n) of prompt positions whose logprobs come back


@dataclasses.dataclass(eq=False)
class _Launched:
    out: dict  # device arrays, not yet read
    rows: list[_Row]
    prompt_lp: jax.Array | None = None


# ---------------------------------------------------------------------------------------------------
# The jitted steps (pure functions of params, state, inputs and constants).

def _prepare_sample(state, logits_bv, inp, consts):
    """The sampler's first stage, in the model's program (the only one holding the fp32 logits)."""
    return sampling.prepare(logits_bv, consts["valid_v"], state["counts"], state["seen"], inp["sampling"])


def _pick_into_state(sampler_state, pre, keep, q, inp, consts, *, keys_fn, readable):
    """The sampler's last program: each row's token (``sampling.pick``), written into the slot's counts,
    seen-mask and ``next_token`` where the row takes its sample -> (sampler_state, results to read)."""
    keys = keys_fn(consts["engine_key"], inp["seeds"], inp["sample_positions"])
    res = sampling.token_results(pre, sampling.pick(pre["xs"], keep, q, inp["sampling"], keys))
    take = inp["take_sample"]
    counts = sampler_state["counts"]
    slots = jnp.arange(take.shape[0])
    tok = jnp.where(take, res["token"], counts.shape[1])  # out of range: dropped
    return {"counts": counts.at[slots, tok].add(1, mode="drop"),
            "seen": sampler_state["seen"].at[slots, tok].set(True, mode="drop"),
            "next_token": jnp.where(take, res["token"], sampler_state["next_token"])}, readable(res)


SAMPLER_STATE = ("counts", "seen", "next_token")  # the part of the state the pick program updates
PICK_INPUTS = ("seeds", "sample_positions", "sampling", "take_sample")


def _engram_rows(cfg, consts, hist, comp_bt, pad_id, max_prime):
    b, t = comp_bt.shape
    if not cfg.engram_layer_ids:
        return jnp.zeros((b, t, 0, 0), jnp.int32)
    return engram_rows_device(consts["engram"], hist, comp_bt, pad_id, max_prime)


def _prefill_inputs(state, inp, consts, *, cfg, model, pad_id, max_prime):
    """The prefill step's bookkeeping before the model: admitted slots emptied, Engram rows, history."""
    admit = inp["admit"]
    # Admitted slots are emptied first (model.reset_slots says why it is needed, not just hygiene).
    state = dict(state, cache=model.reset_slots(state["cache"], admit),
                 counts=jnp.where(admit[:, None], 0, state["counts"]),
                 seen=jnp.where(admit[:, None], False, state["seen"]),
                 hist=jnp.where(admit[:, None], -1, state["hist"]))
    tok, pos = inp["tokens"], inp["positions"]
    live = pos >= 0
    slots = jnp.arange(tok.shape[0])
    vocab = state["seen"].shape[1]
    comp = jnp.where(live, consts["token_map"][tok], -1)
    rows = _engram_rows(cfg, consts, state["hist"], comp, pad_id, max_prime)
    state = dict(state, hist=advance_history(state["hist"], comp),
                 seen=state["seen"].at[slots[:, None], jnp.where(live, tok, vocab)].set(True, mode="drop"))
    return state, rows


def _prefill_sample(params, state, h, inp, consts, *, model):
    slots = jnp.arange(h.shape[0])
    h_last = h[slots, inp["last_index"]][:, None]
    # hidden stays on the device (prompt logprobs)
    return state, {"pre": _prepare_sample(state, model.head(params, h_last)[:, 0], inp, consts), "hidden": h}


def _prefill_step(params, state, inp, consts, *, cfg, numerics, model, pad_id, max_prime):
    """Prefill as one program (models without ``split_at_replay``)."""
    state, rows = _prefill_inputs(state, inp, consts, cfg=cfg, model=model, pad_id=pad_id, max_prime=max_prime)
    h, state["cache"] = model.hidden(params, cfg, state["cache"], inp["tokens"], inp["positions"], rows, numerics,
                                     inp["replay_mask"])
    return _prefill_sample(params, state, h, inp, consts, model=model)


def _prefill_lower(params, state, inp, consts, *, cfg, numerics, model, pad_id, max_prime):
    """Prefill, first program: the layers up to the last KV source -> (state, (model carry, Engram rows))."""
    state, rows = _prefill_inputs(state, inp, consts, cfg=cfg, model=model, pad_id=pad_id, max_prime=max_prime)
    carry, state["cache"] = model.hidden(params, cfg, state["cache"], inp["tokens"], inp["positions"], rows,
                                         numerics, inp["replay_mask"], part="lower")
    return state, (carry, rows)


def _prefill_upper(params, state, carry, inp, consts, *, cfg, numerics, model, pad_id, max_prime):
    """Prefill, second program (run only when a row of the step is in its replay window): the layers above
    the last KV source, the head and the sampler."""
    carry, rows = carry
    h, state["cache"] = model.hidden(params, cfg, state["cache"], inp["tokens"], inp["positions"], rows, numerics,
                                     inp["replay_mask"], part="upper", carry=carry)
    return _prefill_sample(params, state, h, inp, consts, model=model)


def _decode_step(params, state, inp, consts, *, cfg, numerics, model, pad_id, max_prime):
    pos = inp["positions"]  # [S, 1]
    live = pos >= 0
    tok = jnp.where(live, state["next_token"][:, None], 0)
    comp = jnp.where(live, consts["token_map"][tok], -1)
    rows = _engram_rows(cfg, consts, state["hist"], comp, pad_id, max_prime)
    state = dict(state, hist=advance_history(state["hist"], comp))
    h, cache = model.hidden(params, cfg, state["cache"], tok, pos, rows, numerics, None)
    state["cache"] = cache
    return state, {"pre": _prepare_sample(state, model.head(params, h)[:, 0], inp, consts)}


def _prompt_logprobs(params, h_btd, next_bt, valid_v, *, model):
    """f32[B, T]: log p(next token) at each prefill position; one row at a time (a [T, V] head each)."""

    def row(args):
        h_td, nxt_t = args
        logp = jax.nn.log_softmax(jnp.where(valid_v, model.head(params, h_td[None])[0], -jnp.inf), axis=-1)
        return jnp.take_along_axis(logp, jnp.maximum(nxt_t, 0)[:, None], axis=1)[:, 0]

    return model.readable(jax.lax.map(row, (h_btd, next_bt)))


@functools.lru_cache(maxsize=None)
def _compiled_steps(cfg, numerics, model, keys_fn, pad_id, max_prime, compiler_options=()):
    """The jitted (prefill, prefill upper part or None, decode, prompt-logprobs, pick, top-20) programs,
    shared by every scheduler with the same statics, so a second engine on the same model (another test,
    another LLM) compiles nothing. With a split model, "prefill" is the lower part (``_prefill_lower``).
    compiler_options: XLA options as (name, value) pairs (``platform.step_compiler_options``)."""
    statics = dict(cfg=cfg, numerics=numerics.for_program("prefill"), model=model, pad_id=pad_id,
                   max_prime=max_prime)
    jit = functools.partial(jax.jit, compiler_options=dict(compiler_options) or None)
    upper = None
    if model.split_at_replay:
        prefill = jit(functools.partial(_prefill_lower, **statics), donate_argnums=(1,))
        upper = jit(functools.partial(_prefill_upper, **statics), donate_argnums=(1,))
    else:
        prefill = jit(functools.partial(_prefill_step, **statics), donate_argnums=(1,))
    decode = jit(functools.partial(_decode_step, **{**statics, "numerics": numerics.for_program("decode")}),
                 donate_argnums=(1,))
    pick = jit(functools.partial(_pick_into_state, keys_fn=keys_fn, readable=model.readable), donate_argnums=(0,))
    top = jit(lambda logp: model.readable(sampling.top_logprobs(logp)))
    return prefill, upper, decode, jit(functools.partial(_prompt_logprobs, model=model)), pick, top


# ---------------------------------------------------------------------------------------------------

class Scheduler:
    """Owns the slots' device state and runs lists of requests to completion."""

    def __init__(self, params, cfg: ModelConfig, tokenizer: Tokenizer, token_map: np.ndarray, numerics: Numerics,
                 config: EngineConfig, *, model: ModelFns = REAL_MODEL, keys_fn: Callable | None = None):
        """model / keys_fn (``sampling.row_keys``'s signature): substitutes for tests and experiments; the
        defaults are the real model and the per-row threefry keys."""
        self.params, self.cfg, self.tok, self.numerics, self.ec = params, cfg, tokenizer, numerics, config
        token_map = np.asarray(token_map)
        if token_map.shape != (cfg.vocab_size,):
            raise ValueError(f"token map has shape {token_map.shape}, expected ({cfg.vocab_size},)")
        n_keys = int(token_map.max()) + 1
        self.consts = {"valid_v": jnp.asarray(tokenizer.valid_token_mask(cfg.vocab_size)),
                       "token_map": jnp.asarray(token_map, jnp.int32),
                       "engine_key": jax.random.key(config.engine_seed, impl="threefry2x32")}
        pad_id = max_prime = 0  # Python ints, static in the trace
        if cfg.engram_layer_ids:
            tables = engram_tables(cfg, n_keys)
            self.consts["engram"] = {k: jnp.asarray(v) for k, v in tables.items()}
            pad_id, max_prime = int(token_map[cfg.engram_pad_token_id]), int(tables["primes"].max())
        self._model = model
        # None: the sampler's plan is chosen per step. Set, it is forced (benchmarks' A/B runs): a plan that
        # skips a stage some row uses changes that row's results.
        self.sampler_plan: sampling.SamplerPlan | None = None
        self.skipped_upper = 0  # prefill steps that skipped the layers above the last KV source
        self._sampler_warm = False  # every sampler program compiled (``_warm_sampler``)
        self.state = self._init_state()
        # XLA options of every program below (``platform.step_compiler_options``)
        self.compiler_options = {**platform.step_compiler_options(excess_precision=config.excess_precision),
                                 **dict(config.xla_options)}
        self._prefill, self._prefill_upper, self._decode, self._plp, self._pick, self._top = _compiled_steps(
            cfg, numerics, model, keys_fn or row_keys, pad_id, max_prime,
            tuple(sorted(self.compiler_options.items())))

    def _init_state(self) -> dict:
        s, v = self.ec.max_slots, self.cfg.vocab_size
        return {"cache": self._model.init_cache(self.cfg, s, self.ec.max_len, self.numerics),
                "counts": jnp.zeros((s, v), jnp.int32), "seen": jnp.zeros((s, v), bool),
                "next_token": jnp.zeros((s,), jnp.int32),
                "hist": jnp.full((s, max(self.cfg.engram_max_ngram_size - 1, 0)), -1, jnp.int32)}

    def compile_count(self) -> int:
        """Programs compiled so far for this scheduler's step functions (shared with any other scheduler
        on the same model and statics): the model's steps, the sampler's pick program (two forms: with
        and without sampled rows) and its top-20 program, all compiled by the first sampled step
        (``_warm_sampler``). The sampler's filter programs (``sampling.filter_steps``) are shared by
        every scheduler and not counted here."""
        programs = (self._prefill, self._prefill_upper, self._decode, self._plp, self._pick, self._top)
        return sum(f._cache_size() for f in programs if f is not None)

    # ------------------------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raise ValueError naming the request if it cannot run on this engine."""
        n, cap, vocab = len(req.prompt_ids), self.ec.max_len, self.cfg.vocab_size
        if n == 0:
            raise ValueError(f"request {req.request_id!r}: empty prompt")
        if n >= cap:
            raise ValueError(f"request {req.request_id!r}: prompt has {n} tokens, the context holds {cap} "
                             f"(max_len, prompt + output): prompts of at most {cap - 1} tokens fit")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {req.request_id!r}: prompt token ids {bad[:5]} outside [0, {vocab})")
        bad = [t for t in req.params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"request {req.request_id!r}: stop_token_ids {bad[:5]} outside [0, {vocab})")

    def _budget(self, req: Request) -> int:
        """Tokens the request may generate: max_tokens, capped by the context."""
        return min(req.params.max_tokens, self.ec.max_len - len(req.prompt_ids))

    # ------------------------------------------------------------------------------------------------
    def _common_inputs(self, t: int) -> dict:
        s = self.ec.max_slots
        return {"positions": np.full((s, t), -1, np.int32), "take_sample": np.zeros(s, bool),
                "seeds": np.zeros((s, 2), np.uint32), "sample_positions": np.zeros(s, np.int32),
                "sampling": empty_rows(s)}

    def _set_sampling(self, inp: dict, b: int, req: Request, position: int) -> None:
        inp["seeds"][b] = req.seed_words
        inp["sample_positions"][b] = position
        set_row(inp["sampling"], b, req.params)

    def _replay_from(self, req: Request, slot: int) -> int:
        """The first prompt position the layers above the last KV source run on: the last
        ``sliding_window`` prompt tokens with bounded replay, else 0. A function of the request alone,
        never of its slot or neighbours (that is what keeps bounded replay batch-invariant)."""
        if not self.ec.bounded_replay or req.params.prompt_logprobs:
            return 0
        return max(0, len(req.prompt_ids) - self.cfg.sliding_window)

    @staticmethod
    def _needs_upper(inp: dict) -> bool:
        """Whether a prefill step must run the layers above the last KV source: some row lies in its replay
        window (a sampled row always does). Otherwise those layers would only see padding."""
        return bool(inp["replay_mask"].any())

    def _launch_prefill(self, slots: list[Request | None]) -> _Launched:
        s, t = self.ec.max_slots, self.ec.chunk_size
        inp = self._common_inputs(t)
        inp.update(tokens=np.zeros((s, t), np.int32), replay_mask=np.zeros((s, t), bool),
                   last_index=np.zeros(s, np.int32), admit=np.zeros(s, bool))
        next_tok = np.full((s, t), -1, np.int32)
        rows, want_plp = [], False
        for b, req in enumerate(slots):
            if req is None or req.fed >= len(req.prompt_ids):
                continue
            n_prompt, start = len(req.prompt_ids), req.fed
            n = min(t, n_prompt - start)
            inp["tokens"][b, :n] = req.prompt_ids[start:start + n]
            inp["positions"][b, :n] = np.arange(start, start + n)
            inp["replay_mask"][b, :n] = np.arange(start, start + n) >= self._replay_from(req, b)
            inp["last_index"][b] = n - 1
            inp["admit"][b] = start == 0
            last = start + n == n_prompt
            inp["take_sample"][b] = last
            self._set_sampling(inp, b, req, n_prompt)
            span = None
            if req.params.prompt_logprobs:
                want_plp = True
                nxt = req.prompt_ids[start + 1:start + n + 1]
                next_tok[b, :len(nxt)] = nxt
                span = (start, len(nxt))
            rows.append(_Row(b, req, last, span))
            req.fed += n
            req.launched += last
        with jax.threefry_partitionable(True):
            if self._prefill_upper is None:
                self.state, res = self._prefill(self.params, self.state, inp, self.consts)
            else:
                self.state, carry = self._prefill(self.params, self.state, inp, self.consts)
                if self._needs_upper(inp):
                    self.state, res = self._prefill_upper(self.params, self.state, carry, inp, self.consts)
                else:  # every row lies before its replay window: nothing above the last KV source to run
                    assert not (inp["take_sample"].any() or want_plp), "a sampled row is always replayed"
                    res = {}
                    self.skipped_upper += 1
            plp = self._plp(self.params, res["hidden"], next_tok, self.consts["valid_v"]) if want_plp else None
            # a step in which no row finishes its prompt samples nothing: the sampler's programs are skipped
            out = self._sample(res["pre"], inp, self._reports_top(rows)) if inp["take_sample"].any() else {}
        return _Launched(out, rows, plp)

    def _launch_decode(self, slots: list[Request | None]) -> _Launched:
        inp = self._common_inputs(1)
        rows = []
        for b, req in enumerate(slots):
            if req is None:
                continue
            p = len(req.prompt_ids) + req.launched - 1  # position of the token fed (the last one sampled)
            inp["positions"][b, 0] = p
            inp["take_sample"][b] = True
            self._set_sampling(inp, b, req, p + 1)
            rows.append(_Row(b, req, True))
            req.launched += 1
        return _Launched(self.decode_step(inp, self._reports_top(rows)), rows)

    def _reports_top(self, rows: list[_Row]) -> np.ndarray:
        """bool[slots]: the rows whose sample this step is reported with top-n logprobs."""
        top = np.zeros(self.ec.max_slots, bool)
        for row in rows:
            top[row.slot] = row.sampled and bool(row.request.params.logprobs)
        return top

    def decode_step(self, inp: dict, top_logprobs_b: np.ndarray | None = None) -> dict:
        """Launch one decode step on inputs from ``_common_inputs(1)`` (the model's program, then the
        sampler's) -> the device results to read; the slots' state moves on. top_logprobs_b: the rows
        that report top-n logprobs (None: none). Benchmarks call it too."""
        if top_logprobs_b is None:
            top_logprobs_b = np.zeros(self.ec.max_slots, bool)
        with jax.threefry_partitionable(True):
            self.state, res = self._decode(self.params, self.state, inp, self.consts)
            return self._sample(res["pre"], inp, top_logprobs_b)

    def _warm_sampler(self, pre: dict, inp: dict) -> None:
        """Compile every sampler program on the first sampled step, on its real inputs (results dropped),
        so that a later step whose rows first ask for top-k, top-p, top-n logprobs or only greedy tokens
        compiles nothing. One extra run of each program, once."""
        rows = inp["sampling"]
        sampling.filter_steps(pre["xs"], rows, sampling.SamplerPlan(top_k=False))   # the alive-set form
        keep, q = sampling.filter_steps(pre["xs"], rows, sampling.SamplerPlan())
        small = {k: inp[k] for k in PICK_INPUTS}
        for k, v in ((keep, q), (None, None)):   # both pick forms, on a copy of the state they donate
            self._pick({k2: jnp.copy(self.state[k2]) for k2 in SAMPLER_STATE}, pre, k, v, small, self.consts)
        self._top(pre["logp"])
        self._sampler_warm = True

    def _sample(self, pre: dict, inp: dict, top_logprobs_b: np.ndarray) -> dict:
        """The sampler's programs after a model step (``sampling.filter_steps`` as the step's SamplerPlan
        asks, then the pick program, which updates the sampler's part of the state, and the top-20 when a
        row reports it) -> results to read."""
        if not self._sampler_warm:
            self._warm_sampler(pre, inp)
        plan = self.sampler_plan or sampling.SamplerPlan.of(inp["sampling"], inp["take_sample"], top_logprobs_b)
        keep, q = sampling.filter_steps(pre["xs"], inp["sampling"], plan)
        sampler_state, out = self._pick({k: self.state[k] for k in SAMPLER_STATE}, pre, keep, q,
                                        {k: inp[k] for k in PICK_INPUTS}, self.consts)
        self.state = {**self.state, **sampler_state}
        if plan.top_logprobs:
            out = {**out, **self._top(pre["logp"])}
        return out

    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def _append_text(req: Request, piece: str) -> bool:
        """Add decoded text; True (and the text cut before it) when a stop string now appears."""
        old = len(req.text)
        req.text += piece
        if not (req.params.stop and piece):
            return False
        from_ = max(0, old - max(len(s) for s in req.params.stop) + 1)  # a stop string may straddle old text
        hits = [i for i in (req.text.find(s, from_) for s in req.params.stop) if i >= 0]
        if hits:
            req.text = req.text[:min(hits)]
        return bool(hits)

    def _finish(self, req: Request, tid: int) -> str | None:
        """Stop rules for the token just generated: EOS (unless ignore_eos) and stop tokens stay in
        token_ids but add no text; a stop string cuts the text before it; then the length budget."""
        p = req.params
        if (tid == self.tok.eos_id and not p.ignore_eos) or tid in p.stop_token_ids:
            self._append_text(req, req.decoder.flush())  # text held back for an incomplete character
            return "stop"
        if self._append_text(req, req.decoder.push(tid)):
            return "stop"
        if len(req.generated) >= self._budget(req):
            return "stop" if self._append_text(req, req.decoder.flush()) else "length"
        return None

    def _collect(self, launched: _Launched, slots: list[Request | None], on_finish) -> int:
        out = jax.device_get(launched.out)  # the one sync: this step's tokens (and their logprobs)
        plp = None if launched.prompt_lp is None else jax.device_get(launched.prompt_lp)
        n_tokens = 0
        for row in launched.rows:
            req, b = row.request, row.slot
            if req.finish_reason is not None:
                continue  # the wasted row after an EOS / stop string: discarded
            if row.prompt_span is not None:
                start, n = row.prompt_span
                if start == 0:
                    req.prompt_logprobs.append(None)  # the first token has no context
                req.prompt_logprobs += [float(x) for x in plp[b, :n]]
            if not row.sampled:
                continue
            tid = int(out["token"][b])
            req.generated.append(tid)
            req.logprobs.append(float(out["logprob"][b]))
            if req.params.logprobs:
                k = req.params.logprobs
                req.top_logprobs.append({int(i): float(v) for i, v in zip(out["top_ids"][b, :k],
                                                                          out["top_logprobs"][b, :k])})
            n_tokens += 1
            req.finish_reason = self._finish(req, tid)
            if req.finish_reason is not None:
                if slots[b] is req:
                    slots[b] = None
                if on_finish:
                    on_finish(req)
        return n_tokens

    def run(self, requests: Sequence[Request], on_finish: Callable[[Request], None] | None = None,
            on_tokens: Callable[[int], None] | None = None) -> Sequence[Request]:
        """Run every request to completion (FIFO admission); ``on_finish`` is called as each finishes,
        ``on_tokens`` with the number of tokens each collected step produced."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request ids must be unique; {dup!r} appears {ids.count(dup)} times")
        for r in requests:
            self.validate(r)
            r.generated, r.logprobs, r.top_logprobs, r.prompt_logprobs = [], [], [], []
            r.text, r.finish_reason, r.fed, r.launched = "", None, 0, 0
            r.decoder = IncrementalDecoder(self.tok)
            r.seed_words = seed_words(request_seed(r.params, r.request_id))
        waiting = deque(requests)
        slots: list[Request | None] = [None] * self.ec.max_slots
        pending: _Launched | None = None
        while True:
            for b in range(len(slots)):
                if slots[b] is None and waiting:
                    slots[b] = waiting.popleft()
            if any(r is not None and r.fed < len(r.prompt_ids) for r in slots):
                launched = self._launch_prefill(slots)
            elif any(slots):
                launched = self._launch_decode(slots)
            else:
                launched = None
            for b, r in enumerate(slots):  # limits known in advance free the slot now
                if r is not None and r.fed == len(r.prompt_ids) and r.launched >= self._budget(r):
                    slots[b] = None
            if pending is not None:
                n = self._collect(pending, slots, on_finish)
                if on_tokens:
                    on_tokens(n)
            pending = launched
            if pending is None:
                break
        for r in requests:
            r.decoder = None
        return requests
