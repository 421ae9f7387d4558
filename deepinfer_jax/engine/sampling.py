"""SamplingParams and the per-row deterministic sampler (runs inside the jitted step).

A row's sample is a function of its own logits, its own parameters and its own key only: the key is
threefry ``fold_in(fold_in(fold_in(engine_key, seed_hi), seed_lo), position)``, the noise is drawn
per row with the row's vocabulary shape (never one [B, V] draw from a shared key), filtering sorts
within the row (ties: lower id first), and the pick is Gumbel-max. Greedy (temperature 0) is argmax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

UINT64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: derived from the request id (still deterministic)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0 = only the sampled token's)
    prompt_logprobs: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        def bad(field, why):
            return ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed <= UINT64):
            raise bad("seed", "must be an integer in [0, 2^64)")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        for f in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, f) <= 2.0:
                raise bad(f, "must be in [-2, 2]")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "request") -> "SamplingParams":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"{where}: unknown sampling field(s) {unknown}; known: {sorted(fields)}")
        return cls(**d)


MAX_TOP_N = 20


def _row_sample(logits_v, valid_v, counts_v, seen_v, temp, top_p, top_k, min_p, rep, pres, freq, key):
    """One row: (token, logprob of token, top-n ids, top-n logprobs). All row-local."""
    neg = jnp.float32(-jnp.inf)
    raw = jnp.where(valid_v, logits_v, neg)
    logp = jax.nn.log_softmax(raw)
    x = raw
    # repetition penalty (seen in prompt or output), then OpenAI presence/frequency on generated counts
    x = jnp.where(seen_v, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - pres * (counts_v > 0) - freq * counts_v.astype(jnp.float32)
    greedy = temp <= 0.0
    x = x / jnp.where(greedy, 1.0, temp)
    order = jnp.argsort(-x, stable=True)  # descending; ties: lower id first
    sorted_x = x[order]
    probs = jax.nn.softmax(sorted_x)
    rank = jnp.arange(x.shape[0])
    keep = jnp.where(top_k > 0, rank < top_k, True)
    cum = jnp.cumsum(probs) - probs  # mass strictly before this token
    keep &= cum < top_p
    keep &= probs >= min_p * probs[0]
    keep = keep.at[0].set(True)
    filtered = jnp.where(keep, sorted_x, neg)
    gumbel = jax.random.gumbel(key, x.shape, jnp.float32)
    pick_sorted = jnp.where(greedy, 0, jnp.argmax(filtered + gumbel))
    token = order[pick_sorted]
    top_lp, top_ids = jax.lax.top_k(logp, MAX_TOP_N)
    return token.astype(jnp.int32), logp[token], top_ids.astype(jnp.int32), top_lp


def sample(logits_bv, valid_v, counts_bv, seen_bv, params_b: dict, keys_b):
    """Vectorised over rows with vmap (per-row keys, per-row shapes)."""
    return jax.vmap(_row_sample, in_axes=(0, None, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))(
        logits_bv, valid_v, counts_bv, seen_bv, params_b["temperature"], params_b["top_p"], params_b["top_k"],
        params_b["min_p"], params_b["repetition_penalty"], params_b["presence_penalty"],
        params_b["frequency_penalty"], keys_b)


def row_keys(engine_key: jax.Array, seeds_b2: jax.Array, positions_b: jax.Array) -> jax.Array:
    """threefry key per row: engine key, folded with the request seed (two 32-bit words) and the position."""
    def one(seed2, pos):
        k = jax.random.fold_in(engine_key, seed2[0])
        k = jax.random.fold_in(k, seed2[1])
        return jax.random.fold_in(k, pos)

    return jax.vmap(one)(seeds_b2, positions_b)


def seed_words(seed: int) -> np.ndarray:
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


def request_seed(params: SamplingParams, request_id: str) -> int:
    """The explicit seed, or a stable 64-bit hash of the request id (same id -> same samples)."""
    if params.seed is not None:
        return params.seed
    import hashlib

    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")


def params_row(p: SamplingParams) -> dict[str, float | int]:
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
            "repetition_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty}


PARAM_DTYPES = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "min_p": np.float32,
                "repetition_penalty": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32}
