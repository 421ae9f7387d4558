"""Platform detection, the Ascend start-up switches, and kernel dispatch on platforms this CPU box is not:
an unknown platform falls back to XLA with a log line, forcing a Pallas kernel there is an error naming
the platform and the choices, and a CANN-style FFI target registered through ``register_cann_kernel``
is what the op then runs (exercised on the CPU with a compiled stand-in handler). Nothing here touches
Ascend hardware (docs/ASCEND.md)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from deepinfer_jax import platform as P
from pallas_kernels import registry
from pallas_kernels.registry import PALLAS_MOSAIC_GPU, XLA, KernelUnavailableError, resolve

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_log_memory(monkeypatch):
    """The registry logs each (op, platform) once per process; give each test its own memory of that."""
    monkeypatch.setattr(registry, "_logged_unknown", set())


@pytest.fixture
def seen_platform(monkeypatch, fresh_log_memory):
    """Make the registry see the default device as a given platform (what a PJRT plugin would report)."""
    def set_platform(name: str):
        monkeypatch.setattr(registry, "platform_name", lambda device: registry.canonical_platform(name))
    return set_platform


def _gmm_problem():
    rng = np.random.default_rng(1)
    g, n, k, m = 3, 32, 64, 11
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gid = jnp.asarray(rng.integers(0, g, m), jnp.int32)
    return x, w, gid


# ---- dispatch on platforms other than this one ------------------------------------------------------------

@pytest.mark.parametrize("name", ["weirdchip", "npu", "ascend"])
def test_op_on_another_platform_runs_the_xla_path(name, seen_platform, caplog):
    from pallas_kernels.grouped_gemm import grouped_matmul, grouped_matmul_xla

    seen_platform(name)
    x, w, gid = _gmm_problem()
    with caplog.at_level(logging.INFO, logger="pallas_kernels.registry"):
        y = grouped_matmul(x, w, gid, out_dtype=jnp.float32)
        grouped_matmul(x, w, gid, out_dtype=jnp.float32)            # a second call logs nothing new
    np.testing.assert_array_equal(np.asarray(y), np.asarray(grouped_matmul_xla(x, w, gid, out_dtype=jnp.float32)))
    lines = [r for r in caplog.records if r.name == "pallas_kernels.registry"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    if name == "weirdchip":
        assert lines[0].levelno == logging.WARNING
        assert "platform 'weirdchip' is not one the kernel registry knows" in msg and "portable 'xla'" in msg
    else:                                  # "ascend" and "npu" are one platform, known, without a kernel
        assert lines[0].levelno == logging.INFO
        assert "no kernel registered for platform 'npu'" in msg and "register_cann_kernel" in msg


@pytest.mark.parametrize("name", ["weirdchip", "npu"])
def test_forcing_pallas_on_another_platform_names_the_platform_and_the_choices(name, seen_platform, monkeypatch):
    from pallas_kernels.grouped_gemm import grouped_matmul

    seen_platform(name)
    x, w, gid = _gmm_problem()
    want = (rf"grouped_matmul: implementation 'pallas_mosaic_gpu' was requested but it runs on \['cuda'\], "
            rf"not on platform '{name}'; on platform '{name}' you can choose \['xla', 'reference'\]")
    with pytest.raises(KernelUnavailableError, match=want):
        grouped_matmul(x, w, gid, impl=PALLAS_MOSAIC_GPU)
    monkeypatch.setenv("DEEPINFER_KERNELS", "pallas_mosaic_gpu")
    with pytest.raises(KernelUnavailableError, match=want):
        grouped_matmul(x, w, gid)
    with pytest.raises(KernelUnavailableError, match=rf"sparse_sink_attention: .* not on platform '{name}'"):
        resolve("sparse_sink_attention", impl=PALLAS_MOSAIC_GPU, platform=name)


def test_platform_aliases_and_device_names():
    assert registry.canonical_platform("Ascend") == "npu" and registry.canonical_platform("npu") == "npu"
    assert registry.canonical_platform("weirdchip") == "weirdchip"

    class Dev:
        platform = "ascend"
    assert registry.platform_name(Dev()) == "npu"
    assert resolve("grouped_matmul", platform="ascend").name == XLA


# ---- registering a CANN operator (FFI) ----------------------------------------------------------------------

def test_registered_kernel_is_preferred_only_on_its_platform():
    reg = P.register_cann_kernel("topk_indices", "deepinfer_test_never_called")   # npu; no handler needed
    try:
        assert resolve("topk_indices", platform="npu").name == "cann_ffi"
        assert resolve("topk_indices", platform="ascend").name == "cann_ffi"
        assert resolve("topk_indices", platform="cpu").name == XLA
        assert resolve("grouped_matmul", platform="npu").name == XLA           # other ops unaffected
        with pytest.raises(KernelUnavailableError, match=r"'cann_ffi' was requested but it runs on \['npu'\], "
                                                         r"not on platform 'cpu'; on platform 'cpu' you can "
                                                         r"choose \['xla', 'reference'\]"):
            resolve("topk_indices", impl="cann_ffi", platform="cpu")
        # selectable by name like a built-in one
        assert registry.KernelSelection.parse("topk_indices=cann_ffi").impl_for("topk_indices") == "cann_ffi"
        with pytest.raises(ValueError, match="already registered"):
            P.register_cann_kernel("topk_indices", "other_target")
    finally:
        reg.unregister()
    assert resolve("topk_indices", platform="npu").name == XLA
    with pytest.raises(ValueError, match="no implementation 'cann_ffi'"):
        resolve("topk_indices", impl="cann_ffi", platform="npu")


def test_registration_errors():
    with pytest.raises(ValueError, match=r"ops with an FFI binding: \['grouped_matmul'"):
        P.register_cann_kernel("matmul", "t")
    with pytest.raises(ValueError, match="built-in implementation name"):
        P.register_cann_kernel("topk_indices", "t", name=XLA)
    with pytest.raises(ValueError, match="must name the platforms"):
        registry.register_impl("topk_indices", registry.Impl("mine", lambda s, k: s))


@pytest.fixture(scope="module")
def fake_cann_library(tmp_path_factory):
    """tests/fixtures/fake_cann_topk.cc built against jaxlib's FFI headers (about 7 s)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in FFI handler")
    out = tmp_path_factory.mktemp("ffi") / "libfake_cann_topk.so"
    subprocess.run([cxx, "-O1", "-w", "-std=c++17", "-shared", "-fPIC", "-I", jax.ffi.include_dir(),
                    str(ROOT / "tests" / "fixtures" / "fake_cann_topk.cc"), "-o", str(out)], check=True)
    return ctypes.cdll.LoadLibrary(str(out))


def test_ffi_target_runs_through_the_op(fake_cann_library):
    """The stand-in is registered for the CPU as a CANN kernel would be for the npu: the op's automatic
    choice becomes the FFI call (checked in the lowered program), and its result equals the XLA path bit
    for bit, eagerly and under jit (it would not, were operands, the k attribute or the result misrouted)."""
    from pallas_kernels.topk import topk_indices

    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 5, 37)).astype(np.float32)
    s[0, 1, ::3] = -np.inf                              # unreachable entries -> -1
    s[1, 2, :] = np.round(s[1, 2, :])                   # many ties -> lower index wins
    s[1, 4, 4:] = -np.inf                               # fewer reachable than k
    scores = jnp.asarray(s)
    k = 6
    target = "deepinfer_test_fake_cann_topk"
    reg = P.register_cann_kernel("topk_indices", target, jax.ffi.pycapsule(fake_cann_library.FakeCannTopk),
                                 platform="cpu", name="fake_cann")
    try:
        assert resolve("topk_indices").name == "fake_cann"
        hlo = jax.jit(lambda x: topk_indices(x, k)).lower(scores).as_text()
        assert target in hlo
        via_ffi = np.asarray(topk_indices(scores, k))
        jitted = np.asarray(jax.jit(lambda x: topk_indices(x, k))(scores))
    finally:
        reg.unregister()
    xla = np.asarray(topk_indices(scores, k, impl=XLA))
    assert target not in jax.jit(lambda x: topk_indices(x, k)).lower(scores).as_text()   # back to XLA
    np.testing.assert_array_equal(via_ffi, xla)
    np.testing.assert_array_equal(jitted, xla)
    assert (xla[0, 1] >= 0).all() and (xla[1, 4] == -1).sum() == 2   # the cases above are exercised


# ---- detection ------------------------------------------------------------------------------------------------

def test_find_plugins_sees_namespace_modules_and_the_env_list(tmp_path, monkeypatch):
    (tmp_path / "jax_plugins" / "npu_fake").mkdir(parents=True)
    (tmp_path / "jax_plugins" / "npu_fake" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = P.find_pjrt_plugins({"PJRT_NAMES_AND_LIBRARY_PATHS": "mychip:/opt/x/libmychip.so,npu:/opt/y/pjrt.so"})
    names = {(p.name, p.source) for p in found}
    assert ("npu_fake", "jax_plugins module") in names          # found without importing it (it raises)
    assert ("mychip", "PJRT_NAMES_AND_LIBRARY_PATHS") in names and ("npu", "PJRT_NAMES_AND_LIBRARY_PATHS") in names
    assert [p.looks_like_ascend for p in found if p.name in ("mychip", "npu", "npu_fake")].count(True) == 2
    info = P.detect(environ={"JAX_PLATFORMS": "npu,cpu"})
    assert info.jax_platforms == "npu,cpu" and info.ascend_plugin_installed
    assert "npu_fake (jax_plugins module)" in info.summary()


def test_detect_on_this_machine():
    info = P.detect(start_backend=True)
    assert info.backend_initialized and info.platform == registry.platform_name(jax.devices()[0])
    assert not info.on_ascend and info.device_count == len(jax.devices())


# ---- start-up switches ---------------------------------------------------------------------------------------

def test_switches_refuse_once_the_backend_is_up():
    jax.devices()
    with pytest.raises(RuntimeError, match="must run before JAX starts its backends"):
        P.apply_ascend_determinism("batch_invariant", environ={})
    with pytest.raises(RuntimeError, match="select_platforms must run before"):
        P.select_platforms("npu,cpu", environ={})


@pytest.fixture
def backend_not_started(monkeypatch):
    monkeypatch.setattr(P, "backends_initialized", lambda: False)


def test_determinism_switches_set_and_report(backend_not_started):
    env = {"HCCL_DETERMINISTIC": "false"}                       # the user's own setting is kept...
    sw = P.apply_ascend_determinism("batch_invariant", environ=env)
    assert sw.level == 3 and sw.create_options == {"acl_opt_deterministic": 3}
    assert env == {"HCCL_DETERMINISTIC": "false", "LCCL_DETERMINISTIC": "1"}
    assert sw.env_set == {"LCCL_DETERMINISTIC": "1"} and sw.env_kept == {"HCCL_DETERMINISTIC": "false"}
    text = str(sw)
    assert "ACL_OPT_DETERMINISTIC=3" in text and "kept HCCL_DETERMINISTIC=false" in text and "not called" in text
    sw = P.apply_ascend_determinism("batch_invariant", environ=env, override=True)   # ...unless overridden
    assert env["HCCL_DETERMINISTIC"] == "strict" and "set HCCL_DETERMINISTIC=strict" in str(sw)
    env = {}
    assert P.apply_ascend_determinism("run_to_run", environ=env).level == 1 and env["HCCL_DETERMINISTIC"] == "true"
    env = {}
    assert P.apply_ascend_determinism("off", environ=env).env_set == {} and env == {}
    with pytest.raises(ValueError, match=r"one of \['batch_invariant', 'off', 'run_to_run'\]"):
        P.apply_ascend_determinism("bitwise", environ={})


def test_determinism_switch_calls_the_cann_runtime(backend_not_started):
    calls = []

    class FakeFn:
        def __init__(self, code):
            self.code = code

        def __call__(self, opt, value):
            calls.append((opt, value))
            return self.code

    class FakeLib:
        def __init__(self, code):
            self.aclrtSetSysParamOpt = FakeFn(code)

    sw = P.apply_ascend_determinism("batch_invariant", environ={}, call_acl=True, acl_loader=lambda name: FakeLib(0))
    assert calls == [(0, 3)] and "returned 0" in sw.acl_call             # ACL_OPT_DETERMINISTIC = 0, value 3
    with pytest.raises(RuntimeError, match="returned aclError 107"):
        P.apply_ascend_determinism("batch_invariant", environ={}, call_acl=True, acl_loader=lambda name: FakeLib(107))

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    with pytest.raises(RuntimeError, match="libascendcl.so could not be loaded"):
        P.apply_ascend_determinism("batch_invariant", environ={}, call_acl=True, acl_loader=missing)


def test_plugin_library_registration_passes_the_create_options(backend_not_started, monkeypatch, tmp_path):
    from jax._src import xla_bridge

    seen = {}
    monkeypatch.setattr(xla_bridge, "register_plugin", lambda name, **kw: seen.update(name=name, **kw))
    lib = tmp_path / "libpjrt_npu.so"
    lib.write_bytes(b"")
    sw = P.apply_ascend_determinism("batch_invariant", environ={})
    P.register_ascend_plugin(str(lib), switches=sw, options={"visible_devices": "0,1"})
    assert seen == {"name": "npu", "priority": 400, "library_path": str(lib),
                    "options": {"acl_opt_deterministic": 3, "visible_devices": "0,1"}}
    with pytest.raises(FileNotFoundError, match="no PJRT plugin library"):
        P.register_ascend_plugin(str(tmp_path / "missing.so"))


def test_start_up_in_a_fresh_process():
    """The real order of events: switches and platform selection before the first device call work and
    reach os.environ / jax's config; the same calls after it are refused."""
    code = textwrap.dedent("""
        import os, jax
        from deepinfer_jax import platform as P
        assert not P.backends_initialized()
        print(P.select_platforms("cpu"))
        sw = P.apply_ascend_determinism("batch_invariant")
        print(os.environ["HCCL_DETERMINISTIC"], os.environ["LCCL_DETERMINISTIC"], jax.config.jax_platforms)
        print(P.detect(start_backend=True).platform)
        try:
            P.apply_ascend_determinism("run_to_run")
        except RuntimeError as e:
            print("refused")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC", "JAX_PLATFORMS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["cpu", "strict 1 cpu", "cpu", "refused"], out.stdout


def test_ascend_install_files_agree():
    """The `ascend` extra exists, pulls no CUDA plugin (it would compete with the Ascend one for the
    default backend), and requirements-ascend.txt installs exactly that extra."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "ascend" in extras and not any("cuda" in d for d in extras["ascend"])
    reqs = [line.strip() for line in (ROOT / "requirements-ascend.txt").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    assert reqs == ["-e .[ascend]"]


def test_engine_programs_round_as_written_on_cuda_only():
    """The engine's GPU programs are compiled without XLA's excess precision (which deleted the fp8/fp4
    quantizers' rounding there); other platforms get no options (a PJRT plugin may not know the names)."""
    from deepinfer_jax.platform import step_compiler_options

    assert step_compiler_options("cuda") == {"xla_allow_excess_precision": False}
    assert step_compiler_options("cuda", excess_precision=True) == {}
    assert step_compiler_options("cpu") == {} and step_compiler_options("npu") == {}
    assert step_compiler_options() == {}   # this CPU machine
    # the option name is one XLA knows: a jit with it compiles and runs (an unknown name is an error)
    f = jax.jit(lambda x: (x.astype(jnp.bfloat16) * 3).astype(jnp.float32),
                compiler_options=step_compiler_options("cuda"))
    assert float(f(jnp.float32(1.0))) == 3.0
