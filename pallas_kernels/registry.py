"""Kernel registry: which implementation of an op runs on which platform.

One immutable table maps an op name to its implementations in preference order. ``resolve`` picks
the first implementation that runs on the platform (the Mosaic GPU kernel on a Hopper CUDA device, the
XLA path on CPU, TPU, ROCm, an Ascend plugin's ``npu`` and any platform it has never heard of), unless the caller asks for one explicitly, by ``impl=`` or by a frozen ``KernelSelection``.
An explicit request for an implementation that cannot run on the platform is an error, never a silent
fallback: a batch-invariance promise must not change with the hardware behind the caller's back.

``KernelSelection.from_env()`` reads ``DEEPINFER_KERNELS`` when it is called (``xla`` for every op, or
``op=impl,op=impl``); callers read it once and pass it down. The built-in table never changes; the one
piece of process state is the list of implementations a user adds at start-up with ``register_impl``
(e.g. an FFI custom call into a CANN operator for the ``npu`` platform, see
``deepinfer_jax.platform.register_cann_kernel``). They come before the built-in ones in preference order
and only on their own platforms; ``Registration.unregister()`` takes one back.

Platforms the registry has never heard of (an Ascend plugin says ``npu``; others say other things) get
the portable XLA path, with one log line per (op, platform) saying so.

Implementations are named as ``"module:function"`` and imported on first use, so the CPU-only and
Ascend paths never import Mosaic GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from types import MappingProxyType
from typing import Any, Callable, Mapping

import jax

PALLAS_MOSAIC_GPU = "pallas_mosaic_gpu"
XLA = "xla"
REFERENCE = "reference"
ENV_VAR = "DEEPINFER_KERNELS"
# Platform names as the registry sees them (``platform_name``): the ones it has an opinion about. Anything
# else is "unknown" and gets the portable XLA path (logged once per op and platform).
ASCEND = "npu"
KNOWN_PLATFORMS = frozenset({"cpu", "cuda", "rocm", "tpu", ASCEND})
# What Ascend PJRT plugins have been seen or proposed to call their platform; all mean ``npu`` here.
_PLATFORM_ALIASES = {"ascend": ASCEND, "npu": ASCEND}

log = logging.getLogger(__name__)
# Implementations added by ``register_impl``, per op (start-up hooks; see the module docstring).
_EXTRA: dict[str, list["Impl"]] = {}
_EXTRA_LOCK = threading.Lock()


class KernelUnavailableError(ValueError):
    """An implementation was requested explicitly on a platform/device it cannot run on."""


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    target: ``"module:function"``, imported on first use.
    platforms: platform names it runs on; None = every platform (plain JAX).
    compute_capability: for CUDA kernels, the required major compute capability (9 = Hopper).
    auto: whether ``resolve`` may pick it without being asked (the f32 reference is opt-in only).
    """

    name: str
    target: str | Callable[..., Any]   # "module:function", or the function itself (user registrations)
    platforms: frozenset[str] | None = None
    compute_capability: int | None = None
    auto: bool = True

    def load(self) -> Callable[..., Any]:
        if callable(self.target):
            return self.target
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)

    def unavailable_reason(self, platform: str, device: Any | None) -> str | None:
        if self.platforms is not None and platform not in self.platforms:
            return f"it runs on {sorted(self.platforms)}, not on platform {platform!r}"
        if self.compute_capability is not None and device is not None:
            cc = getattr(device, "compute_capability", None)
            major = int(str(cc).split(".")[0]) if cc is not None else None
            if major != self.compute_capability:
                return (f"it needs a compute capability {self.compute_capability}.x GPU, "
                        f"device {getattr(device, 'device_kind', device)!r} has {cc}")
        return None


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    impls: tuple[Impl, ...]   # preference order; the portable XLA path comes last among the auto ones

    def all_impls(self) -> tuple[Impl, ...]:
        """Implementations added with ``register_impl`` (newest first), then the built-in ones."""
        with _EXTRA_LOCK:
            extra = tuple(reversed(_EXTRA.get(self.name, ())))
        return extra + self.impls

    def impl(self, name: str) -> Impl:
        impls = self.all_impls()
        for i in impls:
            if i.name == name:
                return i
        raise ValueError(f"op {self.name!r} has no implementation {name!r}; "
                         f"known: {[i.name for i in impls]}")


def _pallas_gpu(target: str) -> Impl:
    return Impl(PALLAS_MOSAIC_GPU, target, platforms=frozenset({"cuda"}), compute_capability=9)


REGISTRY: Mapping[str, OpSpec] = MappingProxyType({
    "grouped_matmul": OpSpec("grouped_matmul", (
        _pallas_gpu("pallas_kernels.grouped_gemm.kernel:grouped_matmul_pallas"),
        Impl(XLA, "pallas_kernels.grouped_gemm.xla:grouped_matmul_xla"),
        Impl(REFERENCE, "pallas_kernels.grouped_gemm.reference:grouped_matmul_reference", auto=False),
    )),
    # The attention package keeps its own shape-aware dispatcher; these entries let callers force a
    # path through the same selection mechanism.
    "sparse_sink_attention": OpSpec("sparse_sink_attention", (
        _pallas_gpu("pallas_kernels.attention:sparse_sink_attention_pallas"),
        Impl(XLA, "pallas_kernels.attention:sparse_sink_attention_xla"),
        Impl(REFERENCE, "pallas_kernels.attention:sparse_sink_attention_reference", auto=False),
    )),
    "sparse_sink_attention_fp4": OpSpec("sparse_sink_attention_fp4", (
        _pallas_gpu("pallas_kernels.attention:sparse_sink_attention_fp4_pallas"),
        Impl(XLA, "pallas_kernels.attention:sparse_sink_attention_fp4_xla"),
        Impl(REFERENCE, "pallas_kernels.attention:sparse_sink_attention_fp4_reference", auto=False),
    )),
    "index_scores": OpSpec("index_scores", (
        _pallas_gpu("pallas_kernels.indexer:index_scores_pallas"),
        Impl(XLA, "pallas_kernels.indexer:index_scores_xla"),
        Impl(REFERENCE, "pallas_kernels.indexer:index_scores_reference", auto=False),
    )),
    "sinkhorn_rounds": OpSpec("sinkhorn_rounds", (
        _pallas_gpu("pallas_kernels.sinkhorn:sinkhorn_rounds_pallas"),
        Impl(XLA, "pallas_kernels.sinkhorn:sinkhorn_rounds_xla"),
    )),
    "topk_indices": OpSpec("topk_indices", (
        Impl(XLA, "pallas_kernels.topk:topk_indices_xla"),
        Impl(REFERENCE, "pallas_kernels.topk:topk_indices_reference", auto=False),
    )),
})


@dataclasses.dataclass(frozen=True)
class KernelSelection:
    """An explicit choice of implementations: ``default`` for every op, ``per_op`` overriding it.

    per_op is a tuple of (op, impl) pairs so the selection stays hashable (usable as a static arg)."""

    default: str | None = None
    per_op: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        known = sorted({i.name for spec in REGISTRY.values() for i in spec.all_impls()})
        if self.default is not None and self.default not in known:
            raise ValueError(f"KernelSelection default {self.default!r} is no implementation of any op; "
                             f"known: {known}")
        for op, name in self.per_op:
            if op not in REGISTRY:
                raise ValueError(f"KernelSelection names unknown op {op!r}; known: {sorted(REGISTRY)}")
            REGISTRY[op].impl(name)      # raises on an unknown implementation name

    def impl_for(self, op: str) -> str | None:
        """The implementation named for op: its per_op entry, else the default if the op has an
        implementation of that name (``pallas_mosaic_gpu`` as a default leaves kernel-less ops on
        their automatic choice), else None (automatic)."""
        for o, name in self.per_op:
            if o == op:
                return name
        if self.default is not None and op in REGISTRY and any(i.name == self.default
                                                                           for i in REGISTRY[op].all_impls()):
            return self.default
        return None

    @classmethod
    def parse(cls, text: str) -> "KernelSelection":
        """``"xla"`` -> every op; ``"grouped_matmul=xla,topk_indices=reference"`` -> per op; may mix."""
        default, per_op = None, []
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" in part:
                op, _, name = (s.strip() for s in part.partition("="))
                per_op.append((op, name))
            elif default is None:
                default = part
            else:
                raise ValueError(f"two defaults ({default!r} and {part!r})")
        return cls(default=default, per_op=tuple(per_op))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelSelection":
        """The selection named by ``DEEPINFER_KERNELS`` (empty = automatic)."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "")
        try:
            return cls.parse(text)
        except ValueError as e:
            raise ValueError(f"bad {ENV_VAR}={text!r}: {e}") from None


AUTO = KernelSelection()


# ---- user-registered implementations (start-up hooks, e.g. CANN operators through JAX FFI) --------------

@dataclasses.dataclass(frozen=True)
class Registration:
    """Handle returned by ``register_impl``; ``unregister()`` removes exactly that implementation."""

    op: str
    impl: Impl

    def unregister(self) -> None:
        with _EXTRA_LOCK:
            impls = _EXTRA.get(self.op, [])
            if self.impl in impls:
                impls.remove(self.impl)


def register_impl(op: str, impl: Impl) -> Registration:
    """Add an implementation of a registered op, preferred over the built-in ones on its platforms.

    It must name its platforms (a user kernel never runs "everywhere") and must not reuse a built-in
    name. Ops resolve at trace time, so register before the first call that should use it (jit caches
    what it traced). Returns a handle whose ``unregister()`` takes it back."""
    if op not in REGISTRY:
        raise ValueError(f"unknown op {op!r}; known: {sorted(REGISTRY)}")
    if not impl.platforms:
        raise ValueError(f"{op}: implementation {impl.name!r} must name the platforms it runs on "
                         f"(e.g. platforms=frozenset({{{ASCEND!r}}}))")
    builtin = {i.name for i in REGISTRY[op].impls}
    if impl.name in builtin:
        raise ValueError(f"{op}: {impl.name!r} is a built-in implementation name; pick another "
                         f"(built-in: {sorted(builtin)})")
    with _EXTRA_LOCK:
        impls = _EXTRA.setdefault(op, [])
        if any(i.name == impl.name for i in impls):
            raise ValueError(f"{op}: an implementation named {impl.name!r} is already registered; "
                             f"unregister it first")
        impls.append(impl)
    return Registration(op, impl)


def canonical_platform(platform: str) -> str:
    """``ascend`` and ``npu`` are one platform here (``npu``); other names pass through."""
    return _PLATFORM_ALIASES.get(platform.lower(), platform)


_logged_unknown: set[tuple[str, str]] = set()


def _log_platform_choice(op: str, platform: str, chosen: Impl) -> None:
    """One line per (op, platform): an unknown platform (warning) or Ascend without a CANN kernel (info)."""
    if (op, platform) in _logged_unknown:
        return
    _logged_unknown.add((op, platform))
    if platform == ASCEND:
        log.info("%s: no kernel registered for platform %r; using the portable %r implementation (add a CANN "
                 "operator with deepinfer_jax.platform.register_cann_kernel)", op, platform, chosen.name)
        return
    log.warning("%s: platform %r is not one the kernel registry knows (%s); using the portable %r "
                "implementation. Run the invariance tests on this platform before trusting the bitwise "
                "promise.", op, platform, ", ".join(sorted(KNOWN_PLATFORMS)), chosen.name)


def platform_name(device: Any) -> str:
    """A device's platform with NVIDIA GPUs called ``cuda`` and AMD ones ``rocm`` (jax says ``gpu``)."""
    platform = canonical_platform(device.platform)
    if platform == "gpu":
        version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
        if "rocm" in version or "hip" in version:
            return "rocm"
        return "cuda"
    return platform


def device_of(x: Any = None) -> Any:
    """The device a concrete single-device array lives on, else jax's default device (tracers too)."""
    if x is not None and hasattr(x, "devices"):
        try:
            devices = x.devices()
        except Exception:  # noqa: BLE001 - tracers have no devices: fall back to the default
            devices = ()
        if len(devices) == 1:
            return next(iter(devices))
    return jax.devices()[0]


def resolve(op: str, *, impl: str | None = None, selection: KernelSelection = AUTO,
            platform: str | None = None, device: Any | None = None) -> Impl:
    """The implementation of ``op`` to run.

    impl (or else ``selection``) forces one by name and raises ``KernelUnavailableError`` if it cannot
    run here. Otherwise the first automatic implementation that runs on the platform. ``platform``
    defaults to the platform of ``device`` (default: jax's first device); giving only a platform
    name (e.g. ``"npu"``) skips the device checks."""
    if op not in REGISTRY:
        raise ValueError(f"unknown op {op!r}; known: {sorted(REGISTRY)}")
    spec = REGISTRY[op]
    if platform is None:
        device = device if device is not None else jax.devices()[0]
        platform = platform_name(device)
    else:
        platform = canonical_platform(platform)
    impls = spec.all_impls()
    requested = impl or selection.impl_for(op)
    if requested is not None:
        chosen = spec.impl(requested)
        if (why := chosen.unavailable_reason(platform, device)) is not None:
            runnable = [i.name for i in impls if i.unavailable_reason(platform, device) is None]
            raise KernelUnavailableError(f"{op}: implementation {requested!r} was requested but {why}; "
                                         f"on platform {platform!r} you can choose {runnable}")
        return chosen
    for candidate in impls:
        if candidate.auto and candidate.unavailable_reason(platform, device) is None:
            if platform not in KNOWN_PLATFORMS or (platform == ASCEND and candidate.name == XLA):
                _log_platform_choice(op, platform, candidate)
            return candidate
    raise KernelUnavailableError(f"{op}: no implementation runs on platform {platform!r}")
