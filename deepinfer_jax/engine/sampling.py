"""SamplingParams and the per-row deterministic sampler the engine runs after each model step.

A row's sample is a function of its own logits, its own parameters and its own key only:

* the key is threefry ``fold_in(fold_in(fold_in(engine_key, seed_hi), seed_lo), position)``, where the
  64-bit seed is the request's ``seed`` or, without one, a hash of the request id, and ``position`` is the
  absolute position of the token being sampled (``row_keys``);
* the Gumbel noise is drawn per row with the row's own [V] shape inside ``vmap`` (threefry is exact under
  vmap), never as one [B, V] block from a shared key, and it is indexed by token id, so filtering never
  changes which noise value a token gets;
* top-k / top-p / min-p are computed within the row: top-k over the order (value descending, token id
  ascending), top-p over (probability descending, token id ascending), the same order except where
  distinct values round to one probability; ties go to the lower id. The k-th value and the nucleus
  boundary are found by a search on
  the float bits (exact; 16 masked passes over the row, each summing three thresholds' counts or masses)
  instead of a full sort of the 129k vocabulary (XLA:CPU sorts 4 such rows in ~120 ms; the searches take
  a fraction of that);
* the pick is Gumbel-max over the kept tokens; greedy (temperature 0) is the argmax (ties: lower id).

Stages: ``prepare`` (inside the model's step), then separate programs: ``top_k_keep`` (or
``alive_keep``), ``renormalise``, ``top_p_keep`` (``filter_steps``), ``pick`` and ``top_logprobs``. The
host chooses per step which of them run (``SamplerPlan``: no search nobody in the step uses, no filter
for an all-greedy step, no top-20 nobody reports); the programs themselves never change with the plan,
so neither can a row's bits.

Reported logprobs are the model's own distribution: ``log_softmax`` of the raw logits over the ids the
tokenizer defines, before penalties, temperature and filtering (vLLM's default "raw" logprobs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.topk.select import order_key as _order_key

MAX_LOGPROBS = 20  # top-n logprobs computed every step (a static shape); requests ask for n <= this
_U64 = 1 << 64


def _reject(field: str, why: str, value: Any) -> ValueError:
    return ValueError(f"SamplingParams.{field} {why}, got {value!r}")


def _as_int(field: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _reject(field, "must be an integer", value)
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _reject(field, f"must be {span}", value)
    return value


def _as_real(field: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _reject(field, "must be a finite number", value)
    value = float(value)
    if value < lo or value > hi or (lo_open and value == lo):
        raise _reject(field, f"must be in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return value


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM names and defaults). Validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 (or -1, vLLM's spelling) = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None: a 64-bit hash of the request id (still deterministic)
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first one
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled token's)
    prompt_logprobs: bool = False  # logprob of every prompt token given the ones before it
    repetition_penalty: float = 1.0  # on tokens seen in the prompt or the output (1 = off)
    presence_penalty: float = 0.0  # OpenAI semantics, on generated tokens
    frequency_penalty: float = 0.0

    def __post_init__(self):
        put = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen dataclass)
        put("max_tokens", _as_int("max_tokens", self.max_tokens, 1))
        put("temperature", _as_real("temperature", self.temperature, 0.0, 100.0))
        put("top_p", _as_real("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        top_k = _as_int("top_k", self.top_k, -1)
        put("top_k", 0 if top_k == -1 else top_k)
        put("min_p", _as_real("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            put("seed", _as_int("seed", self.seed, 0, _U64 - 1))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise _reject("stop", "must be a string or a list of non-empty strings", self.stop)
        put("stop", tuple(stop))
        if not isinstance(self.stop_token_ids, Sequence) or isinstance(self.stop_token_ids, str):
            raise _reject("stop_token_ids", "must be a list of token ids", self.stop_token_ids)
        put("stop_token_ids", tuple(_as_int("stop_token_ids", t, 0) for t in self.stop_token_ids))
        for flag in ("ignore_eos", "prompt_logprobs"):
            if not isinstance(getattr(self, flag), bool):
                raise _reject(flag, "must be true or false", getattr(self, flag))
        if self.logprobs is not None:
            put("logprobs", _as_int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        put("repetition_penalty", _as_real("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True))
        for f in ("presence_penalty", "frequency_penalty"):
            put(f, _as_real(f, getattr(self, f), -2.0, 2.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "request") -> "SamplingParams":
        """From JSON-like fields; unknown names are an error that lists the known ones."""
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{where}: unknown sampling field(s) {unknown}; known: {sorted(cls.field_names())}")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return d


# ---------------------------------------------------------------------------------------------------
# Host side: per-row parameter arrays and seeds.

ROW_FIELDS = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "min_p": np.float32,
              "repetition_penalty": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32}
NEUTRAL_ROW = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0}  # what idle slots carry


def empty_rows(n: int) -> dict[str, np.ndarray]:
    return {k: np.full(n, NEUTRAL_ROW[k], dt) for k, dt in ROW_FIELDS.items()}


def set_row(rows: dict[str, np.ndarray], b: int, p: SamplingParams) -> None:
    for k in ROW_FIELDS:
        rows[k][b] = getattr(p, k)


def request_seed(params: SamplingParams, request_id: str) -> int:
    """The explicit seed, else a stable 64-bit hash of the request id (same id -> same samples)."""
    if params.seed is not None:
        return params.seed
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")


def seed_words(seed: int) -> np.ndarray:
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


# ---------------------------------------------------------------------------------------------------
# Device side. The sampler runs as a chain of small programs (``filter_steps``, then ``pick``), not
# inside the model's step: which threshold searches run is then a host decision per step (SamplerPlan),
# and every program is the same compiled program whichever plan chose it, so a row's bits cannot depend
# on what its neighbours asked for.

def row_keys(engine_key: jax.Array, seeds_b2: jax.Array, positions_b: jax.Array) -> jax.Array:
    """One threefry key per row: the engine key folded with the seed's two words, then the position."""

    def one(seed2, pos):
        k = jax.random.fold_in(engine_key, seed2[0])
        k = jax.random.fold_in(k, seed2[1])
        return jax.random.fold_in(k, pos)

    return jax.vmap(one)(seeds_b2, positions_b)


# Two bits a pass: 16 passes of three masked sums instead of 32 of one (the indexer's top-k measured
# 1.59 ms at two bits against 2.11 at one on the H200, pallas_kernels/topk/select.py).
SEARCH_BITS = 2


@dataclasses.dataclass(frozen=True)
class SamplerPlan:
    """Which of the sampler's programs a step runs, from the rows that take a sample this step.

    sampled: some row samples (temperature > 0); else every token is the argmax and the filter, its
        searches and the Gumbel noise are skipped.
    top_k / top_p: some sampled row uses top-k / top-p; else that threshold search (16 passes over every
        row's vocabulary) is skipped. A row that does not use top-k keeps its alive tokens whatever the
        top-k threshold is, and a row that does not use top-p keeps the set it had (``top_k_keep``,
        ``top_p_keep``), so skipping a stage changes no row's result.

    top_logprobs: some row taking a sample asked for top-n logprobs; else the top-20 (a sort of 20
        vocabulary blocks a row: 0.05 ms of the H100 4-layer step) is not computed. The others' results
        are the same either way: each row's top-20 comes from one program whenever it runs.

    Measured on the H200 12-layer slice's decode step (B=64): each search is 16 passes of two launches,
    ~0.4 ms of the ~1.1 ms the sampler took inside the step (benchmarks/NOTES.md item -18)."""

    sampled: bool = True
    top_k: bool = True
    top_p: bool = True
    top_logprobs: bool = True
    search_bits: int = SEARCH_BITS   # threshold bits each search pass settles (a benchmark A/B)

    @classmethod
    def of(cls, rows: dict[str, np.ndarray], take_b: np.ndarray | None = None,
           top_logprobs_b: np.ndarray | None = None) -> "SamplerPlan":
        """rows: the step's host-side ``ROW_FIELDS`` arrays; take_b: rows whose sample is used (None: all);
        top_logprobs_b: rows that report top-n logprobs (None: all)."""
        take = np.ones(np.shape(rows["temperature"]), bool) if take_b is None else np.asarray(take_b, bool)
        sampled = (np.asarray(rows["temperature"]) > 0.0) & take
        top = take if top_logprobs_b is None else take & np.asarray(top_logprobs_b, bool)
        return cls(sampled=bool(sampled.any()), top_k=bool((sampled & (np.asarray(rows["top_k"]) > 0)).any()),
                   top_p=bool((sampled & (np.asarray(rows["top_p"]) < 1.0)).any()), top_logprobs=bool(top.any()))


def _least_key_below(key_bv, mass_bv, budget_b, bits: int = SEARCH_BITS) -> jax.Array:
    """uint32[B]: per row, the smallest t with sum(mass[key > t]) < budget (``select.least_key_below``;
    mass None counts keys). The passes are unrolled, with no control flow: on a GPU a loop's predicate is
    a device-to-host round trip that also stops the host from queueing the next step (measured on the
    H200 slice: 64 of a decode step's 66 device-to-host copies were the earlier bisection loops')."""
    from pallas_kernels.topk.select import least_key_below

    return least_key_below(key_bv, budget_b, bits, mass_bv)


def _first_n_of_ties(key_bv, alive_bv, t_b, mass_bv, budget_b):
    """Tokens above threshold key t, plus the tied ones at t in id order while budget allows.

    mass is what each token costs (1 for top-k, its probability for top-p); a tied token is kept when the
    mass of everything before it (above-threshold tokens, then lower-id ties) is < budget."""
    t = t_b[:, None]
    above = alive_bv & (key_bv > t)
    tie = alive_bv & (key_bv == t)
    before = jnp.sum(jnp.where(above, mass_bv, 0.0), axis=-1, keepdims=True)
    tie_rank = (jnp.cumsum(tie, axis=-1) - tie).astype(jnp.float32)  # lower-id ties first
    tie_mass = jnp.max(jnp.where(tie, mass_bv, 0.0), axis=-1, keepdims=True)  # equal values, equal mass
    return above | (tie & (before + tie_rank * tie_mass < budget_b[:, None]))


def _penalised(logits_v, valid_v, counts_v, seen_v, rep, pres, freq):
    x = jnp.where(valid_v, logits_v, -jnp.inf)
    x = jnp.where(seen_v & (rep != 1.0), jnp.where(x > 0, x / rep, x * rep), x)
    return x - pres * (counts_v > 0) - freq * counts_v.astype(jnp.float32)


def prepare(logits_bv: jax.Array, valid_v: jax.Array, counts_bv: jax.Array, seen_bv: jax.Array,
            rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The sampler's first stage, traced inside the model's step (it needs the fp32 logits only there).

    -> {"xs" f32[B, V]: the penalised logits over the temperature (greedy rows: over 1), what every later
    stage reads; "logp" f32[B, V]: the model's own log-softmax over the defined ids (reported logprobs,
    and the top-20 of ``top_logprobs``)}.
    logits_bv: fp32 model logits; valid_v: ids the tokenizer defines; counts_bv: how often each id was
    generated so far; seen_bv: ids in the prompt or output; rows: per-row parameter arrays (ROW_FIELDS)."""
    temp = rows["temperature"]
    x_bv = jax.vmap(_penalised)(logits_bv, jnp.broadcast_to(valid_v, logits_bv.shape), counts_bv, seen_bv,
                                rows["repetition_penalty"][:, None], rows["presence_penalty"][:, None],
                                rows["frequency_penalty"][:, None])
    xs_bv = x_bv / jnp.where(temp <= 0.0, 1.0, temp)[:, None]
    logp_bv = jax.nn.log_softmax(jnp.where(valid_v, logits_bv, -jnp.inf), axis=-1)
    return {"xs": xs_bv, "logp": logp_bv}


def top_logprobs(logp_bv: jax.Array) -> dict[str, jax.Array]:
    """{"top_logprobs" f32[B, 20], "top_ids" int32[B, 20]}: each row's 20 best logprobs, ties to the
    lower id (its own program, run when some row reports them: ``SamplerPlan.top_logprobs``)."""
    top_lp, top_ids = top_k_by_blocks(logp_bv, min(MAX_LOGPROBS, logp_bv.shape[1]))
    return {"top_logprobs": top_lp, "top_ids": top_ids.astype(jnp.int32)}


def alive_keep(xs_bv: jax.Array) -> jax.Array:
    """bool[B, V]: every alive token: what ``top_k_keep`` keeps for a row without top-k."""
    return xs_bv > -jnp.inf


def top_k_keep(xs_bv: jax.Array, top_k_b: jax.Array, bits: int = SEARCH_BITS) -> jax.Array:
    """bool[B, V]: the tokens top-k keeps: the k largest alive values, ties at the k-th to the lower ids
    (rows with top_k 0: every alive token). The k-th value is found by a search on the float bits."""
    alive = alive_keep(xs_bv)
    key = _order_key(xs_bv)
    k_eff = jnp.where(top_k_b > 0, top_k_b, xs_bv.shape[1])
    # dead tokens get key 0, which is above no threshold: integer counts of the alive keys above t
    t_k = _least_key_below(jnp.where(alive, key, jnp.uint32(0)), None, k_eff, bits)
    by_k = _first_n_of_ties(key, alive, t_k, jnp.ones_like(xs_bv), k_eff.astype(jnp.float32))
    return jnp.where((top_k_b > 0)[:, None], by_k, alive)


def renormalise(xs_bv: jax.Array, keep_bv: jax.Array) -> jax.Array:
    """f32[B, V]: each row's probabilities renormalised over its kept tokens (0 elsewhere)."""
    z = jnp.where(keep_bv, xs_bv, -jnp.inf)
    q = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    return q / jnp.sum(q, axis=-1, keepdims=True)


def top_p_keep(keep_bv: jax.Array, q_bv: jax.Array, top_p_b: jax.Array, bits: int = SEARCH_BITS) -> jax.Array:
    """bool[B, V]: the nucleus within each row's kept set: tokens in the order (probability descending, id
    ascending) while the mass before them is < top_p (rows with top_p 1: keep_bv). q_bv: ``renormalise``'s
    probabilities (0 off the kept set). The boundary is found by a search on q's float bits.

    Why q's order and not the value's (top-k's): q >= 0, so its bits are already an order key, and each
    search pass reads q alone (4 bytes a token) instead of a value key and a mass (8): the passes are
    memory-bound (~24 us each over [64, 129280] on the H100; NOTES item -19). The two orders differ only
    where distinct values round to one probability, which the probability order ranks by id."""
    key = jax.lax.bitcast_convert_type(q_bv, jnp.uint32)
    t_p = _least_key_below(key, q_bv, top_p_b, bits)
    nucleus = _first_n_of_ties(key, keep_bv, t_p, q_bv, top_p_b)
    return jnp.where((top_p_b < 1.0)[:, None], nucleus, keep_bv)


def _first_argmax(z_bv: jax.Array) -> jax.Array:
    """argmax over the last axis, ties to the lower id: max, then the lowest index holding it. Two plain
    reductions, about twice as fast on XLA:CPU as its variadic argmax reduction."""
    top = jnp.max(z_bv, axis=-1, keepdims=True)
    ids = jnp.arange(z_bv.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(z_bv == top, ids, z_bv.shape[-1]), axis=-1)


def sampled_keep(xs_bv: jax.Array, keep_bv: jax.Array, q_bv: jax.Array, rows: dict[str, jax.Array]) -> jax.Array:
    """bool[B, V]: the tokens a sampled row draws from: the top-k and top-p set (keep_bv, from
    ``filter_steps``), then min-p's (q_bv: the probabilities over top-k's set); rows that set none of
    the three: every alive token."""
    min_p = rows["min_p"]
    keep = keep_bv & (q_bv >= min_p[:, None] * jnp.max(q_bv, axis=-1, keepdims=True))
    filtering = (rows["top_k"] > 0) | (rows["top_p"] < 1.0) | (min_p > 0.0)
    return jnp.where(filtering[:, None], keep, True) & alive_keep(xs_bv)


def pick(xs_bv: jax.Array, keep_bv: jax.Array | None, q_bv: jax.Array | None, rows: dict[str, jax.Array],
         keys_b: jax.Array) -> jax.Array:
    """int32[B]: each row's token. Greedy rows (temperature 0) take the argmax of xs (ties: lower id);
    the others Gumbel-max over ``sampled_keep``. keep_bv None: no row samples (SamplerPlan.sampled
    False), so only the argmax is computed."""
    greedy_tok = _first_argmax(xs_bv)
    if keep_bv is None:
        return greedy_tok.astype(jnp.int32)
    keep = sampled_keep(xs_bv, keep_bv, q_bv, rows)
    gumbel_bv = jax.vmap(lambda k: jax.random.gumbel(k, (xs_bv.shape[1],), jnp.float32))(keys_b)
    # Materialise the noise: fused into the argmax's reduction loop, XLA:CPU runs threefry + log ~4x slower.
    gumbel_bv = jax.lax.optimization_barrier(gumbel_bv)
    noisy = _first_argmax(jnp.where(keep, xs_bv + gumbel_bv, -jnp.inf))
    return jnp.where(rows["temperature"] <= 0.0, greedy_tok, noisy).astype(jnp.int32)


_top_k_keep_step = jax.jit(top_k_keep, static_argnames="bits")
_alive_keep_step = jax.jit(alive_keep)
_renormalise_step = jax.jit(renormalise)
_top_p_keep_step = jax.jit(top_p_keep, static_argnames="bits")


def filter_steps(xs_bv: jax.Array, rows: dict, plan: SamplerPlan) -> tuple[jax.Array | None, jax.Array | None]:
    """Run the filter's programs the plan needs -> (keep, q) for ``pick`` (both None when no row
    samples). Each stage is a program of its own and always the same one, so whether a stage ran for
    this step's neighbours never changes a row's bits: a skipped stage's result is what the stage gives
    a row that does not use it (top-k: the alive set; top-p: the set it was given)."""
    if not plan.sampled:
        return None, None
    bits = plan.search_bits
    keep = _top_k_keep_step(xs_bv, rows["top_k"], bits=bits) if plan.top_k else _alive_keep_step(xs_bv)
    q = _renormalise_step(xs_bv, keep)
    if plan.top_p:
        keep = _top_p_keep_step(keep, q, rows["top_p"], bits=bits)
    return keep, q


def token_results(pre: dict[str, jax.Array], token_b: jax.Array) -> dict[str, jax.Array]:
    """What the host reads for each row: its token and that token's logprob."""
    return {"token": token_b, "logprob": jnp.take_along_axis(pre["logp"], token_b[:, None], axis=1)[:, 0]}


@jax.jit
def _pick_step(pre, keep, q, rows, keys_b):
    return token_results(pre, pick(pre["xs"], keep, q, rows, keys_b))


_prepare_step = jax.jit(prepare)
_top_logprobs_step = jax.jit(top_logprobs)


def sample(logits_bv: jax.Array, valid_v: jax.Array, counts_bv: jax.Array, seen_bv: jax.Array,
           rows: dict[str, np.ndarray], keys_b: jax.Array, take_b: np.ndarray | None = None,
           plan: SamplerPlan | None = None) -> dict[str, jax.Array]:
    """The whole sampler, as the engine runs it, for one batch of logits (notebooks, tests):
    -> {"token" int32[B], "logprob" f32[B], "top_ids" int32[B, 20], "top_logprobs" f32[B, 20]} (the last
    two when the plan computes them).

    rows: host arrays (they choose the SamplerPlan, unless ``plan`` is given: tests force plans with it);
    keys_b: per-row threefry keys (``row_keys``). The engine runs the same stages with ``prepare`` inside
    its model step and the state update inside its pick program (engine/scheduler.py)."""
    plan = SamplerPlan.of(rows, take_b) if plan is None else plan
    pre = _prepare_step(logits_bv, valid_v, counts_bv, seen_bv, rows)
    keep, q = filter_steps(pre["xs"], rows, plan)
    out = _pick_step(pre, keep, q, rows, keys_b)
    return {**out, **_top_logprobs_step(pre["logp"])} if plan.top_logprobs else out


TOPK_BLOCK = 1024


def top_k_by_blocks(x_bv: jax.Array, k: int, block: int = TOPK_BLOCK) -> tuple[jax.Array, jax.Array]:
    """The top k of the last axis in IEEE total order (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf <
    NaN; ties: lower index first), in stages over blocks of ``block`` columns: the k blocks with the
    largest maxima, the top k of each of those, then the top k of those candidates. On the CPU this is
    ``lax.top_k``'s values and indices, bit for bit.

    Every stage ranks ``order_key``'s uint32 keys, not the floats: XLA:GPU's own top-k kernel for k <= 16
    compares floats (it skips NaN and ties -0.0 with +0.0), while its sort-based top-k for larger k uses
    the total order, so ``lax.top_k`` on floats gives a NaN or signed-zero row one answer or the other by
    k there. On integer keys every backend and every k agree.

    Why blocks: XLA:GPU lowers a top-20 over a [64, 129280] vocabulary row to a full segmented radix sort
    (six launches, 0.9 ms of the H200 slice's decode step). Sorting every block's 1024 elements cut that
    to one sort of [64 x 127, 1024] (0.29 ms on the H200, 2026-12-05); only k of the 127 blocks can hold
    a winner, so the sort now sees k of them. Exact: an element in any other block is outranked by the
    k chosen blocks' maxima (larger, or equal and in a lower block, so at a lower index), so it is not in
    the top k. Within the chosen blocks, candidates are laid out in index order (blocks sorted by index,
    each block's candidates in index order among equal keys), so the last stage's "lower position
    first" is "lower index first". Rows shorter than 8 blocks take one top k of the keys."""
    b, v = x_bv.shape
    key_bv = _order_key(x_bv, fold_signed_zeros=False)
    if v < 8 * block or k > block:
        _, idx = jax.lax.top_k(key_bv, k)
        return jnp.take_along_axis(x_bv, idx, axis=1), idx
    nb = -(-v // block)
    # padding at the end: key 0, the least key (only the all-ones -NaN has it too), at indices past every
    # real one, so it loses every tie with a real element and v >= k real ones outrank it
    kp = jnp.pad(key_bv, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    kb = min(k, nb)
    _, blocks_bj = jax.lax.top_k(jnp.max(kp, axis=-1), kb)     # ties: lower block
    blocks_bj = jnp.sort(blocks_bj, axis=-1)
    key_bjk, idx_bjk = jax.lax.top_k(jnp.take_along_axis(kp, blocks_bj[:, :, None], axis=1), k)
    idx_bjk = idx_bjk + blocks_bj[:, :, None] * block
    _, pos = jax.lax.top_k(key_bjk.reshape(b, kb * k), k)
    idx = jnp.take_along_axis(idx_bjk.reshape(b, kb * k), pos, axis=1)
    return jnp.take_along_axis(x_bv, idx, axis=1), idx


__all__ = ["MAX_LOGPROBS", "SamplerPlan", "SamplingParams", "empty_rows", "alive_keep", "filter_steps", "pick", "prepare",
           "request_seed", "row_keys", "renormalise", "sample", "sampled_keep", "seed_words", "set_row",
           "token_results", "top_logprobs", "top_k_by_blocks", "top_k_keep", "top_p_keep"]
