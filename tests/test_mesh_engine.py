"""The engine on a device mesh, the loader's host-local reading, and the engine's planner-based memory check.

* 8 simulated CPU devices (``test_multidevice_suite`` re-runs this file with XLA_FLAGS set): the scheduler's
  real prefill/decode steps on data x expert and data x tensor x expert meshes give the one-device tokens,
  and logprobs within a stated tolerance; on a mesh, results are bitwise independent of slot and arrival
  order; the slots' state stays split over ``data`` and nothing recompiles after warm-up;
  ``LLM(..., mesh=...)`` places params and state by the rules.
* ``load_params`` with ``make_place``: a process that holds half of an ``expert=8`` mesh reads exactly its
  experts, its vocabulary / Engram rows and the replicated leaves, byte for byte (simulated in one process,
  and for real with two processes).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.sharding import make_mesh, tree_paths
from test_sharding import mesh_test_config, multidev, random_params, run_multidevice, run_two_processes


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_multidevice_suite():
    run_multidevice(__file__, "multidev_")


# ------------------------------------------------------------------------------------------------------
# The engine's memory check is the planner's (one device, nothing compiled)


def test_engine_memory_check_is_the_planner(tiny_ckpt, tiny_cfg):
    from deepinfer_jax import LLM
    from deepinfer_jax.engine.llm import check_memory, sampler_state_bytes
    from deepinfer_jax.planner import PlanError, plan_memory

    shape = dict(max_slots=4, max_len=64, chunk_size=8)
    plan = check_memory(tiny_cfg, 4, 64, Numerics.reference(), None, chunk_size=8)
    same = plan_memory(tiny_cfg, "data=1", 4, 64, "reference", step_tokens=8, head_tokens=1, sampler=True,
                       extra_per_slot_bytes=sampler_state_bytes(tiny_cfg))
    assert plan.total_bytes == same.total_bytes > plan.weight_bytes > 0
    llm = LLM(tiny_ckpt, **shape, device_memory=plan.total_bytes)  # exactly enough
    assert llm.memory_plan.total_bytes == plan.total_bytes
    with pytest.raises(PlanError, match=r"max_slots=4 x max_len=64 needs .* GiB per device on mesh "
                                        r"data=1,tensor=1,expert=1 .*; (\d+) slots fit at this max_len"):
        LLM(tiny_ckpt, **shape, device_memory=plan.total_bytes - 1)


# ------------------------------------------------------------------------------------------------------
# 8 simulated devices: the engine on meshes


class _StubTokenizer:
    """What the scheduler needs of a tokenizer, for the test model's 1,024-token vocabulary."""

    eos_id, bos_id, source = 2, 0, "stub"

    def valid_token_mask(self, vocab_size):
        return np.ones(vocab_size, bool)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


ENGINE = dict(max_slots=4, max_len=32, chunk_size=8)
PROMPT_LENS = (3, 11, 20, 7, 1, 14)  # 6 requests through 4 slots: admissions mid-run, 1-3 prefill chunks


def _requests():
    from deepinfer_jax.engine.sampling import SamplingParams
    from deepinfer_jax.engine.scheduler import Request

    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate(PROMPT_LENS):
        sp = SamplingParams(max_tokens=5, temperature=0.0 if i % 2 else 0.8, top_p=0.9 if i % 3 == 0 else 1.0,
                            seed=i, logprobs=3, ignore_eos=True)
        out.append(Request(str(i), [int(x) for x in rng.integers(3, 1000, n)], sp))
    return out


@pytest.fixture(scope="module")
def engine_model():
    cfg = mesh_test_config()
    return cfg, random_params(cfg), (np.arange(cfg.vocab_size) % 500).astype(np.int32)


def _results(reqs):
    return {r.request_id: (r.generated, r.logprobs, r.top_logprobs) for r in reqs}


def _run_engine(engine_model, mesh_spec, num=Numerics.exact()):
    """-> (results, results of the same requests in the reverse arrival order (other slots, other
    neighbours), compile count after the first run, after the second, the scheduler)."""
    from deepinfer_jax.engine.scheduler import EngineConfig, Scheduler
    from deepinfer_jax.parallel import ParallelContext
    from deepinfer_jax.parallel.engine import mesh_scheduler
    from deepinfer_jax.sharding import place_tree

    cfg, host, tmap = engine_model
    ec = EngineConfig(**ENGINE)
    if mesh_spec is None:
        sched = Scheduler(jax.device_put(host, jax.devices()[0]), cfg, _StubTokenizer(), tmap, num, ec)
    else:
        mesh = make_mesh(mesh_spec)
        sched = mesh_scheduler(place_tree(host, cfg, mesh), cfg, _StubTokenizer(), tmap, num, ec, ParallelContext(mesh))
    first = _results(sched.run(_requests()))
    after_one = sched.compile_count()
    second = _results(sched.run(_requests()[::-1]))
    return first, second, after_one, sched.compile_count(), sched


@pytest.fixture(scope="module")
def one_device_engine(engine_model):
    first, second, c1, c2, _ = _run_engine(engine_model, None)
    assert first == second and c1 == c2  # the engine's own batch invariance, as the baseline
    assert len({tuple(t) for t, _, _ in first.values()}) == len(first)  # not a constant model
    return first


def _state_is_split_over_data(sched):
    for key, value in sched.state.items():
        for path, leaf in tree_paths(value):
            assert tuple(leaf.sharding.spec)[:1] == ("data",), (key, path, leaf.sharding.spec)


# Exact numerics (fp32; the bf16 deployment numerics' forward is compared bitwise across meshes in
# test_sharding). On a mesh every cross-device step is fixed-order (ordered_sum, one-contributor expert
# combine, vocabulary gathered before the sampler), so on a given mesh a request's tokens and logprobs
# are bitwise the same in any arrival order and slot. Against one device they are not bitwise: data
# parallelism changes the local batch (2 or 1 rows instead of 4), XLA:CPU picks dot and reduction
# kernels by the local shape, and tensor parallelism splits wo_b's reduction into t partial sums, so
# logprobs move by fp32 round-off: measured <= 2e-6 nat here; the bound is 50x that, and below the
# 2e-4 of test_sharding's logits bound. Every sampled token (greedy and Gumbel-max) must agree.
LOGPROB_ATOL = 1e-4


@multidev
@pytest.mark.parametrize("mesh", ["data=2,expert=4", "data=2,tensor=2,expert=2"])
def test_multidev_engine_on_a_mesh_gives_the_one_device_results(mesh, engine_model, one_device_engine):
    ref = one_device_engine
    got, again, c1, c2, sched = _run_engine(engine_model, mesh)
    assert got == again, f"{mesh}: a request's results depend on its slot or neighbours"
    assert c1 == c2 == 6, (f"{mesh}: {c1} programs after the first run, {c2} after the second "
                           "(prefill lower + upper parts, decode, the sampler's pick with and without sampled rows, "
                           "its top-20)")
    _state_is_split_over_data(sched)
    for rid, (tokens, lps, tops) in ref.items():
        g_tokens, g_lps, g_tops = got[rid]
        assert g_tokens == tokens, (mesh, rid)
        np.testing.assert_allclose(g_lps, lps, atol=LOGPROB_ATOL, rtol=0, err_msg=f"{mesh} {rid}")
        for a, b in zip(g_tops, tops):
            assert list(a) == list(b), (mesh, rid)
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=LOGPROB_ATOL, rtol=0)


@multidev
def test_multidev_llm_places_params_and_state_by_the_rules(tiny_ckpt, tiny_cfg):
    from deepinfer_jax import LLM
    from deepinfer_jax.sharding import ShardingError

    llm = LLM(tiny_ckpt, max_slots=4, max_len=64, chunk_size=8, mesh="data=2,tensor=2,expert=2")
    w1 = llm.params["layers"][0]["ffn"]["experts"]["w1"]["weight"]
    assert w1.addressable_shards[0].data.shape[0] == tiny_cfg.n_routed_experts // 4
    wq_b = llm.params["layers"][0]["attn"]["wq_b"]["weight"]
    assert wq_b.addressable_shards[0].data.shape[0] == wq_b.shape[0] // 2
    _state_is_split_over_data(llm.scheduler)
    assert llm.manifest["mesh"] == "data=2,tensor=2,expert=2"
    one = LLM(tiny_ckpt, max_slots=4, max_len=64, chunk_size=8)
    # per device: half the slots' caches, a quarter of the experts and of the vocabulary
    assert llm.memory_plan.cache_bytes * 2 == one.memory_plan.cache_bytes
    assert llm.memory_plan.weight_bytes < one.memory_plan.weight_bytes / 3
    with pytest.raises(ShardingError, match="3 slots do not split"):
        LLM(tiny_ckpt, max_slots=3, max_len=64, chunk_size=8, mesh="data=2,tensor=2,expert=2")


# ------------------------------------------------------------------------------------------------------
# The loader reads only this host's shards


@pytest.fixture(scope="module")
def synthetic_ckpt(tmp_path_factory):
    from deepinfer_jax.checkpoint.loader import load_params
    from test_orbax import write_synthetic_checkpoint

    cfg = mesh_test_config()
    src = write_synthetic_checkpoint(cfg, tmp_path_factory.mktemp("src") / "ckpt")
    return cfg, src, jax.tree.map(np.asarray, load_params(src, cfg, place=lambda p, a: a, progress=False))


class _Recorder:
    """A MeshPlace for a simulated host: keeps each leaf's region and the host array read for it."""

    def __init__(self, inner):
        self.inner, self.got = inner, {}

    def region(self, path, shape):
        return self.inner.region(path, shape)

    def __call__(self, path, array, region=None, stored_shape=None):
        self.got[tuple(path)] = (region, np.asarray(array))
        return array


@multidev
def test_multidev_loader_reads_only_the_simulated_hosts_shards(synthetic_ckpt):
    from deepinfer_jax.checkpoint.loader import load_params
    from deepinfer_jax.sharding import make_place

    cfg, src, ref = synthetic_ckpt
    mesh = make_mesh("expert=8")
    host0 = list(mesh.devices.reshape(-1)[:4])  # process 0 of a 2-host run: experts 0-3, first half of rows
    rec = _Recorder(make_place(cfg, mesh, local_devices=host0))
    stats = {}
    load_params(src, cfg, place=rec, progress=False, stats=stats)
    full = {}
    load_params(src, cfg, place=lambda p, a: a, progress=False, stats=full)
    ref_leaves = dict(tree_paths(ref))
    for path, (region, arr) in rec.got.items():
        want = ref_leaves[path]
        if region is None:
            assert np.array_equal(arr.view(np.uint8), want.view(np.uint8)), path
            continue
        assert np.array_equal(arr.view(np.uint8), want[region].view(np.uint8)), path
        assert (region[0].start, region[0].stop) == _rows_of_process(want.shape[0], 0), (path, region)
        assert all(r == slice(0, n) for r, n in zip(region[1:], want.shape[1:])), (path, region)
    experts = rec.got[("layers", 1, "ffn", "experts", "w1", "weight")]
    assert experts[0][0] == slice(0, 4) and experts[1].shape[0] == 4
    assert rec.got[("embed", "weight")][0][0] == slice(0, cfg.vocab_size // 2)
    assert rec.got[("layers", 1, "attn", "wq_b", "weight")][0] is None  # replicated: read whole
    share, split, replicated = _share_of_two_hosts(ref, 0)
    assert stats["bytes_read"] == share, (stats["bytes_read"], share, split, replicated)
    assert full["bytes_read"] == split + replicated
    assert stats["tensors_read"] < full["tensors_read"]


# What one process of two must read on an expert=8 mesh, from the rules table alone. There the only
# split dims are those whose logical axis maps onto ``expert`` (routed experts, vocabulary rows, Engram
# rows: all dim 0), 4 of 8 devices per process; every other leaf is replicated and read whole. On this
# 5-layer test model the replicated leaves are 46% of the bytes (the fp32 mHC mixes alone are 49 KB a
# layer, the experts only 26 KB), so a process reads 0.73 of the checkpoint, not the ~0.5 that an
# earlier bound of 0.6 assumed; at V4.1-Flash size the split leaves are 98.6% and the share is 0.51.
def _rows_of_process(rows: int, process: int) -> tuple[int, int]:
    half = -(-rows // 8) * 4  # an Engram table is padded to a multiple of 8 rows; pad rows are never read
    return process * half, min(rows, (process + 1) * half)


def _share_of_two_hosts(ref, process: int) -> tuple[int, int, int]:
    """-> (bytes ``process`` must read, bytes of split leaves, bytes of replicated leaves)."""
    from deepinfer_jax.sharding import DEFAULT_RULES, logical_axes

    share = split = replicated = 0
    for path, leaf in tree_paths(ref):
        dims = [d for d, a in enumerate(logical_axes(path)) if "expert" in DEFAULT_RULES.mesh_axes(a)]
        assert dims in ([], [0]), (path, dims)
        if not dims:
            share, replicated = share + leaf.nbytes, replicated + leaf.nbytes
            continue
        lo, hi = _rows_of_process(leaf.shape[0], process)
        share, split = share + leaf.nbytes // leaf.shape[0] * (hi - lo), split + leaf.nbytes
    return share, split, replicated


# Two real processes of 4 CPU devices on an expert=8 mesh: each loads straight from the safetensors,
# reads only its half, and holds bitwise the right shards.
_CHILD = r"""
import json, sys
from deepinfer_jax.parallel.distributed import initialize_from_env
initialize_from_env()
import jax, numpy as np
from deepinfer_jax.checkpoint.loader import load_params
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.sharding import make_mesh, make_place
assert jax.process_count() == 2 and jax.local_device_count() == 4
cfg = ModelConfig.from_json(sys.argv[1])
stats, full = {}, {}
params = load_params(sys.argv[1], cfg, place=make_place(cfg, make_mesh("expert=8")), progress=False, stats=stats)
ref = load_params(sys.argv[1], cfg, place=lambda p, a: a, progress=False, stats=full)
bad = 0
for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    for s in a.addressable_shards:  # compare on the stored rows (pad rows of a padded table are never read)
        idx = tuple(slice(i.start or 0, min(b.shape[d], i.stop if i.stop is not None else a.shape[d]))
                    for d, i in enumerate(s.index))
        got = np.asarray(s.data)[tuple(slice(0, max(0, x.stop - x.start)) for x in idx)]
        bad += not np.array_equal(got.view(np.uint8), b[idx].view(np.uint8))
print(json.dumps({"read": stats["bytes_read"], "full": full["bytes_read"], "bad_shards": bad}))
"""


def test_two_processes_load_only_their_shards_from_safetensors(synthetic_ckpt):
    cfg, src, ref = synthetic_ckpt
    results = run_two_processes(_CHILD, src)
    for process, r in enumerate(results):
        assert r["bad_shards"] == 0, r
        assert r["read"] == _share_of_two_hosts(ref, process)[0], (process, r)
    # together: every split byte read once, every replicated byte once per process
    _, split, replicated = _share_of_two_hosts(ref, 0)
    assert sum(r["read"] for r in results) == split + 2 * replicated


# ------------------------------------------------------------------------------------------------------
# Generation across two processes

# Each of two processes drives 2 CPU devices of a data=2,expert=2 mesh; ``data`` is the outer axis, so it
# crosses the processes and each one holds half of the slots. Both run the same requests through the same
# scheduler loop, which needs every slot's sampled token on every process (stop rules, admissions).
_GENERATE_CHILD = r"""
import json, sys
from deepinfer_jax.parallel.distributed import initialize_from_env
initialize_from_env()
import json

import jax
from deepinfer_jax import LLM, SamplingParams
assert jax.process_count() == 2 and jax.local_device_count() == 2
prompts, params, engine = json.loads(sys.argv[1])
llm = LLM("checkpoints/tiny-v41", **engine, mesh="data=2,expert=2")
# the slots' state is split across the processes: what the host reads back must be gathered for it
assert not llm.scheduler.state["next_token"].is_fully_addressable
outs = llm.generate(prompts, [SamplingParams(**p) for p in params])
print(json.dumps({"process": jax.process_index(), "results": [
    [o.token_ids, o.logprobs, [sorted(t.items()) for t in o.top_logprobs], o.prompt_logprobs, o.finish_reason, o.text]
    for o in outs]}))
"""

# exact (fp32) numerics: the gather is what is tested, and they compile in 2/3 of the time of the
# deployment numerics (whose mesh results test_sharding compares)
GENERATE_ENGINE = dict(max_slots=4, max_len=64, chunk_size=8, numerics="exact")
GENERATE_PROMPTS = ["The sea is", "Hello there, how", "One two three four five six seven eight nine ten eleven",
                    "a", "Write a poem", "Once upon a time"]  # 6 requests through 4 slots: admissions mid-run
GENERATE_PARAMS = [dict(max_tokens=6, temperature=0.0 if i % 2 else 0.8, top_p=0.9 if i % 3 == 0 else 1.0, seed=i,
                        logprobs=2, prompt_logprobs=i == 2) for i in range(len(GENERATE_PROMPTS))]
# a stop that depends on the sampled value: 1154 is the 3rd token of request 1's greedy output (measured)
GENERATE_PARAMS[1]["stop_token_ids"] = [1154]


@pytest.mark.slow  # ~100 s on 2 cores: two processes compiling the tiny model's steps, then one device
def test_two_processes_generate_the_one_device_tokens():
    from deepinfer_jax import LLM, SamplingParams

    got = run_two_processes(_GENERATE_CHILD, json.dumps([GENERATE_PROMPTS, GENERATE_PARAMS, GENERATE_ENGINE]),
                            devices=2, timeout=300)
    llm = LLM("checkpoints/tiny-v41", **GENERATE_ENGINE)
    ref = llm.generate(GENERATE_PROMPTS, [SamplingParams(**p) for p in GENERATE_PARAMS])
    # the value-dependent stop happens (the model still samples 1154 there): both processes must see it,
    # or they would disagree on when the slot frees and which request it admits next
    assert (ref[1].finish_reason, len(ref[1].token_ids)) == ("stop", 3), ref[1].token_ids
    assert got[0]["results"] == got[1]["results"]  # both processes read the same (replicated) values
    for o, (tokens, lps, tops, plps, finish, text) in zip(ref, got[0]["results"]):
        assert (tokens, finish, text) == (o.token_ids, o.finish_reason, o.text), o.request_id
        # Not bitwise: XLA:CPU picks its kernels by the local batch (2 slots per device instead of 4), so
        # logprobs move by fp32 round-off (measured <= 2.9e-6 nat); the 8-device engine test's bound.
        np.testing.assert_allclose(lps, o.logprobs, atol=LOGPROB_ATOL, rtol=0)
        for t, want in zip(tops, o.top_logprobs):
            assert [i for i, _ in t] == sorted(want), o.request_id
            np.testing.assert_allclose([v for _, v in t], [want[i] for i in sorted(want)], atol=LOGPROB_ATOL, rtol=0)
        assert (plps is None) == (o.prompt_logprobs is None), o.request_id
        if plps is not None:  # asked for by one request; the first prompt token has no context: None
            assert len(plps) == len(o.prompt_logprobs) and plps[0] is None and o.prompt_logprobs[0] is None
            np.testing.assert_allclose(plps[1:], o.prompt_logprobs[1:], atol=LOGPROB_ATOL, rtol=0)
