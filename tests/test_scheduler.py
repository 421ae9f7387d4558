"""The scheduler against a toy row-local language model (fast to compile), checked against a serial
token-by-token reference: chunked prefill, queueing over few slots, the device-side Engram hash, bounded
replay, stops, the async launch/collect order, slot reuse, and no recompilation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine.engram_device import advance_history, digit_bits, engram_rows_device, engram_tables
from deepinfer_jax.engine.sampling import SamplingParams, empty_rows, request_seed, row_keys, sample, seed_words, set_row
from deepinfer_jax.engine.scheduler import EngineConfig, ModelFns, Request, Scheduler
from deepinfer_jax.engine.tokenizer import Tokenizer
from deepinfer_jax.model.engram_hash import engram_rows
from deepinfer_jax.model.numerics import Numerics

D = 8  # toy hidden size
N_ROWS = 97  # toy Engram table size (row ids are taken modulo this)
NUMERICS = Numerics.exact()
ROOT_CFG = "tests/fixtures/v41_flash_config.json"


# ------------------------------------------------------------------------------------- the toy model
UPPER = 2  # toy layers above the last KV source: two, so bounded replay is an approximation here too


def toy_init_cache(cfg, batch, max_len, numerics):
    w = cfg.sliding_window
    ring = lambda: {"kv": jnp.zeros((batch, w, D)), "pos": jnp.full((batch, w), -1, jnp.int32)}  # noqa: E731
    return {"low": jnp.zeros((batch, max_len, D)), "low_pos": jnp.full((batch, max_len), -1, jnp.int32),
            "rings": tuple(ring() for _ in range(UPPER))}


def toy_reset_slots(cache, reset_b):
    """Like model/cache.py: empty the positions the toy's attention would trust."""
    clear = lambda pos: jnp.where(reset_b[:, None], -1, pos)  # noqa: E731
    return {"low": cache["low"], "low_pos": clear(cache["low_pos"]),
            "rings": tuple(dict(r, pos=clear(r["pos"])) for r in cache["rings"])}


def _mm(a, b):
    # True fp32 products: jax's default precision on a GPU lets fp32 dots run as TF32, and one ulp of
    # summation-order difference upstream then flips TF32 roundings (measured on the H200: logprobs
    # 1.7 % apart, same tokens), which the tests' fp32 round-off tolerance would not cover.
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _toy_ring_layer(ring, x_btd, up_bt, w_dd, window):
    """Window attention over a ring that, like model/window.py, trusts ring rows below the chunk's first
    position; rows with up_bt = -1 pass x through and write nothing."""
    first = jnp.min(jnp.where(up_bt >= 0, up_bt, 2**30), axis=1)
    ring_pos = jnp.where(ring["pos"] < first[:, None], ring["pos"], -1)
    kpos = jnp.concatenate([ring_pos, up_bt], 1)  # [B, W+T]
    kval = jnp.concatenate([ring["kv"], x_btd], 1)
    q = up_bt[:, :, None]
    m = (kpos[:, None] >= 0) & (kpos[:, None] <= q) & (kpos[:, None] > q - window)
    ctx = jnp.sum(jnp.where(m[..., None], kval[:, None], 0.0), 2) / jnp.maximum(jnp.sum(m, 2), 1)[..., None]
    y = jnp.where((up_bt >= 0)[..., None], jnp.tanh(_mm(x_btd + ctx, w_dd)), x_btd)
    rows = jnp.arange(x_btd.shape[0])[:, None]
    slot = jnp.where(up_bt >= 0, up_bt % window, window)
    return y, {"kv": ring["kv"].at[rows, slot].set(x_btd, mode="drop"),
               "pos": ring["pos"].at[rows, slot].set(up_bt, mode="drop")}


def toy_hidden(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics, replay_mask_bt=None):
    """Row-local like the real model. Lower layer: causal mean over every earlier position (a cache
    indexed by position), run on every token. Upper layers: window-W rings, run only where
    replay_mask_bt is True."""
    b, t = tokens_bt.shape
    max_len, w = cache["low"].shape[1], cfg.sliding_window
    assert t <= w, "the toy ring writes a chunk without collisions only for chunks <= window"
    live = positions_bt >= 0
    eng = jnp.sum(params["eng"][engram_rows_btnc % N_ROWS], axis=(2, 3))
    x = params["emb"][tokens_bt] + 0.1 * params["pos"][jnp.clip(positions_bt, 0)] + eng
    rows = jnp.arange(b)[:, None]
    where = jnp.where(live, positions_bt, max_len)
    low = cache["low"].at[rows, where].set(x, mode="drop")
    low_pos = cache["low_pos"].at[rows, where].set(positions_bt, mode="drop")
    vis = (low_pos[:, None, :] >= 0) & (low_pos[:, None, :] <= positions_bt[:, :, None])  # [B, T, L]
    mean = jnp.sum(jnp.where(vis[..., None], low[:, None], 0.0), 2) / jnp.maximum(jnp.sum(vis, 2), 1)[..., None]
    h = jnp.tanh(_mm(mean, params["w1"]))
    up = positions_bt if replay_mask_bt is None else jnp.where(replay_mask_bt, positions_bt, -1)
    rings = []
    for i, ring in enumerate(cache["rings"]):
        h, ring = _toy_ring_layer(ring, h, up, params["w_up"][i], w)
        rings.append(ring)
    return h, {"low": low, "low_pos": low_pos, "rings": tuple(rings)}


def toy_head(params, h_btd):
    return _mm(h_btd, params["out"]).astype(jnp.float32)


TOY = ModelFns(toy_hidden, toy_head, toy_init_cache, toy_reset_slots)


@pytest.fixture(scope="module")
def toy_params(tiny_cfg):
    rng = np.random.default_rng(0)
    v = tiny_cfg.vocab_size
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return {"emb": f(v, D), "pos": f(tiny_cfg.max_position_embeddings, D), "eng": f(N_ROWS, D) * 0.3,
            "w1": f(D, D), "w_up": f(UPPER, D, D), "out": f(D, v) * 1.5}


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return Tokenizer.from_dir(tiny_ckpt)


def make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, **kw):
    return Scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, NUMERICS, EngineConfig(**kw), model=TOY)


# ------------------------------------------------------------------------------------- the reference
def reference(toy_params, cfg, tok, token_map, prompt, sp, rid, *, max_len, bounded=True, engine_seed=0):
    """One request alone, one token per step, Engram rows hashed on the host, the replay mask and the
    stop rules written out independently of the scheduler. -> (tokens, logprobs, prompt logprobs)."""
    n1 = cfg.engram_max_ngram_size - 1
    pad = int(token_map[cfg.engram_pad_token_id])
    valid = jnp.asarray(tok.valid_token_mask(cfg.vocab_size))
    cache = toy_init_cache(cfg, 1, max_len, NUMERICS)
    hidden = jax.jit(toy_hidden, static_argnums=(1, 6))
    key = jax.random.key(engine_seed, impl="threefry2x32")
    counts = np.zeros((1, cfg.vocab_size), np.int32)
    seen = np.zeros((1, cfg.vocab_size), bool)
    seen[0, prompt] = True
    rows_p = empty_rows(1)
    set_row(rows_p, 0, sp)
    seed = jnp.asarray(seed_words(request_seed(sp, rid))[None])
    ids, out, lps, plp = list(prompt), [], [], [None]
    n_prompt = len(prompt)
    budget = min(sp.max_tokens, max_len - n_prompt)
    pos = 0
    while True:
        comp = token_map[np.asarray(ids, np.int64)]
        rows = engram_rows(cfg, comp[pos:pos + 1], comp[max(0, pos - n1):pos], pad)
        replay = pos >= n_prompt or not bounded or sp.prompt_logprobs or pos >= n_prompt - cfg.sliding_window
        h, cache = hidden(toy_params, cfg, cache, jnp.array([[ids[pos]]], jnp.int32), jnp.array([[pos]], jnp.int32),
                          jnp.asarray(rows[None]), NUMERICS, jnp.array([[replay]]))
        logits = toy_head(toy_params, h)[:, 0]
        if pos < n_prompt - 1:
            if sp.prompt_logprobs:
                lp = jax.nn.log_softmax(jnp.where(valid, logits, -jnp.inf))[0, ids[pos + 1]]
                plp.append(float(lp))
            pos += 1
            continue
        res = jax.device_get(sample(logits, valid, jnp.asarray(counts), jnp.asarray(seen),
                                    {k: jnp.asarray(v) for k, v in rows_p.items()},
                                    row_keys(key, seed, jnp.array([pos + 1], jnp.int32))))
        t = int(res["token"][0])
        out.append(t)
        lps.append(float(res["logprob"][0]))
        counts[0, t] += 1
        seen[0, t] = True
        if (t == tok.eos_id and not sp.ignore_eos) or t in sp.stop_token_ids or len(out) >= budget:
            return out, lps, plp if sp.prompt_logprobs else None
        ids.append(t)
        pos += 1


def _prompts(n, seed, lo=2, hi=30):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 800, int(rng.integers(lo, hi)))] for _ in range(n)]


MIXED = [SamplingParams(max_tokens=6, temperature=0.0),
         SamplingParams(max_tokens=5, temperature=0.9, seed=11),
         SamplingParams(max_tokens=7, temperature=1.2, top_k=30, top_p=0.9, repetition_penalty=1.3),
         SamplingParams(max_tokens=4, temperature=0.7, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3),
         SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=True)]


# ------------------------------------------------------------------------------------- Engram hash
@pytest.mark.parametrize("which", ["tiny", "v41-flash"])
def test_device_engram_rows_equal_the_host_hash(which, tiny_cfg):
    cfg = tiny_cfg if which == "tiny" else ModelConfig.from_json(ROOT_CFG)
    n_keys = cfg.engram_compressed_vocab_size
    tables = {k: jnp.asarray(v) for k, v in engram_tables(cfg, n_keys).items()}
    max_prime = int(np.asarray(tables["primes"]).max())
    assert digit_bits(max_prime) == (16 if which == "tiny" else 8)
    pad = 2
    n1 = cfg.engram_max_ngram_size - 1
    rng = np.random.default_rng(5)
    seq = rng.integers(0, n_keys, 23)
    fn = jax.jit(engram_rows_device, static_argnums=(3, 4))
    for start, t in [(0, 5), (1, 4), (2, 1), (7, 8), (20, 3)]:
        hist = seq[max(0, start - n1):start]
        want = engram_rows(cfg, seq[start:start + t], hist, pad)
        hist_dev = np.full((1, n1), -1, np.int32)
        hist_dev[0, n1 - len(hist):] = hist
        comp = np.full((1, t + 2), -1, np.int32)  # two padding columns after the live ones
        comp[0, :t] = seq[start:start + t]
        got = np.asarray(fn(tables, jnp.asarray(hist_dev), jnp.asarray(comp), pad, max_prime))[0, :t]
        np.testing.assert_array_equal(got, want)
        nxt = np.asarray(advance_history(jnp.asarray(hist_dev), jnp.asarray(comp)))[0]
        expect = np.concatenate([np.full(n1, -1), seq[:start + t]])[-n1:]
        np.testing.assert_array_equal(nxt, expect)
    with pytest.raises(ValueError, match="exceed engram_compressed_vocab_size"):
        engram_tables(cfg, n_keys + 1)


# ------------------------------------------------------------------------------------- scheduler
@pytest.mark.parametrize("bounded", [True, False])
def test_matches_the_serial_reference(bounded, toy_params, tiny_cfg, tokenizer, tiny_token_map):
    """8 requests on 3 slots (queueing, slot reuse), prompts from 2 to 29 tokens (several chunks, some
    longer than the window), mixed sampling: the same tokens as the one-request, one-token reference;
    logprobs to fp32 round-off (the chunked and one-token sums add in different orders)."""
    sch = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, max_slots=3, max_len=40, chunk_size=4,
                         bounded_replay=bounded)
    prompts = _prompts(8, 1)
    params = [MIXED[i % len(MIXED)] for i in range(8)]
    reqs = sch.run([Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    for r, p, sp in zip(reqs, prompts, params):
        toks, lps, plp = reference(toy_params, tiny_cfg, tokenizer, tiny_token_map, p, sp, r.request_id, max_len=40,
                                   bounded=bounded)
        assert r.generated == toks, r.request_id
        np.testing.assert_allclose(r.logprobs, lps, rtol=1e-5, atol=1e-5)
        if sp.prompt_logprobs:
            assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p)
            np.testing.assert_allclose(r.prompt_logprobs[1:], plp[1:], rtol=1e-5, atol=1e-5)
        assert r.finish_reason == "length"


def test_bounded_replay_changes_long_prompts_only(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    short, long = _prompts(1, 2, 3, 8)[0], _prompts(1, 3, 25, 26)[0]
    g = SamplingParams(max_tokens=2, temperature=0.0)
    res = {}
    for bounded in (True, False):
        sch = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, max_slots=2, max_len=40,
                             chunk_size=8, bounded_replay=bounded)
        res[bounded] = sch.run([Request("s", short, g), Request("l", long, g)])
    assert res[True][0].logprobs == res[False][0].logprobs  # within the window: bitwise the same
    assert res[True][1].logprobs != res[False][1].logprobs  # beyond it: an approximation


def _bits(r):
    return r.generated, np.asarray(r.logprobs, np.float32).tobytes()


def test_bitwise_invariance_and_slot_reuse(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    sch = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, max_slots=3, max_len=40, chunk_size=8)
    target = _prompts(1, 4, 27, 28)[0]
    tp = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    alone = _bits(sch.run([Request("t", target, tp)])[0])
    for n_other, at, seed in [(1, 0, 5), (4, 2, 6), (7, 7, 7)]:
        others = [Request(f"o{i}", p, MIXED[i % len(MIXED)]) for i, p in enumerate(_prompts(n_other, seed))]
        others.insert(at, Request("t", target, tp))
        assert _bits(sch.run(others)[at]) == alone, (n_other, at)
    # negative control: without the admission reset, a slot's previous request leaks into the ring
    no_reset = dataclasses.replace(TOY, reset_slots=lambda cache, reset_b: cache)
    leaky = Scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, NUMERICS,
                      EngineConfig(max_slots=1, max_len=40, chunk_size=8), model=no_reset)
    alone_leaky = _bits(leaky.run([Request("t", target, tp)])[0])
    after = leaky.run([Request("pre", _prompts(1, 9, 15, 16)[0], SamplingParams(max_tokens=6, ignore_eos=True)),
                       Request("t", target, tp)])[1]
    assert _bits(after) != alone_leaky


def _slot_keys(engine_key, seeds_b2, positions_b):
    """Deliberately variant: sampling keys from the slot index instead of the request's seed."""
    slot = jnp.arange(seeds_b2.shape[0], dtype=jnp.uint32)
    return row_keys(engine_key, jnp.stack([slot, slot], axis=1), positions_b)


def test_negative_control_slot_keyed_sampler(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    sch = Scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, NUMERICS,
                    EngineConfig(max_slots=3, max_len=40, chunk_size=8), model=TOY, keys_fn=_slot_keys)
    target = _prompts(1, 4, 27, 28)[0]
    tp = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    alone = _bits(sch.run([Request("t", target, tp)])[0])
    moved = []
    for n_other, at, seed in [(1, 1, 5), (2, 2, 6)]:
        others = [Request(f"o{i}", p, SamplingParams(max_tokens=3)) for i, p in enumerate(_prompts(n_other, seed))]
        others.insert(at, Request("t", target, tp))
        moved.append(_bits(sch.run(others)[at]))
    assert any(m != alone for m in moved)


def test_stops_and_finish_reasons(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    sch = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, max_slots=2, max_len=24, chunk_size=8)
    p = _prompts(1, 8, 10, 11)[0]
    free = sch.run([Request("a", p, SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))])[0]
    assert free.finish_reason == "length" and len(free.generated) == 8
    third = free.generated[2]
    k = free.generated.index(third)  # the first occurrence stops it
    neighbour = Request("n", _prompts(1, 9)[0], SamplingParams(max_tokens=5, seed=2))
    stopped, n_after = sch.run([Request("a", p, SamplingParams(max_tokens=8, temperature=0.8, seed=1,
                                                               stop_token_ids=(third,))), neighbour])
    assert stopped.finish_reason == "stop" and stopped.generated == free.generated[:k + 1]
    # the row wasted after the stop is discarded and the neighbour is unaffected
    n_alone = sch.run([Request("n", neighbour.prompt_ids, neighbour.params)])[0]
    assert _bits(n_after) == _bits(n_alone)
    # a stop string cuts the text before its first occurrence (it may span several tokens)
    text = free.text
    cut = text[len(text) // 2:len(text) // 2 + 2]
    assert cut.strip(), repr(text)
    s = sch.run([Request("a", p, SamplingParams(max_tokens=8, temperature=0.8, seed=1, stop=(cut, "never")))])[0]
    assert s.finish_reason == "stop" and s.text == text[:text.index(cut)] and len(s.generated) < 8
    # the context: 24 - 20 = 4 tokens fit after a 20-token prompt
    ctx = sch.run([Request("c", _prompts(1, 10, 20, 21)[0], SamplingParams(max_tokens=50, ignore_eos=True))])[0]
    assert ctx.finish_reason == "length" and len(ctx.generated) == 4


def test_eos_stops_unless_ignored(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    eos = tokenizer.eos_id
    params = dict(toy_params, out=toy_params["out"].at[:, eos].set(0.0))
    params["out"] = params["out"].at[0, eos].set(1e3)  # EOS wins (greedy) whenever h[0] > 0.01
    sch = Scheduler(params, tiny_cfg, tokenizer, tiny_token_map, NUMERICS,
                    EngineConfig(max_slots=2, max_len=24, chunk_size=8), model=TOY)
    runs = {}
    for ignore in (False, True):
        runs[ignore] = sch.run([Request(f"p{i}", q, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=ignore))
                                for i, q in enumerate(_prompts(6, 15, 2, 15))])
    stopped = [r for r in runs[False] if r.finish_reason == "stop"]
    assert stopped, "no prompt drew EOS; pick other prompts"
    for r, full in zip(runs[False], runs[True]):
        assert full.finish_reason == "length" and len(full.generated) == 6
        if r.finish_reason == "stop":
            k = full.generated.index(eos)
            assert r.generated == full.generated[:k + 1] and eos not in r.generated[:-1]
        else:
            assert r.generated == full.generated and eos not in r.generated


def _slow_hidden(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics, replay_mask_bt=None):
    """The toy model plus ~30 ms of device work per step, so a host wait would show in the timings."""
    h, cache = toy_hidden(params, cfg, cache, tokens_bt, positions_bt, engram_rows_btnc, numerics, replay_mask_bt)
    m = jnp.full((512, 512), 0.01) + 1e-3 * h[0, 0, 0]
    for _ in range(30):
        m = jnp.tanh(m @ m)
    return h + 1e-30 * m[0, 0], cache


def test_launch_before_collect_without_waiting(toy_params, tiny_cfg, tokenizer, tiny_token_map, monkeypatch):
    """Step N+1 is launched before step N is read, every step is read once in launch order, and a launch
    never waits for the device: the waiting all happens in the reads of finished tokens."""
    import time

    sch = Scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, NUMERICS,
                    EngineConfig(max_slots=2, max_len=40, chunk_size=8),
                    model=dataclasses.replace(TOY, hidden=_slow_hidden))
    events, spent = [], {"L": 0.0, "C": 0.0}
    for name in ("_launch_prefill", "_launch_decode", "_collect"):
        real = getattr(sch, name)
        kind = "C" if name == "_collect" else "L"

        def spy(*a, _real=real, _kind=kind):
            t0 = time.perf_counter()
            out = _real(*a)
            spent[_kind] += time.perf_counter() - t0
            events.append((_kind, out if _kind == "L" else a[0]))
            return out

        monkeypatch.setattr(sch, name, spy)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=6, seed=i)) for i, p in enumerate(_prompts(3, 12))]
    sch.run(reqs)  # warm-up (compiles)
    events.clear()
    spent.update(L=0.0, C=0.0)
    sch.run(reqs)
    launched = [obj for kind, obj in events if kind == "L"]
    collected = [obj for kind, obj in events if kind == "C"]
    assert len(launched) > 8 and collected == launched
    for i, (kind, obj) in enumerate(events):
        if kind == "C" and launched.index(obj) + 1 < len(launched):
            assert events.index(("L", launched[launched.index(obj) + 1])) < i
    # each step holds >= 30 ms of device work; launches that waited for it would take that long each
    print("time in launches vs reads", spent)
    if jax.default_backend() == "cpu":
        # _slow_hidden's work is sized for the CPU: on the H200 it takes well under a millisecond, the
        # steps are launch-bound and the ratio says nothing (2026-12-06: launches 20 ms, reads 4.9 ms)
        assert spent["L"] < 0.3 * spent["C"], spent


def test_no_recompilation_after_warmup(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    # shapes no other test uses, so the warm-up compiles exactly this engine's programs
    sch = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, max_slots=5, max_len=36, chunk_size=6)
    start = sch.compile_count()
    sch.run([Request("w", _prompts(1, 13)[0], SamplingParams(max_tokens=2, prompt_logprobs=True))])
    before = sch.compile_count()
    # prefill, decode, prompt logprobs; the sampler's pick (both forms) and top-20, all warmed on the first
    # sampled step, as are its filter programs (shared by every scheduler, not counted)
    assert before - start == 6
    compiles = []
    listener = lambda name, *_a, **_k: compiles.append(name) if name.endswith("backend_compile_duration") else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        sch.run([Request(f"r{i}", p, MIXED[i % len(MIXED)]) for i, p in enumerate(_prompts(7, 14))])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert sch.compile_count() == before and compiles == []


def test_xla_options_reach_every_program(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    """EngineConfig.xla_options are compiled into the engine's programs: a known option (command
    buffers off, a no-op on the CPU) gives the default engine's bits, an unknown name fails at the
    first compile, and malformed options are refused up front."""
    prompts = _prompts(2, 21)
    reqs = lambda: [Request(f"x{i}", p, MIXED[i % len(MIXED)]) for i, p in enumerate(prompts)]  # noqa: E731
    kw = dict(max_slots=2, max_len=40, chunk_size=8)
    base = [_bits(r) for r in make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, **kw).run(reqs())]
    graphs_off = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, **kw,
                                xla_options=(("xla_gpu_enable_command_buffer", ""),))
    assert graphs_off.compiler_options["xla_gpu_enable_command_buffer"] == ""
    assert [_bits(r) for r in graphs_off.run(reqs())] == base
    bad = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, **kw, xla_options=(("xla_no_such_flag", 1),))
    with pytest.raises(Exception, match="No such compile option: 'xla_no_such_flag'"):
        bad.run(reqs())
    for wrong in ((("xla_gpu_enable_command_buffer",),), [("a", 1)], ((1, 2),), (("a", None),)):
        with pytest.raises(ValueError, match="xla_options must be a tuple of"):
            EngineConfig(xla_options=wrong)


def test_request_errors(toy_params, tiny_cfg, tokenizer, tiny_token_map):
    sch = make_scheduler(toy_params, tiny_cfg, tokenizer, tiny_token_map, max_slots=2, max_len=16, chunk_size=8)
    with pytest.raises(ValueError, match=r"request 'x': prompt has 16 tokens, the context holds 16 .* at most 15"):
        sch.run([Request("x", list(range(3, 19)), SamplingParams())])
    with pytest.raises(ValueError, match="request 'e': empty prompt"):
        sch.run([Request("e", [], SamplingParams())])
    with pytest.raises(ValueError, match=r"request 'v': prompt token ids \[129280\] outside \[0, 129280\)"):
        sch.run([Request("v", [5, 129280], SamplingParams())])
    with pytest.raises(ValueError, match=r"stop_token_ids \[200000\] outside"):
        sch.run([Request("s", [5], SamplingParams(stop_token_ids=(200000,)))])
    with pytest.raises(ValueError, match="request ids must be unique; 'd' appears 2 times"):
        sch.run([Request("d", [5], SamplingParams()), Request("d", [6], SamplingParams())])
    with pytest.raises(ValueError, match="chunk_size 32 exceeds max_len 16"):
        EngineConfig(max_len=16, chunk_size=32)
    with pytest.raises(ValueError, match="max_slots must be a positive integer"):
        EngineConfig(max_slots=0)
