"""The Sinkhorn-rounds op (pallas_kernels/sinkhorn): the XLA forms and the Mosaic GPU kernel (run on the
CPU by the Mosaic GPU interpreter) against the float64 oracle, the kernel's batch invariance (bitwise),
its CUDA lowering at the slice's decode and prefill sizes, and the registry's choice."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.interpret import gpu_interpreter, races_found
from pallas_kernels.sinkhorn import (SinkhornConfig, kernel_unsupported_reason, sinkhorn_rounds,
                                     sinkhorn_rounds_reference, sinkhorn_rounds_xla)
from pallas_kernels.sinkhorn.reference import example_comb

ROUNDS, EPS = 19, 1e-6      # V4's hc_sinkhorn_iters = 20: one column normalization, then 19 rounds
# Entries lie in [0, 1]. A round is a contraction, so rounding errors do not build up over rounds: the
# paths measured 1.5-1.7 ulp of 1.0 from the float64 oracle (4-entry sums, then a division). 1e-6 is
# ~8 ulp of 1.0: room for another summation order, not for a wrong round or a wrong entry.
TOL = 1e-6


def _comb(seed: int, *lead: int) -> jax.Array:
    return jnp.asarray(example_comb(seed, *lead, eps=EPS))


def _kernel(comb, config=SinkhornConfig(), detect_races=False):
    from pallas_kernels.sinkhorn.kernel import sinkhorn_rounds_pallas

    with gpu_interpreter(detect_races=detect_races):
        return np.asarray(jax.block_until_ready(sinkhorn_rounds_pallas(comb, rounds=ROUNDS, eps=EPS,
                                                                        config=config)))


@pytest.mark.parametrize("form", ["segments", "one_chain", "loop"])
def test_xla_forms_match_the_float64_rounds(form):
    comb = _comb(0, 3, 50)
    kw = dict(segments={}, one_chain=dict(segment=None), loop=dict(unroll=False))[form]
    out = np.asarray(jax.jit(lambda c: sinkhorn_rounds_xla(c, rounds=ROUNDS, eps=EPS, **kw))(comb))
    ref = sinkhorn_rounds_reference(comb, rounds=ROUNDS, eps=EPS)
    assert np.abs(out - ref).max() < TOL
    # a round ends on columns: they sum to 1 (less eps); rows are near 1 after 19 rounds, not there
    # (these logits, 3 x a standard normal, leave them up to ~3 % off)
    assert np.abs(ref.sum(-2) - 1).max() < 1e-5 and np.abs(ref.sum(-1) - 1).max() < 5e-2


def test_kernel_matches_the_float64_rounds_and_its_own_order_of_operations():
    from pallas_kernels.sinkhorn.kernel import rounds_on_entries

    comb = _comb(1, 2, 100)                         # 200 matrices: two CTAs, the second one part padding
    out = _kernel(comb, detect_races=True)
    assert not races_found()
    assert np.abs(out - sinkhorn_rounds_reference(comb, rounds=ROUNDS, eps=EPS)).max() < TOL
    # the kernel's order of operations, replayed op by op in numpy float32 (the interpreter runs the
    # body through XLA:CPU, whose fused division may round differently, so a few ulps, not bits)
    c = np.asarray(comb)
    mirror = rounds_on_entries([[c[..., i, j] for j in range(4)] for i in range(4)], ROUNDS, np.float32(EPS))
    assert np.abs(out - np.stack([np.stack(row, -1) for row in mirror], -2)).max() < 4 * np.finfo(np.float32).eps


def test_kernel_is_batch_invariant_and_config_free():
    """A matrix's result depends on nothing else in the call: the same bits in a batch of another size
    (other padding, another CTA and thread) and at another block size."""
    comb = _comb(2, 300)
    full = _kernel(comb)
    assert np.array_equal(_kernel(comb[130:190]), full[130:190])
    assert np.array_equal(_kernel(comb, SinkhornConfig(block_rows=256)), full)


@pytest.mark.parametrize("rows", [64, 4096])
def test_kernel_lowers_for_cuda_at_the_slices_sizes(rows):
    """B = 64 decode rows and a 4096-token prefill chunk: Mosaic GPU's lowering checks layouts and TMA
    shapes without a GPU."""
    from pallas_kernels.sinkhorn.kernel import sinkhorn_rounds_pallas

    comb = jax.ShapeDtypeStruct((rows, 1, 4, 4), jnp.float32)
    lowered = jax.jit(lambda c: sinkhorn_rounds_pallas(c, rounds=ROUNDS, eps=EPS)).trace(comb).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_op_dispatch_and_unsupported_shapes():
    from pallas_kernels.registry import resolve

    comb = _comb(3, 5)
    want = np.asarray(sinkhorn_rounds_xla(comb, rounds=ROUNDS, eps=EPS))
    assert np.array_equal(np.asarray(sinkhorn_rounds(comb, rounds=ROUNDS, eps=EPS)), want)     # CPU: XLA
    assert resolve("sinkhorn_rounds", platform="cuda").name == "pallas_mosaic_gpu"
    assert resolve("sinkhorn_rounds", platform="cpu").name == "xla"
    assert kernel_unsupported_reason(4) is None and "hc=9" in kernel_unsupported_reason(9)
    with pytest.raises(ValueError, match="block_rows"):
        SinkhornConfig(block_rows=96)
