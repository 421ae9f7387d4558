"""The public LLM API on the tiny checkpoint: prompt kinds, chat, outputs, logprobs and prompt logprobs,
stops, callbacks, and the errors that say what is wrong (and what fits)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.engine.encoding import encode_messages
from deepinfer_jax.engine.llm import RequestOutput

ENGINE = dict(max_slots=4, max_len=64, chunk_size=8)  # the engine shape every engine test file uses


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, **ENGINE)


def test_prompt_kinds_and_output_order(llm):
    text = "Write one sentence about the sea."
    ids = llm.tokenizer.encode(text)
    g = SamplingParams(max_tokens=4, temperature=0.0)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}], g)
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert outs[0].prompt == text and outs[1].prompt is None and outs[0].prompt_token_ids == ids
    assert len({tuple(o.token_ids) for o in outs}) == 1 and len(outs[0].token_ids) == 4
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)
    single = llm.generate(text, g)  # one string (or one id list) is one prompt
    assert len(single) == 1 and single[0].token_ids == outs[0].token_ids
    assert llm.generate(ids, g)[0].token_ids == outs[0].token_ids
    assert set(outs[0].to_dict()) == {"request_id", "prompt", "prompt_token_ids", "text", "token_ids",
                                      "finish_reason", "logprobs", "top_logprobs", "prompt_logprobs"}


def test_chat_uses_the_v41_encoding(llm):
    conv = [{"role": "user", "content": "What color is the sky?"}]
    g = SamplingParams(max_tokens=3, temperature=0.0)
    a = llm.chat(conv, g)[0]
    b = llm.generate(encode_messages(conv), g)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.token_ids == b.token_ids
    assert a.prompt_token_ids[0] == llm.tokenizer.bos_id
    t = llm.chat([conv, conv], g, thinking=True, reasoning_effort="max")
    assert len(t) == 2 and t[0].prompt == encode_messages(conv, thinking=True, reasoning_effort="max")
    assert t[0].prompt_token_ids != a.prompt_token_ids


def test_greedy_logprobs_and_seeds(llm):
    p = "Tell me about a robot."
    g1 = llm.generate(p, SamplingParams(max_tokens=6, temperature=0.0, logprobs=4))[0]
    g2 = llm.generate(p, SamplingParams(max_tokens=6, temperature=0.0, seed=99))[0]
    assert g1.token_ids == g2.token_ids and g1.logprobs == g2.logprobs  # greedy ignores the seed
    assert g2.top_logprobs is None and len(g1.top_logprobs) == 6 and all(len(t) == 4 for t in g1.top_logprobs)
    for tid, lp, top in zip(g1.token_ids, g1.logprobs, g1.top_logprobs):
        best = next(iter(top))
        assert tid == best and lp == top[best]  # greedy picks the model's top-1; its logprob is reported
        assert list(top.values()) == sorted(top.values(), reverse=True)
    s = [llm.generate(p, SamplingParams(max_tokens=6, temperature=1.0, seed=s))[0].token_ids for s in (1, 1, 2)]
    assert s[0] == s[1] != s[2]
    # without a seed, the request id seeds the sampler: same id, same tokens
    by_id = [llm.generate(p, SamplingParams(max_tokens=6), request_ids=[i])[0].token_ids for i in ("x", "x", "y")]
    assert by_id[0] == by_id[1] != by_id[2]


@pytest.fixture(scope="module")
def full_llm(tiny_ckpt):
    """No bounded replay (the same compiled programs: replay is a host-side mask)."""
    return LLM(tiny_ckpt, **ENGINE, bounded_replay=False)


def test_prompt_logprobs(llm, full_llm):
    """prompt_logprobs[k] is log p(prompt[k] | prompt[:k]); it equals the logprob the engine reported when
    it generated that same token (different step programs: fp32 round-off apart). The generating engine
    has no bounded replay: prompt logprobs always come from a full prefill, and this prompt is longer
    than the window."""
    base = llm.tokenizer.encode("The quick brown fox")
    assert len(base) > llm.cfg.sliding_window
    g = full_llm.generate(base, SamplingParams(max_tokens=3, temperature=0.0))[0]
    full = base + g.token_ids
    o = llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(full)
    # 2e-4 nat: the [chunk, V] and [1, V] head GEMMs and the chunked vs one-token attention sum in different
    # orders in bf16 activations; measured differences are ~1e-5
    np.testing.assert_allclose(o.prompt_logprobs[len(base):], g.logprobs, atol=2e-4)
    assert all(lp <= 0 for lp in o.prompt_logprobs[1:])


def test_prompt_logprobs_requests_get_a_full_prefill(llm, full_llm):
    """Bounded replay would leave early positions without upper layers, so a request asking for prompt
    logprobs is prefilled fully: it is bitwise the request of an engine without replay."""
    full = full_llm
    long = [int(t) for t in np.random.default_rng(3).integers(3, 800, 30)]
    sp = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=True)
    a, b = llm.generate(long, sp)[0], full.generate(long, sp)[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs


def test_stops_lengths_and_callbacks(llm):
    p = "Write one sentence about mountains."
    free = llm.generate(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    tid = free.token_ids[3]
    s = llm.generate(p, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[tid]))[0]
    assert s.finish_reason == "stop" and s.token_ids == free.token_ids[:free.token_ids.index(tid) + 1]
    long = list(range(3, 3 + 60))  # 60 + 4 = the 64-token context
    c = llm.generate([long], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4
    seen, tokens = [], []
    outs = llm.generate(["a", "b c", "d e f"], SamplingParams(max_tokens=3), use_tqdm=True,
                        on_finish=seen.append, on_tokens=tokens.append)
    assert sorted(o.request_id for o in seen) == ["0", "1", "2"] and sum(tokens) == sum(len(o.token_ids) for o in outs)


def test_errors_say_what_is_wrong(llm, tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"request '0': prompt has 64 tokens, the context holds 64 .* at most 63"):
        llm.generate([list(range(3, 67))])
    with pytest.raises(ValueError, match="got 2 prompts and 3 sampling params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(ValueError, match="got 1 prompts and 2 request ids"):
        llm.generate(["a"], request_ids=["x", "y"])
    with pytest.raises(ValueError, match="request ids must be unique; 'x' appears 2 times"):
        llm.generate(["a", "b"], request_ids=["x", "x"])
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        llm.generate(["a"], [{"max_tokens": 3}])
    with pytest.raises(ValueError, match="a dict prompt holds exactly one of"):
        llm.generate([{"prompt": "a", "extra": 1}])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(tmp_path)
    with pytest.raises(ValueError, match="max_len 5000 exceeds the model's context"):
        LLM(tiny_ckpt, max_len=5000)
    with pytest.raises(ValueError, match="numerics must be one of"):
        LLM(tiny_ckpt, numerics="fp64")
    with pytest.raises(ValueError, match="chunk_size 128 exceeds max_len 64"):
        LLM(tiny_ckpt, max_len=64, chunk_size=128)
    with pytest.raises(MemoryError, match=r"max_slots=100000 x max_len=4096 needs .* GiB .* (\d+) slots fit at this max_len"):
        LLM(tiny_ckpt, max_slots=100_000, max_len=4096)


def test_xla_options_reach_the_engine(tiny_ckpt):
    """LLM(xla_options=...) compiles them into the engine's programs: an unknown name fails at once."""
    llm = LLM(tiny_ckpt, **ENGINE, xla_options={"xla_no_such_flag": 1})
    assert llm.scheduler.compiler_options["xla_no_such_flag"] == 1
    with pytest.raises(Exception, match="No such compile option: 'xla_no_such_flag'"):
        llm.generate(["a"], [SamplingParams(max_tokens=1)])


def test_manifest(llm):
    m = llm.manifest
    assert m["prng"] == "threefry2x32" and m["engine"]["max_slots"] == 4 and m["backend"] == "cpu"
