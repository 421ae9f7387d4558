"""Which platform JAX will run on, and the start-up hooks for Huawei Ascend through a PJRT plugin.

Nothing in this module has been run on Ascend hardware (docs/ASCEND.md says what has been run where).
There is no public Ascend PJRT plugin; these are the pieces the engine needs from whichever plugin a
user brings, each tested on CPU with stand-ins:

* ``find_pjrt_plugins`` / ``detect``: the plugins JAX will discover (modules in the ``jax_plugins``
  namespace package, ``jax_plugins`` entry points, ``PJRT_NAMES_AND_LIBRARY_PATHS``), ``JAX_PLATFORMS``,
  and, once a backend is up, the platform the kernel registry sees. Finding plugins imports nothing.
* ``select_platforms("npu,cpu")``: sets ``JAX_PLATFORMS`` (and jax's config) before any backend starts.
* ``apply_ascend_determinism(mode)``: the determinism switches of spec §3.4/§3.5, applied before the
  backend initialises, and a report of exactly what was set. CANN's batch consistency is the process-wide
  runtime option ``aclrtSetSysParamOpt(ACL_OPT_DETERMINISTIC, 3)`` (CANN >= 9.2; 1 = run-to-run only);
  HCCL/LCCL collectives read environment variables. The ACL option reaches the plugin as a PJRT
  client create option (``register_ascend_plugin`` passes it) and, when asked, by calling the CANN
  runtime directly through ctypes.
* ``register_cann_kernel(op, target, handler)``: the hook for CANN operators through JAX FFI. It
  registers the user's FFI handler for the platform (``jax.ffi.register_ffi_target``) and adds an
  implementation of a ``pallas_kernels`` op that calls it (``jax.ffi.ffi_call``); the kernel registry then
  prefers it on that platform. Without one, the registry runs the portable XLA path on ``npu``.

Call the start-up functions before anything touches a jax device (``jax.devices()``, creating an array,
``LLM(...)``): JAX reads ``JAX_PLATFORMS`` and creates the PJRT clients once per process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np

from pallas_kernels import registry

log = logging.getLogger(__name__)

ASCEND = registry.ASCEND  # "npu": the platform name an Ascend plugin reports (transformers looks for it too)
PLUGIN_NAMESPACE = "jax_plugins"
PJRT_PATHS_ENV = "PJRT_NAMES_AND_LIBRARY_PATHS"

# ---- detection --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """A PJRT plugin JAX will try to load: ``name``, where it was found (``source``) and its location."""

    name: str
    source: str  # "jax_plugins module" | "entry point" | PJRT_NAMES_AND_LIBRARY_PATHS
    location: str

    @property
    def looks_like_ascend(self) -> bool:
        return looks_like_ascend(self.name) or looks_like_ascend(os.path.basename(self.location))


def looks_like_ascend(name: str) -> bool:
    """True for names an Ascend plugin uses or may use: ``npu``, ``ascend``, ``jax_npu``, ``libpjrt_npu.so``."""
    n = name.lower()
    return "ascend" in n or "npu" in n


def find_pjrt_plugins(environ: Mapping[str, str] | None = None) -> tuple[PluginInfo, ...]:
    """The PJRT plugins JAX's discovery (``jax._src.xla_bridge``) will see, without importing any of them."""
    env = os.environ if environ is None else environ
    found: list[PluginInfo] = []
    spec = importlib.util.find_spec(PLUGIN_NAMESPACE)
    if spec is not None and spec.submodule_search_locations is not None:
        for m in pkgutil.iter_modules(list(spec.submodule_search_locations)):
            found.append(PluginInfo(m.name, "jax_plugins module",
                                    os.path.join(getattr(m.module_finder, "path", ""), m.name)))
    for ep in importlib.metadata.entry_points(group=PLUGIN_NAMESPACE):
        found.append(PluginInfo(ep.name, "entry point", ep.value))
    sep = ";" if os.name == "nt" else ","  # as jax's xla_bridge splits it
    for item in filter(None, (p.strip() for p in env.get(PJRT_PATHS_ENV, "").split(sep))):
        name, _, path = item.partition(":")
        found.append(PluginInfo(name, PJRT_PATHS_ENV, path))
    return tuple(found)


def backends_initialized() -> bool:
    """Whether JAX has created its PJRT clients (after which platforms and plugin options are fixed)."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


@dataclasses.dataclass(frozen=True)
class PlatformInfo:
    jax_platforms: str | None  # JAX_PLATFORMS / jax_platforms: the backends JAX may start, in order
    plugins: tuple[PluginInfo, ...]
    backend_initialized: bool
    platform: str | None  # the default device's platform as the kernel registry names it (None: not started)
    device_kind: str | None
    device_count: int | None

    @property
    def ascend_plugin_installed(self) -> bool:
        return any(p.looks_like_ascend for p in self.plugins)

    @property
    def on_ascend(self) -> bool:
        return self.platform == ASCEND

    def summary(self) -> str:
        plugins = ", ".join(f"{p.name} ({p.source})" for p in self.plugins) or "none"
        running = (f"default device: {self.platform} ({self.device_kind}, {self.device_count} devices)"
                   if self.backend_initialized else "no backend started yet")
        return f"JAX_PLATFORMS={self.jax_platforms or '(unset: highest-priority backend)'}; PJRT plugins: {plugins}; {running}"


def detect(*, start_backend: bool = False, environ: Mapping[str, str] | None = None) -> PlatformInfo:
    """What JAX will run on. Does not start a backend unless ``start_backend`` (so it is safe to call
    before ``apply_ascend_determinism``); once one is running it reports the default device."""
    import jax

    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS") or jax.config.jax_platforms or None
    started = backends_initialized()
    platform = kind = count = None
    if start_backend or started:
        devices = jax.devices()
        platform, kind, count = registry.platform_name(devices[0]), devices[0].device_kind, len(devices)
        started = True
    return PlatformInfo(platforms, find_pjrt_plugins(env), started, platform, kind, count)


def _require_not_started(what: str) -> None:
    if backends_initialized():
        raise RuntimeError(f"{what} must run before JAX starts its backends (before the first jax.devices(), "
                           f"array creation or LLM(...)); this process already has them, so the setting "
                           f"would not reach the PJRT client. Call it first thing, or in a fresh process.")


def select_platforms(platforms: str | Sequence[str], environ: MutableMapping[str, str] | None = None) -> str:
    """Restrict and order the backends JAX may start, e.g. ``"npu,cpu"`` (a listed platform that fails to
    initialise is then an error, not a silent fallback). Sets ``JAX_PLATFORMS`` and jax's ``jax_platforms``;
    returns the value."""
    import jax

    _require_not_started("select_platforms")
    value = platforms if isinstance(platforms, str) else ",".join(platforms)
    value = ",".join(p.strip() for p in value.split(",") if p.strip())
    if not value:
        raise ValueError("select_platforms needs at least one platform name, e.g. 'npu,cpu'")
    (os.environ if environ is None else environ)["JAX_PLATFORMS"] = value
    jax.config.update("jax_platforms", value)
    return value


# ---- compile options of the engine's programs ----------------------------------------------------------

# XLA:GPU's default --xla_allow_excess_precision lets it keep a value the program rounds to bf16 (or to
# fp8 / fp4, then back) in float32, depending on what it fuses. The engine's GPU programs turn it off,
# so they round where the program says, as the CPU does. Measured without a GPU (deviceless H200
# compile of the 4-layer B=64 decode step, 2026-12-05): 391 kernels against 393, 166 bf16 converts
# against 159, so the cost is a few in-register converts. The GPU invariance script had run with it
# off since 2026-12-04; the engine had not.
GPU_STEP_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def step_compiler_options(platform: str | None = None, *, excess_precision: bool = False) -> dict[str, Any]:
    """XLA compile options for the engine's jitted programs on ``platform`` (default: that of jax's
    first device): on CUDA, rounding as the program says unless ``excess_precision``; elsewhere none
    (the CPU rounds as written, and a PJRT plugin may not know XLA's option names)."""
    if platform is None:
        import jax

        platform = registry.platform_name(jax.devices()[0])
    if excess_precision or registry.canonical_platform(platform) != "cuda":
        return {}
    return dict(GPU_STEP_COMPILER_OPTIONS)


# ---- determinism switches ---------------------------------------------------------------------------

# CANN runtime option (aclSysParamOpt in acl/acl_rt.h): ACL_OPT_DETERMINISTIC = 0, set by
# aclrtSetSysParamOpt(opt, int64 value). Values: 0 off, 1 run-to-run determinism, 3 batch consistency
# (CANN >= 9.2.0, spec §3.4).
ACL_OPT_DETERMINISTIC = 0
DETERMINISM_LEVELS = {"off": 0, "run_to_run": 1, "batch_invariant": 3}
# The PJRT create option through which ``register_ascend_plugin`` hands the level to a plugin. No public
# plugin exists to take the spelling from: this is the name we propose; pass ``option_name=`` for another.
DETERMINISM_OPTION = "acl_opt_deterministic"
_ENV_BY_MODE = {
    "off": {},
    # HCCL: deterministic reduction order; LCCL (the intra-node library): same
    "run_to_run": {"HCCL_DETERMINISTIC": "true", "LCCL_DETERMINISTIC": "1"},
    # what vllm-ascend sets for its batch-invariant mode (spec §3.5)
    "batch_invariant": {"HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1"},
}
ACL_LIBRARY = "libascendcl.so"


@dataclasses.dataclass(frozen=True)
class DeterminismSwitches:
    """What ``apply_ascend_determinism`` did. ``str()`` says it in words."""

    mode: str
    level: int  # the ACL_OPT_DETERMINISTIC value
    env_set: dict[str, str]  # variables set now
    env_kept: dict[str, str]  # variables the user had already set to another value, left alone
    create_options: dict[str, int]  # for the PJRT client (register_ascend_plugin passes them)
    acl_call: str  # what happened to the direct CANN runtime call

    def __str__(self) -> str:
        lines = [f"Ascend determinism mode {self.mode!r} (ACL_OPT_DETERMINISTIC={self.level}):"]
        lines += [f"  set {k}={v}" for k, v in self.env_set.items()]
        lines += [f"  kept {k}={v} (already set; override=True replaces it)" for k, v in self.env_kept.items()]
        lines.append(f"  PJRT create options: {self.create_options}")
        lines.append(f"  CANN runtime: {self.acl_call}")
        return "\n".join(lines)


def apply_ascend_determinism(mode: str = "batch_invariant", *, environ: MutableMapping[str, str] | None = None,
                             override: bool = False, call_acl: bool = False,
                             acl_loader: Callable[[str], Any] = ctypes.CDLL,
                             option_name: str = DETERMINISM_OPTION) -> DeterminismSwitches:
    """Switch on the Ascend stack's determinism before the backend initialises, and say what was set.

    mode: ``"batch_invariant"`` (CANN batch consistency, ACL_OPT_DETERMINISTIC=3, HCCL strict),
    ``"run_to_run"`` (=1, HCCL deterministic) or ``"off"``.
    environ: where the variables go (default ``os.environ``; the plugin and HCCL read them at start-up).
    override: replace variables the user already set to another value (default: keep theirs, report it).
    call_acl: also call ``aclrtSetSysParamOpt(ACL_OPT_DETERMINISTIC, level)`` in this process through
    ``libascendcl.so`` (process-wide; a plugin that ignores the create option still gets it). An error if
    the library is missing or the call fails.
    Raises RuntimeError once JAX's backends are up: the settings would not reach the client."""
    if mode not in DETERMINISM_LEVELS:
        raise ValueError(f"determinism mode must be one of {sorted(DETERMINISM_LEVELS)}, got {mode!r}")
    _require_not_started("apply_ascend_determinism")
    env = os.environ if environ is None else environ
    level = DETERMINISM_LEVELS[mode]
    env_set, env_kept = {}, {}
    for key, value in _ENV_BY_MODE[mode].items():
        if key in env and env[key] != value and not override:
            env_kept[key] = env[key]
            continue
        env[key] = value
        env_set[key] = value
    acl_call = "not called (call_acl=False)"
    if call_acl:
        try:
            lib = acl_loader(ACL_LIBRARY)
        except OSError as e:
            raise RuntimeError(f"call_acl=True but {ACL_LIBRARY} could not be loaded ({e}); source the CANN "
                               f"set_env.sh or leave call_acl off and rely on the PJRT create option") from None
        fn = lib.aclrtSetSysParamOpt
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_int
        code = fn(ACL_OPT_DETERMINISTIC, level)
        if code != 0:
            raise RuntimeError(f"aclrtSetSysParamOpt(ACL_OPT_DETERMINISTIC, {level}) returned aclError {code} "
                               f"(level 3 needs CANN >= 9.2.0)")
        acl_call = f"aclrtSetSysParamOpt(ACL_OPT_DETERMINISTIC, {level}) returned 0"
    switches = DeterminismSwitches(mode, level, env_set, env_kept, {option_name: level}, acl_call)
    log.info("%s", switches)
    return switches


def register_ascend_plugin(library_path: str, *, name: str = ASCEND, priority: int = 400,
                           options: Mapping[str, Any] | None = None,
                           switches: DeterminismSwitches | None = None) -> Any:
    """Register a PJRT plugin shared library (one that does not ship its own ``jax_plugins`` module) under
    ``name``, with the determinism level in its client create options. Before any backend starts."""
    from jax._src import xla_bridge

    _require_not_started("register_ascend_plugin")
    if not os.path.exists(library_path):
        raise FileNotFoundError(f"{library_path}: no PJRT plugin library there")
    merged = {**(switches.create_options if switches is not None else {}), **(options or {})}
    return xla_bridge.register_plugin(name, priority=priority, library_path=library_path, options=merged or None)


# ---- CANN operators through JAX FFI ---------------------------------------------------------------------

def _gmm_call(target: str, vmap_method: str | None):
    import jax

    def call(x_mk, w, group_ids_m, w_scale=None, *, out_dtype=None, config=None):
        del config  # the CANN operator owns its tiling (and its batch-invariance promise)
        operands = (x_mk, w, group_ids_m) + (() if w_scale is None else (w_scale,))
        out = jax.ShapeDtypeStruct((x_mk.shape[0], w.shape[1]), out_dtype or x_mk.dtype)
        return jax.ffi.ffi_call(target, out, vmap_method=vmap_method)(*operands)

    return call


def _attention_call(target: str, vmap_method: str | None):
    import jax

    def call(q_bthd, kv_bsd, idx_btk, sink_h, scale, *_config):
        out = jax.ShapeDtypeStruct(q_bthd.shape, q_bthd.dtype)
        return jax.ffi.ffi_call(target, out, vmap_method=vmap_method)(q_bthd, kv_bsd, idx_btk, sink_h,
                                                                      scale=np.float32(scale))

    return call


def _topk_call(target: str, vmap_method: str | None):
    import jax
    import jax.numpy as jnp

    def call(scores_bts, k):
        out = jax.ShapeDtypeStruct(scores_bts.shape[:-1] + (k,), jnp.int32)
        return jax.ffi.ffi_call(target, out, vmap_method=vmap_method)(scores_bts, k=np.int64(k))

    return call


# How each op's arguments become FFI operands and attributes (the handler's binding must match):
FFI_SIGNATURES = {
    "grouped_matmul": ("operands (x_mk, w, group_ids_m[, w_scale]) -> y [M, N] (out_dtype); no attributes",
                       _gmm_call),
    "sparse_sink_attention": ("operands (q_bthd, kv_bsd, idx_btk, sink_h), attribute scale: f32 -> o like q",
                              _attention_call),
    "topk_indices": ("operand scores_bts f32, attribute k: i64 -> idx_btk s32 [B, T, k]", _topk_call),
}


def register_cann_kernel(op: str, target_name: str, handler: Any = None, *, platform: str = ASCEND,
                         name: str = "cann_ffi", api_version: int = 1, auto: bool = True,
                         vmap_method: str | None = None) -> registry.Registration:
    """Run ``op`` (a ``pallas_kernels`` op) through the FFI target ``target_name`` on ``platform``.

    handler: the FFI handler (a PyCapsule, e.g. ``jax.ffi.pycapsule(lib.MyHandler)`` for a symbol defined
    with ``XLA_FFI_DEFINE_HANDLER_SYMBOL``); None if the plugin registers the target itself. Its binding
    must match ``FFI_SIGNATURES[op]``. auto: let the registry pick it on that platform without being
    asked (otherwise only ``impl=name`` / ``DEEPINFER_KERNELS="op=name"`` select it).
    Returns the registry handle (``.unregister()`` takes the implementation back; the FFI target stays).
    The batch-invariance promise then rests on the operator: run the invariance tests on the device."""
    if op not in FFI_SIGNATURES:
        raise ValueError(f"unknown op {op!r}; ops with an FFI binding: {sorted(FFI_SIGNATURES)}")
    platform = registry.canonical_platform(platform)
    if handler is not None:
        import jax

        jax.ffi.register_ffi_target(target_name, handler, platform=platform, api_version=api_version)
    call = FFI_SIGNATURES[op][1](target_name, vmap_method)
    call.__name__ = call.__qualname__ = f"{op}_ffi_{target_name}"
    reg = registry.register_impl(op, registry.Impl(name, call, platforms=frozenset({platform}), auto=auto))
    log.info("%s on %r: FFI target %r registered as implementation %r (auto=%s)", op, platform, target_name,
             name, auto)
    return reg


__all__ = ["ACL_OPT_DETERMINISTIC", "ASCEND", "DETERMINISM_LEVELS", "DETERMINISM_OPTION", "DeterminismSwitches",
           "FFI_SIGNATURES", "PlatformInfo", "PluginInfo", "apply_ascend_determinism", "backends_initialized",
           "detect", "find_pjrt_plugins", "looks_like_ascend", "register_ascend_plugin", "register_cann_kernel",
           "select_platforms"]
