"""Expert parallelism: the shard_map routed experts are bitwise the single-device gather path on every
mesh, in both numerics, with both combines, for adversarial routings; the combine is an all-gather
summed in device order (no all-reduce in the compiled program), and that order is observable."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from deepinfer_jax.model.moe import moe, routed_experts_gather
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.parallel import ParallelContext
from deepinfer_jax.parallel.collectives import ordered_sum
from deepinfer_jax.parallel.moe_ep import routed_experts_ep
from deepinfer_jax.sharding import make_mesh, place_tree
from test_sharding import _bits, mesh_test_config, multidev, random_params, run_multidevice

M, K = 16, 2  # tokens (split over data up to 8) and experts per token


@pytest.fixture(scope="module")
def moe_case():
    cfg = mesh_test_config()
    p_ffn = random_params(cfg)["layers"][0]["ffn"]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(M, cfg.hidden_size)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, size=(M, K)).astype(np.float32)
    e = cfg.n_routed_experts
    routings = {
        "random": np.stack([rng.permutation(e)[:K] for _ in range(M)]).astype(np.int32),
        "one_hot_pair": np.tile(np.array([[0, e - 1]], np.int32), (M, 1)),  # every token on the same two experts
        "same_expert_shard": np.tile(np.array([[1, 0]], np.int32), (M, 1)),  # both ranks on one device
    }
    return cfg, p_ffn, x, w, routings


def _single(p_exp, x, ids, w, cfg, num):
    f = jax.jit(lambda p, x, i, w: routed_experts_gather(p, x, i, w, cfg.swiglu_limit, num, cfg.act_quant_block))
    return np.asarray(f(p_exp, x.astype(num.dtype), ids, w))


def _ep(mesh, p_exp, x, ids, w, cfg, num, combine="gather"):
    f = jax.jit(lambda p, x, i, w: routed_experts_ep(p, x, i, w, cfg.swiglu_limit, num, cfg.act_quant_block,
                                                     mesh=mesh, combine=combine))
    return f, np.asarray(f(p_exp, x.astype(num.dtype), ids, w))


def test_one_device_mesh_is_the_gather_path(moe_case):
    cfg, p_ffn, x, w, routings = moe_case
    num = Numerics.reference()
    mesh = make_mesh("data=1")
    ref = _single(p_ffn["experts"], x, routings["random"], w, cfg, num)
    _, out = _ep(mesh, place_tree({"layers": ({"ffn": p_ffn},)}, None, mesh)["layers"][0]["ffn"]["experts"], x,
                 routings["random"], w, cfg, num)
    assert out.dtype == ref.dtype and np.array_equal(_bits(out), _bits(ref))


def test_bad_combine_is_refused(moe_case):
    cfg, p_ffn, x, w, routings = moe_case
    with pytest.raises(ValueError, match="combine must be"):
        routed_experts_ep(p_ffn["experts"], x, routings["random"], w, 10.0, Numerics.exact(), 32,
                          mesh=make_mesh("data=1"), combine="tree")


@pytest.mark.slow   # 0.5-3 min on CI's 2 cores: .ci/run runs it after the default suite
def test_multidevice_suite():
    run_multidevice(__file__, "multidev_")


@multidev
def test_multidev_ordered_sum_adds_in_device_order():
    """fp32 addition is not associative: 1e8 + 1 rounds back to 1e8. The index-order sum of these eight
    device values is ((((((1e8 + 1) - 1e8) + 1) + ...)); a different order (e.g. reversed) gives another
    number, so this test would catch a combine that let the runtime pick the order."""
    vals = np.array([1e8, 1.0, -1e8, 1.0, 0.5, 3.0, -7.0, 0.25], np.float32)
    expect = np.float32(0)
    for v in vals:
        expect = np.float32(expect + v)
    reverse = np.float32(0)
    for v in vals[::-1]:
        reverse = np.float32(reverse + v)
    assert expect != reverse  # the order is observable with these values
    mesh = make_mesh("tensor=2,expert=4")
    f = jax.jit(jax.shard_map(lambda v: ordered_sum(v, ("tensor", "expert")), mesh=mesh,
                              in_specs=P(("tensor", "expert")), out_specs=P()))
    assert np.asarray(f(jnp.asarray(vals)))[0] == expect


@multidev
@pytest.mark.parametrize("mesh,combines", [("expert=8", ("gather",)), ("tensor=2,expert=4", ("gather", "psum")),
                                           ("data=2,expert=4", ("gather",)), ("data=8", ("gather", "psum"))])
@pytest.mark.parametrize("numerics", ["reference", "exact"])
def test_multidev_ep_is_bitwise_the_single_device_path(mesh, combines, numerics, moe_case):
    cfg, p_ffn, x, w, routings = moe_case
    num = Numerics.reference() if numerics == "reference" else Numerics.exact()
    m = make_mesh(mesh)
    p_exp = place_tree({"layers": ({"ffn": p_ffn},)}, cfg, m)["layers"][0]["ffn"]["experts"]
    for name, ids in routings.items():
        ref = _single(p_ffn["experts"], x, ids, w, cfg, num)
        assert np.abs(ref).max() > 0.1, name
        for combine in combines:
            _, out = _ep(m, p_exp, x, ids, w, cfg, num, combine)
            assert out.dtype == ref.dtype and np.array_equal(_bits(out), _bits(ref)), (
                mesh, name, combine, np.abs(out.astype(np.float32) - ref.astype(np.float32)).max())


@multidev
def test_multidev_combine_is_an_all_gather_not_an_all_reduce(moe_case):
    cfg, p_ffn, x, w, routings = moe_case
    num = Numerics.exact()
    m = make_mesh("tensor=2,expert=4")
    p_exp = place_tree({"layers": ({"ffn": p_ffn},)}, cfg, m)["layers"][0]["ffn"]["experts"]
    args = (p_exp, x, routings["random"], w)
    hlo = {c: _ep(m, *args, cfg, num, c)[0].lower(*args).compile().as_text() for c in ("gather", "psum")}
    assert "all-gather" in hlo["gather"] and "all-reduce" not in hlo["gather"]
    assert "all-reduce" in hlo["psum"]  # negative control: the check sees a psum when there is one


@multidev
def test_multidev_moe_hook_and_unquantized_experts(moe_case):
    """moe(..., experts_impl=ctx.routed_experts) == moe(...) bitwise, also with BF16 (scale-less) experts."""
    cfg, p_ffn, x, w, routings = moe_case
    num = Numerics.reference()
    mesh = make_mesh("data=2,tensor=2,expert=2")
    ctx = ParallelContext(mesh)
    x_btd = x.reshape(2, M // 2, -1)
    plain = dict(p_ffn, experts={k: {"weight": (np.asarray(routed_deq(v), np.float32)).astype(jnp.bfloat16)}
                                 for k, v in p_ffn["experts"].items()})
    for p in (p_ffn, plain):
        ref = np.asarray(jax.jit(lambda p, x: moe(p, cfg, x, num))(p, x_btd))
        placed = place_tree({"layers": ({"ffn": p},)}, cfg, mesh)["layers"][0]["ffn"]
        out = np.asarray(jax.jit(lambda p, x: moe(p, cfg, x, num, experts_impl=ctx.routed_experts))(placed, x_btd))
        assert np.array_equal(np.asarray(out, np.float32).view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))


def routed_deq(p_lin):
    from deepinfer_jax.model.linear import dequant_fp4

    return dequant_fp4(jnp.asarray(p_lin["weight"]), jnp.asarray(p_lin["scale"]))
