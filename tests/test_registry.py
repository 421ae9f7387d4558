"""Kernel registry: automatic choice per platform, explicit overrides (impl=, KernelSelection,
DEEPINFER_KERNELS), clear errors for a kernel requested where it cannot run, and that the forced paths
of grouped_matmul compute the same function."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.registry import (PALLAS_MOSAIC_GPU, REFERENCE, REGISTRY, XLA, KernelSelection,
                                     KernelUnavailableError, resolve)


@dataclasses.dataclass
class _FakeDevice:
    """Enough of a jax Device for the registry's checks."""

    platform: str
    compute_capability: str | None = None
    device_kind: str = "fake"


def test_automatic_choice_per_platform():
    assert resolve("grouped_matmul", platform="cpu").name == XLA
    assert resolve("grouped_matmul", platform="npu").name == XLA          # e.g. an Ascend PJRT plugin
    assert resolve("grouped_matmul", platform="never-heard-of-it").name == XLA
    assert resolve("grouped_matmul", platform="tpu").name == XLA
    assert resolve("grouped_matmul", device=_FakeDevice("gpu", "9.0")).name == PALLAS_MOSAIC_GPU
    # A CUDA GPU that is not Hopper gets the portable path, not a kernel that cannot run on it.
    assert resolve("grouped_matmul", device=_FakeDevice("gpu", "8.0")).name == XLA
    assert resolve("grouped_matmul").name == (PALLAS_MOSAIC_GPU if _on_hopper() else XLA)
    assert resolve("topk_indices", platform="cuda").name == XLA           # no kernel registered
    # The reference is never picked automatically.
    assert all(resolve(op, platform=p).name != REFERENCE for op in REGISTRY for p in ("cpu", "cuda", "npu"))


def _on_hopper() -> bool:
    d = jax.devices()[0]
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


def test_requesting_a_kernel_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(KernelUnavailableError, match=r"'pallas_mosaic_gpu' was requested but it runs on "
                                                     r"\['cuda'\], not on platform 'npu'"):
        resolve("grouped_matmul", impl=PALLAS_MOSAIC_GPU, platform="npu")
    with pytest.raises(KernelUnavailableError, match="compute capability 9.x GPU"):
        resolve("grouped_matmul", impl=PALLAS_MOSAIC_GPU, device=_FakeDevice("gpu", "8.6"))
    with pytest.raises(KernelUnavailableError, match="not on platform 'cpu'"):
        resolve("grouped_matmul", selection=KernelSelection(default=PALLAS_MOSAIC_GPU), platform="cpu")
    # The explicit portable choices run anywhere.
    assert resolve("grouped_matmul", impl=XLA, device=_FakeDevice("gpu", "9.0")).name == XLA
    assert resolve("grouped_matmul", impl=REFERENCE, platform="npu").name == REFERENCE


def test_unknown_names_are_errors_that_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown op 'matmul'; known: \["):
        resolve("matmul", platform="cpu")
    with pytest.raises(ValueError, match=r"no implementation 'triton'; known: \['pallas_mosaic_gpu', 'xla'"):
        resolve("grouped_matmul", impl="triton", platform="cpu")
    with pytest.raises(ValueError, match="unknown op 'gemm'"):
        KernelSelection(per_op=(("gemm", XLA),))
    with pytest.raises(ValueError, match="no implementation 'fast'"):
        KernelSelection(per_op=(("grouped_matmul", "fast"),))


def test_selection_parsing_and_precedence():
    sel = KernelSelection.parse("xla, grouped_matmul=reference")
    assert sel == KernelSelection(default=XLA, per_op=(("grouped_matmul", REFERENCE),))
    assert sel.impl_for("grouped_matmul") == REFERENCE and sel.impl_for("topk_indices") == XLA
    assert KernelSelection.parse("") == registry.AUTO
    # A default the op has no implementation of leaves that op automatic.
    assert KernelSelection(default=PALLAS_MOSAIC_GPU).impl_for("topk_indices") is None
    assert resolve("topk_indices", selection=KernelSelection(default=PALLAS_MOSAIC_GPU), platform="cuda").name == XLA
    hash(sel)                                              # usable as a static jit argument
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.default = PALLAS_MOSAIC_GPU                    # type: ignore[misc]
    # impl= beats the selection.
    assert resolve("grouped_matmul", impl=XLA, selection=sel, platform="cpu").name == XLA
    assert resolve("grouped_matmul", selection=sel, platform="cpu").name == REFERENCE


def test_selection_from_env():
    assert KernelSelection.from_env({"DEEPINFER_KERNELS": "xla"}).default == XLA
    assert KernelSelection.from_env({}) == registry.AUTO
    with pytest.raises(ValueError, match="bad DEEPINFER_KERNELS='xla,reference': two defaults"):
        KernelSelection.from_env({"DEEPINFER_KERNELS": "xla,reference"})
    with pytest.raises(ValueError, match="bad DEEPINFER_KERNELS='grouped_matmul=cuda'"):
        KernelSelection.from_env({"DEEPINFER_KERNELS": "grouped_matmul=cuda"})
    with pytest.raises(ValueError, match="bad DEEPINFER_KERNELS='fast'.*no implementation of any op"):
        KernelSelection.from_env({"DEEPINFER_KERNELS": "fast"})


def test_registry_table_is_immutable_and_every_target_imports():
    with pytest.raises(TypeError):
        REGISTRY["grouped_matmul"] = None                  # type: ignore[index]
    for spec in REGISTRY.values():
        assert spec.impls[-1].name == REFERENCE or spec.impls[-1].platforms is None
        for impl in spec.impls:
            assert callable(impl.load()), impl.target


def test_platform_names():
    assert registry.platform_name(_FakeDevice("cpu")) == "cpu"
    assert registry.platform_name(_FakeDevice("gpu", "9.0")) == "cuda"
    assert registry.platform_name(jax.devices()[0]) in ("cpu", "cuda", "rocm", "tpu")
    x = jnp.ones(3)
    assert registry.device_of(x) == x.devices().pop()
    # Under jit the array is a tracer: the registry falls back to the default device.
    jax.jit(lambda v: (registry.device_of(v) == jax.devices()[0]) or v)(x)


# ---- forced paths of the op agree ----------------------------------------------------------------------

def _problem():
    rng = np.random.default_rng(0)
    g, n, k, m = 4, 32, 64, 19
    w = jnp.asarray(rng.integers(0, 256, (g, n, k // 2)), jnp.uint8)
    s = jnp.asarray(rng.integers(125, 129, (g, n, k // 32)), jnp.uint8)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = jnp.asarray(rng.integers(-1, g, m), jnp.int32)
    return x, w, gid, s


def test_forced_paths_of_grouped_matmul_agree(monkeypatch):
    from pallas_kernels.grouped_gemm import grouped_matmul, grouped_matmul_xla

    x, w, gid, s = _problem()
    ref = np.asarray(grouped_matmul(x, w, gid, s, impl=REFERENCE, out_dtype=jnp.float32))
    xla = np.asarray(grouped_matmul(x, w, gid, s, impl=XLA, out_dtype=jnp.float32))
    # Same exact bf16 operands, float32 sums in another order.
    np.testing.assert_allclose(xla, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    auto = grouped_matmul(x, w, gid, s, out_dtype=jnp.float32)
    if not _on_hopper():                                   # on CPU the automatic choice is the XLA path
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(grouped_matmul_xla(x, w, gid, s,
                                                                                      out_dtype=jnp.float32)))
    monkeypatch.setenv("DEEPINFER_KERNELS", "grouped_matmul=reference")
    np.testing.assert_array_equal(np.asarray(grouped_matmul(x, w, gid, s, out_dtype=jnp.float32)), ref)
    if not _on_hopper():
        monkeypatch.setenv("DEEPINFER_KERNELS", "pallas_mosaic_gpu")
        with pytest.raises(KernelUnavailableError, match="'pallas_mosaic_gpu' was requested"):
            grouped_matmul(x, w, gid, s)
        with pytest.raises(KernelUnavailableError, match="'pallas_mosaic_gpu' was requested"):
            grouped_matmul(x, w, gid, s, impl=PALLAS_MOSAIC_GPU)
