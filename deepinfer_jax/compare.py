"""Numerical comparison of our model against reference activations dumped by another implementation.

Dump format (one file; ``.safetensors`` through the ``safetensors.numpy`` API, or ``.npz``; chosen by the
extension). For every prompt i = 0..N-1 (contiguous):

* ``prompt{i}.tokens``        int   [T]          the token ids that were run (prefill from position 0);
* ``prompt{i}.logits``        fp32  [T, V]       the logits of every position;
* ``prompt{i}.layer{L}.hidden`` fp32 [T, hc, D]  the 4-stream residual state after block L, L = 0..n-1
  (contiguous; optional: a dump may hold no layer tensors at all, then only logits can be compared).

Metadata (optional for foreign dumps): a JSON object under the safetensors header key ``deepinfer_dump``
(``.npz``: a 0-d string array named ``__metadata__``) with ``implementation``, ``config``, ``numerics``,
``jax_version``, ``model_revision``. Values are stored in fp32, so a dump resolves errors down to
~6e-8 relative (fp32 rounding of the stored values), well below the ~1e-6 of an fp32-vs-float64 run.

Metrics (``compare_dumps``), per tensor and prompt, the reference ``b`` against ours ``a``:
``max_abs = max|a - b|``; ``max_rel = max_abs / max|b|`` (relative to the reference's largest value, so
near-zero entries do not blow it up); ``cos_min`` = the smallest over positions of the cosine similarity of
the flattened per-position vectors. On the logits additionally ``KL(ref || ours)`` per position (mean/max)
and top-1 (argmax) agreement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np

FORMAT = "deepinfer-dump/1"
META_KEY = "deepinfer_dump"  # safetensors header metadata key
NPZ_META_KEY = "__metadata__"
_NAME = re.compile(r"^prompt(\d+)\.(?:(tokens)|(logits)|layer(\d+)\.hidden)$")
NAMING = "prompt{i}.tokens, prompt{i}.logits, prompt{i}.layer{L}.hidden"


class DumpError(ValueError):
    """A dump that is malformed, or two dumps that cannot be compared (names the tensor and shapes)."""


# ---------------------------------------------------------------------------------------------------------
# The dump: in memory, on disk
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PromptDump:
    tokens: np.ndarray  # int [T]
    logits: np.ndarray  # fp32 [T, V]
    hidden: tuple[np.ndarray, ...] = ()  # per layer, fp32 [T, hc, D]; empty when the dump holds no layers


@dataclasses.dataclass(frozen=True)
class Dump:
    prompts: tuple[PromptDump, ...]
    metadata: dict = dataclasses.field(default_factory=dict)
    source: str = "<memory>"  # file it came from (for error messages)

    @property
    def n_layers(self) -> int:
        return len(self.prompts[0].hidden) if self.prompts else 0

    def tensors(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i, p in enumerate(self.prompts):
            out[f"prompt{i}.tokens"] = np.ascontiguousarray(p.tokens, np.int32)
            out[f"prompt{i}.logits"] = np.ascontiguousarray(p.logits, np.float32)
            for layer, h in enumerate(p.hidden):
                out[f"prompt{i}.layer{layer}.hidden"] = np.ascontiguousarray(h, np.float32)
        return out


def _shape(a: np.ndarray | None) -> str:
    return "absent" if a is None else str(list(a.shape))


def save_dump(dump: Dump, path: str | Path) -> Path:
    """Write ``dump`` to ``path`` (.safetensors or .npz) in the format of the module docstring."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = dump.tensors()
    meta = json.dumps(dump.metadata, sort_keys=True)
    if path.suffix == ".safetensors":
        try:
            from safetensors.numpy import save_file
        except ImportError:
            raise DumpError(f"{path}: writing .safetensors needs the safetensors package "
                            "(pip install safetensors), or use a .npz path") from None
        save_file(tensors, str(path), metadata={META_KEY: meta})
    elif path.suffix == ".npz":
        np.savez(path, **tensors, **{NPZ_META_KEY: np.array(meta)})
    else:
        raise DumpError(f"{path}: unknown dump extension {path.suffix!r} (use .safetensors or .npz)")
    return path


def _read_raw(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    if path.suffix not in (".safetensors", ".npz"):
        raise DumpError(f"{path}: unknown dump extension {path.suffix!r} (use .safetensors or .npz)")
    if not path.exists():
        raise DumpError(f"{path}: dump file does not exist")
    if path.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError:
            raise DumpError(f"{path}: reading .safetensors needs the safetensors package") from None
        tensors = {}
        with safe_open(str(path), framework="np") as f:
            header = f.metadata() or {}
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
        meta = header.get(META_KEY)
    else:
        with np.load(path, allow_pickle=False) as z:
            tensors = {k: z[k] for k in z.files if k != NPZ_META_KEY}
            meta = str(z[NPZ_META_KEY]) if NPZ_META_KEY in z.files else None
    try:
        metadata = json.loads(meta) if meta else {}
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: metadata {META_KEY!r} is not valid JSON ({e})") from None
    return tensors, metadata


def load_dump(path: str | Path) -> Dump:
    """Read and validate a dump (names, contiguity, shapes, dtypes); errors name the file and tensor."""
    path = Path(path)
    tensors, metadata = _read_raw(path)
    by_prompt: dict[int, dict] = {}
    for name, arr in tensors.items():
        m = _NAME.match(name)
        if m is None:
            raise DumpError(f"{path}: tensor {name!r} does not follow the dump naming ({NAMING})")
        entry = by_prompt.setdefault(int(m.group(1)), {"layers": {}})
        if m.group(2):
            entry["tokens"] = arr
        elif m.group(3):
            entry["logits"] = arr
        else:
            entry["layers"][int(m.group(4))] = arr
    if not by_prompt:
        raise DumpError(f"{path}: no tensors (expected {NAMING})")
    n = len(by_prompt)
    if sorted(by_prompt) != list(range(n)):
        missing = sorted(set(range(max(by_prompt) + 1)) - set(by_prompt))
        raise DumpError(f"{path}: prompts must be numbered 0..{n - 1}; prompt{missing[0]}.* is missing")
    prompts = []
    n_layers = None
    for i in range(n):
        e = by_prompt[i]
        for key in ("tokens", "logits"):
            if key not in e:
                raise DumpError(f"{path}: prompt{i}.{key} is missing")
        tokens, logits = e["tokens"], e["logits"]
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or len(tokens) == 0:
            raise DumpError(f"{path}: prompt{i}.tokens must be a non-empty 1-D integer array, "
                            f"got {tokens.dtype} {_shape(tokens)}")
        t = len(tokens)
        if logits.ndim != 2 or logits.shape[0] != t:
            raise DumpError(f"{path}: prompt{i}.logits must be [T={t}, V], got {_shape(logits)}")
        layers = e["layers"]
        if sorted(layers) != list(range(len(layers))):
            gap = min(set(range(len(layers))) - set(layers))
            raise DumpError(f"{path}: prompt{i}.layer{gap}.hidden is missing (layers must be 0..n-1)")
        if n_layers is None:
            n_layers = len(layers)
        elif len(layers) != n_layers:
            raise DumpError(f"{path}: prompt{i} has {len(layers)} layer tensors, prompt0 has {n_layers}")
        hidden = []
        for layer in range(len(layers)):
            h = layers[layer]
            first = layers[0]
            if h.ndim != 3 or h.shape[0] != t or h.shape != first.shape:
                raise DumpError(f"{path}: prompt{i}.layer{layer}.hidden must be [T={t}, hc, D] like "
                                f"prompt{i}.layer0.hidden {_shape(first)}, got {_shape(h)}")
            hidden.append(h.astype(np.float32, copy=False))
        prompts.append(PromptDump(tokens.astype(np.int64), logits.astype(np.float32, copy=False), tuple(hidden)))
    return Dump(tuple(prompts), metadata, str(path))


# ---------------------------------------------------------------------------------------------------------
# Metrics (float64 on both sides)
# ---------------------------------------------------------------------------------------------------------


def max_abs_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))))


def max_rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max|ours - ref| / max|ref| (0 when both are all zero; inf when only the reference is)."""
    err = max_abs_error(ours, ref)
    scale = float(np.max(np.abs(np.asarray(ref, np.float64))))
    if scale == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / scale


def cosine_per_position(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """[T] cosine similarity of each position's flattened vector; two zero vectors count as identical."""
    a = np.asarray(ours, np.float64).reshape(len(ours), -1)
    b = np.asarray(ref, np.float64).reshape(len(ref), -1)
    dot = np.sum(a * b, axis=1)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (na * nb)
    cos = np.where(both_zero, 1.0, np.where((na == 0) | (nb == 0), 0.0, cos))
    return cos


def log_softmax(logits_tv: np.ndarray) -> np.ndarray:
    x = np.asarray(logits_tv, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def kl_per_position(ref_logits_tv: np.ndarray, our_logits_tv: np.ndarray) -> np.ndarray:
    """[T] KL(softmax(ref) || softmax(ours)) in nats."""
    lp_ref, lp_ours = log_softmax(ref_logits_tv), log_softmax(our_logits_tv)
    p_ref = np.exp(lp_ref)
    with np.errstate(invalid="ignore"):
        # tokens the reference gives probability 0 (a -inf logit) contribute 0, not 0 * -inf
        kl = np.sum(np.where(p_ref > 0, p_ref * (lp_ref - lp_ours), 0.0), axis=-1)
    # KL >= 0; float64 rounding of identical inputs can leave -1e-17 (NaN still propagates)
    return np.maximum(kl, 0.0)


def top1_agreement(our_logits_tv: np.ndarray, ref_logits_tv: np.ndarray) -> np.ndarray:
    """bool [T]: same argmax (first maximum on ties, on both sides)."""
    return np.argmax(our_logits_tv, axis=-1) == np.argmax(ref_logits_tv, axis=-1)


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorStats:
    name: str  # "layer{L}" or "logits"
    prompt: int
    max_abs: float
    max_rel: float
    cos_min: float


@dataclasses.dataclass(frozen=True)
class LogitStats:
    prompt: int
    kl: np.ndarray  # [T] KL(ref || ours) per position
    top1: np.ndarray  # bool [T]


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Bounds for ``Report.check``; None = not checked."""

    max_logit_abs: float | None = None  # worst max|ours - ref| of the logits over all prompts
    min_top1: float | None = None  # fraction of all positions (all prompts pooled) with the same argmax
    max_kl: float | None = None  # worst KL(ref || ours) of any position
    max_layer_rel: float | None = None  # worst max_rel of every layer state


def _worst(stats: list[TensorStats]) -> TensorStats:
    """Worst over prompts, NaN counting as worst (so a NaN can never hide behind a finite value)."""
    def bad(x):
        return math.inf if math.isnan(x) else x
    arg_rel = max(stats, key=lambda s: bad(s.max_rel))
    max_abs = max((s.max_abs for s in stats), key=bad)
    cos = min((s.cos_min for s in stats), key=lambda c: -math.inf if math.isnan(c) else c)
    return TensorStats(arg_rel.name, arg_rel.prompt, max_abs, arg_rel.max_rel, cos)


def _exceeds(value: float, bound: float) -> bool:
    return not value <= bound  # NaN exceeds every bound


@dataclasses.dataclass(frozen=True)
class Report:
    tensors: tuple[TensorStats, ...]  # every (tensor, prompt)
    logit_stats: tuple[LogitStats, ...]
    n_layers: int
    ours_metadata: dict = dataclasses.field(default_factory=dict)
    ref_metadata: dict = dataclasses.field(default_factory=dict)

    def names(self) -> list[str]:
        return [f"layer{i}" for i in range(self.n_layers)] + ["logits"]

    def worst(self, name: str) -> TensorStats:
        """The worst prompt's stats of one tensor ("layer3", "logits"); the prompt is the max_rel one."""
        stats = [s for s in self.tensors if s.name == name]
        if not stats:
            raise KeyError(f"no tensor {name!r} in this report (have {self.names()})")
        return _worst(stats)

    @property
    def kl_all(self) -> np.ndarray:
        return np.concatenate([s.kl for s in self.logit_stats])

    @property
    def kl_mean(self) -> float:
        return float(np.mean(self.kl_all))

    @property
    def kl_max(self) -> float:
        return float(np.max(self.kl_all))

    @property
    def top1(self) -> float:
        agree = np.concatenate([s.top1 for s in self.logit_stats])
        return float(np.mean(agree))

    def first_layer_over(self, max_rel: float) -> int | None:
        """The first layer whose worst relative error exceeds ``max_rel`` (where divergence starts)."""
        for i in range(self.n_layers):
            if _exceeds(self.worst(f"layer{i}").max_rel, max_rel):
                return i
        return None

    def table(self) -> str:
        lines = [f"{'tensor':<10} {'max_abs':>10} {'max_rel':>10} {'cos_min':>12}  worst prompt"]
        for name in self.names():
            w = self.worst(name)
            lines.append(f"{name:<10} {w.max_abs:>10.3e} {w.max_rel:>10.3e} {w.cos_min:>12.9f}  {w.prompt}")
        n_pos = len(self.kl_all)
        agree = int(round(self.top1 * n_pos))
        lines.append(f"KL(ref || ours): mean {self.kl_mean:.3e}, max {self.kl_max:.3e} nat over {n_pos} positions; "
                     f"top-1 agreement {agree}/{n_pos} ({100 * self.top1:.1f}%)")
        for who, meta in (("ours", self.ours_metadata), ("ref", self.ref_metadata)):
            if meta:
                keys = ("implementation", "config", "numerics", "model_revision")
                lines.append(f"{who}: " + "; ".join(f"{k}={meta[k]}" for k in keys if k in meta))
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """PNG of the per-layer relative error (each prompt, and the worst), logits as the last point."""
        from matplotlib.figure import Figure  # no pyplot: no global figure state, works headless

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        names = self.names()
        x = np.arange(len(names))
        # exact agreement (0) has no place on a log axis; draw it at the floor
        floor = 1e-16
        fig = Figure(figsize=(7, 4), dpi=110)
        ax = fig.add_subplot()
        prompts = sorted({s.prompt for s in self.tensors})
        many = len(prompts) > 8  # then thin grey lines without a legend entry each
        for p in prompts:
            by_name = {s.name: s.max_rel for s in self.tensors if s.prompt == p}
            style = dict(color="0.6", lw=0.5) if many else dict(lw=0.8, alpha=0.6, marker=".", label=f"prompt {p}")
            ax.plot(x, [max(by_name[n], floor) for n in names], **style)
        ax.plot(x, [max(self.worst(n).max_rel, floor) for n in names], lw=2, color="k", label="worst")
        ax.set_yscale("log")
        ax.set_xticks(x, [n.removeprefix("layer") for n in names], fontsize=7)
        ax.set_xlabel("layer (state after the block)")
        ax.set_ylabel("max |ours - ref| / max |ref|")
        ax.set_title(f"per-layer error; KL mean {self.kl_mean:.2e}, top-1 {100 * self.top1:.1f}%", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, format="png")
        return path

    def check(self, thresholds: Thresholds) -> list[str]:
        """Human-readable violations of ``thresholds`` (empty: all bounds hold)."""
        out = []
        th = thresholds
        if th.max_logit_abs is not None:
            w = self.worst("logits")
            if _exceeds(w.max_abs, th.max_logit_abs):
                out.append(f"logits: max abs error {w.max_abs:.3e} > {th.max_logit_abs:g} (prompt {w.prompt})")
        if th.min_top1 is not None and not self.top1 >= th.min_top1:
            out.append(f"top-1 agreement {self.top1:.4f} < {th.min_top1:g}")
        if th.max_kl is not None and _exceeds(self.kl_max, th.max_kl):
            worst = max(self.logit_stats, key=lambda s: np.nan_to_num(np.max(s.kl), nan=np.inf))
            pos = int(np.nanargmax(np.nan_to_num(worst.kl, nan=np.inf)))
            out.append(f"KL(ref || ours) max {self.kl_max:.3e} > {th.max_kl:g} (prompt {worst.prompt}, position {pos})")
        if th.max_layer_rel is not None:
            first = self.first_layer_over(th.max_layer_rel)
            for i in range(self.n_layers):
                w = self.worst(f"layer{i}")
                if _exceeds(w.max_rel, th.max_layer_rel):
                    tag = " (first layer over the bound)" if i == first else ""
                    out.append(f"layer{i}: max relative error {w.max_rel:.3e} > {th.max_layer_rel:g} "
                               f"(prompt {w.prompt}){tag}")
        return out


def _as_dump(d: Dump | str | Path) -> Dump:
    return d if isinstance(d, Dump) else load_dump(d)


def _check_same(name: str, a: np.ndarray, b: np.ndarray, ours: Dump, ref: Dump) -> None:
    if a.shape != b.shape:
        raise DumpError(f"{name}: shape mismatch, ours {_shape(a)} ({ours.source}) vs ref {_shape(b)} ({ref.source})")


def compare_dumps(ours: Dump | str | Path, ref: Dump | str | Path, *, layers: bool = True) -> Report:
    """Compare two dumps prompt by prompt; raises ``DumpError`` naming the tensor on any mismatch."""
    ours, ref = _as_dump(ours), _as_dump(ref)
    if len(ours.prompts) != len(ref.prompts):
        raise DumpError(f"ours ({ours.source}) holds {len(ours.prompts)} prompts, ref ({ref.source}) "
                        f"{len(ref.prompts)}: prompt{min(len(ours.prompts), len(ref.prompts))}.* is missing in one")
    if layers:
        for who, d in (("ref", ref), ("ours", ours)):
            if d.n_layers == 0:
                raise DumpError(f"{who} ({d.source}) holds no prompt{{i}}.layer{{L}}.hidden tensors; "
                                "compare with layers=False (--no-layers) or dump them")
    stats: list[TensorStats] = []
    logit_stats: list[LogitStats] = []
    for i, (a, b) in enumerate(zip(ours.prompts, ref.prompts)):
        _check_same(f"prompt{i}.tokens", a.tokens, b.tokens, ours, ref)
        if not np.array_equal(a.tokens, b.tokens):
            j = int(np.argmax(a.tokens != b.tokens))
            raise DumpError(f"prompt{i}.tokens differ at position {j}: ours {a.tokens[j]}, ref {b.tokens[j]} "
                            "(the dumps ran different prompts)")
        if layers:
            for layer in range(max(len(a.hidden), len(b.hidden))):
                name = f"prompt{i}.layer{layer}.hidden"
                ha = a.hidden[layer] if layer < len(a.hidden) else None
                hb = b.hidden[layer] if layer < len(b.hidden) else None
                if ha is None or hb is None:
                    raise DumpError(f"{name}: present in only one dump, ours {_shape(ha)} vs ref {_shape(hb)} "
                                    f"(ours has {len(a.hidden)} layers, ref {len(b.hidden)})")
                _check_same(name, ha, hb, ours, ref)
                stats.append(TensorStats(f"layer{layer}", i, max_abs_error(ha, hb), max_rel_error(ha, hb),
                                         float(np.min(cosine_per_position(ha, hb)))))
        _check_same(f"prompt{i}.logits", a.logits, b.logits, ours, ref)
        stats.append(TensorStats("logits", i, max_abs_error(a.logits, b.logits), max_rel_error(a.logits, b.logits),
                                 float(np.min(cosine_per_position(a.logits, b.logits)))))
        logit_stats.append(LogitStats(i, kl_per_position(b.logits, a.logits), top1_agreement(a.logits, b.logits)))
    return Report(tuple(stats), tuple(logit_stats), ours.n_layers if layers else 0, ours.metadata, ref.metadata)


# ---------------------------------------------------------------------------------------------------------
# Running our model
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def _prefill_fn():
    """The jitted whole-prompt prefill (built once per process; cfg/numerics/max_len are static)."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.model.cache import init_cache
    from deepinfer_jax.model.transformer import forward_hidden, lm_head

    def prefill(params, tokens_bt, rows_btnc, cfg, numerics, max_len, layers):
        t = tokens_bt.shape[1]
        cache = init_cache(cfg, 1, max_len, numerics)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        out = forward_hidden(params, cfg, cache, tokens_bt, pos, rows_btnc, numerics, None, layers)
        states = jnp.stack([s[0].astype(jnp.float32) for s in out[2]]) if layers else jnp.zeros((0,))
        return lm_head(params, out[0])[0], states

    from deepinfer_jax.platform import step_compiler_options

    # rounding as the program says, as the engine's own programs do (platform.step_compiler_options)
    return jax.jit(prefill, static_argnums=(3, 4, 5, 6), compiler_options=step_compiler_options() or None)


def model_revision(ckpt_dir: str | Path) -> str:
    """The checkpoint's revision: the Hugging Face snapshot commit when the directory is one, else a
    sha256 of config.json + the index json (file names and total size, not the 510 GB of weights)."""
    ckpt_dir = Path(ckpt_dir).resolve()
    if ckpt_dir.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", ckpt_dir.name):
        return f"hf:{ckpt_dir.name}"
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        f = ckpt_dir / name
        if f.exists():
            h.update(f.read_bytes())
    return f"sha256:{h.hexdigest()[:16]}"


def dump_activations(params: dict, cfg, prompts: list[list[int]], token_map: np.ndarray, numerics,
                     out_path: str | Path | None, *, layers: bool = True, metadata: dict | None = None,
                     progress: bool = False) -> Dump:
    """Run our model on each prompt (one prefill from an empty cache, positions 0..T-1) and dump it.

    numerics: a ``Numerics`` or its name ("exact", "reference", "reference-bf16-kv"). metadata: extra
    entries (``config``, ``model_revision``...) merged over the defaults. Writes ``out_path`` unless None;
    returns the dump. One compile per distinct prompt length.
    """
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.model.engram_hash import engram_rows
    from deepinfer_jax.model.numerics import as_numerics

    numerics = as_numerics(numerics)
    if not prompts:
        raise ValueError("no prompts to dump")
    token_map = np.asarray(token_map)
    checked = []
    for i, ids in enumerate(prompts):
        ids = np.asarray(ids, np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError(f"prompt {i}: expected a non-empty list of token ids, got shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"prompt {i}: token ids must lie in [0, {cfg.vocab_size}), got [{ids.min()}, {ids.max()}]")
        checked.append(ids)
    max_len = max(len(ids) for ids in checked)
    pad = int(token_map[cfg.engram_pad_token_id])
    fn = _prefill_fn()
    out = []
    for i, ids in enumerate(checked):
        rows = engram_rows(cfg, token_map[ids], np.zeros(0, np.int64), pad)
        logits, states = fn(params, jnp.asarray(ids[None], jnp.int32), jnp.asarray(rows[None]), cfg, numerics,
                            max_len, layers)
        hidden = tuple(np.asarray(states[layer]) for layer in range(states.shape[0])) if layers else ()
        out.append(PromptDump(ids, np.asarray(logits, np.float32), hidden))
        if progress:
            print(f"dump: prompt {i} ({len(ids)} tokens) done", file=sys.stderr)
    meta = {"format": FORMAT, "implementation": "deepinfer-jax",
            "config": f"{cfg.variant} {cfg.num_hidden_layers}L D{cfg.hidden_size} V{cfg.vocab_size}",
            "numerics": dataclasses.asdict(numerics), "jax_version": jax.__version__,
            "backend": jax.default_backend()}
    meta.update(metadata or {})
    dump = Dump(tuple(out), meta, str(out_path) if out_path is not None else "<memory>")
    if out_path is not None:
        save_dump(dump, out_path)
    return dump


# ---------------------------------------------------------------------------------------------------------
# Prompts file
# ---------------------------------------------------------------------------------------------------------

_PROMPT_KEYS = {"id", "token_ids", "prompt"}


def read_prompts(path: str | Path, tokenizer_dir: str | Path | None = None) -> list[list[int]]:
    """Token ids of each non-empty line of a JSONL file: ``{"token_ids": [..]}``, ``{"prompt": "text"}``
    (encoded with ``tokenizer_dir``'s tokenizer.json, no BOS added) or a bare JSON list of ids.
    An optional ``"id"`` is ignored; any other key is an error naming the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    tokenizer = None
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if isinstance(rec, list):
            rec = {"token_ids": rec}
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: expected an object or a list of token ids")
        unknown = sorted(set(rec) - _PROMPT_KEYS)
        if unknown or ("token_ids" in rec) == ("prompt" in rec):
            raise ValueError(f"{path}:{n}: give exactly one of 'token_ids' or 'prompt' (and optionally 'id'); "
                             f"got keys {sorted(rec)}")
        if "token_ids" in rec:
            ids = rec["token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in ids):
                raise ValueError(f"{path}:{n}: 'token_ids' must be a non-empty list of integers")
        else:
            if not isinstance(rec["prompt"], str) or not rec["prompt"]:
                raise ValueError(f"{path}:{n}: 'prompt' must be a non-empty string")
            if tokenizer is None:
                if tokenizer_dir is None:
                    raise ValueError(f"{path}:{n}: a text prompt needs the model directory's tokenizer")
                from deepinfer_jax.engine.tokenizer import Tokenizer

                tokenizer = Tokenizer.from_dir(tokenizer_dir)
            ids = tokenizer.encode(rec["prompt"])
            if not ids:
                raise ValueError(f"{path}:{n}: the prompt encodes to no tokens")
        out.append([int(t) for t in ids])
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ---------------------------------------------------------------------------------------------------------
# CLI: deepinfer-jax dump / deepinfer-jax compare
# ---------------------------------------------------------------------------------------------------------


def _run_ours(model: str, prompts: list[list[int]], numerics: str, layers: bool, out: str | None, quiet: bool) -> Dump:
    from deepinfer_jax.checkpoint.loader import load_params
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.token_map import compressed_token_map

    cfg = ModelConfig.from_json(model)
    params = load_params(model, cfg, progress=not quiet)
    table, _ = compressed_token_map(Path(model) / "tokenizer.json", cfg.vocab_size)
    meta = {"config": Path(model).resolve().name, "model_revision": model_revision(model)}
    return dump_activations(params, cfg, prompts, table, numerics, out, layers=layers, metadata=meta,
                            progress=not quiet)


def _dump_cmd(args: argparse.Namespace) -> int:
    try:
        prompts = read_prompts(args.prompts, args.model)
        _run_ours(args.model, prompts, args.numerics, not args.no_layers, args.out, args.quiet)
    except (OSError, ValueError) as e:
        print(f"deepinfer-jax dump: {e}", file=sys.stderr)
        return 2
    print(f"deepinfer-jax dump: {len(prompts)} prompts -> {args.out}", file=sys.stderr)
    return 0


def thresholds_of(args: argparse.Namespace) -> Thresholds:
    return Thresholds(args.max_logit_abs, args.min_top1, args.max_kl, args.max_layer_rel)


def _compare_cmd(args: argparse.Namespace) -> int:
    if args.ours is not None and (args.dump or args.prompts):
        print("deepinfer-jax compare: --dump and --prompts need --model (--ours compares an existing dump)",
              file=sys.stderr)
        return 2
    try:
        ref = load_dump(args.ref)
        layers = not args.no_layers
        if args.ours is not None:
            ours = load_dump(args.ours)
        else:
            prompts = (read_prompts(args.prompts, args.model) if args.prompts is not None
                       else [p.tokens.tolist() for p in ref.prompts])
            ours = _run_ours(args.model, prompts, args.numerics, layers, args.dump, args.quiet)
        report = compare_dumps(ours, ref, layers=layers)
    except (OSError, ValueError) as e:  # DumpError is a ValueError
        print(f"deepinfer-jax compare: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if args.plot:
        print(f"plot -> {report.plot(args.plot)}")
    violations = report.check(thresholds_of(args))
    for v in violations:
        print(f"THRESHOLD VIOLATED: {v}")
    return 1 if violations else 0


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from deepinfer_jax.model.numerics import ENGINE_NUMERICS

    p.add_argument("--numerics", default="exact", choices=ENGINE_NUMERICS,
                   help="exact: fp32, no fake quantization (default; for float64/fp32 references); reference: "
                        "BF16 + the official FP8/FP4 fake quantization")
    p.add_argument("--no-layers", action="store_true", help="logits only (no per-layer states)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def register_cli(subparsers: Any) -> None:
    """Add ``dump`` and ``compare`` to the ``deepinfer-jax`` subcommands."""
    d = subparsers.add_parser("dump", help="run the model on prompts and dump logits and per-layer states",
                              description="Dump format: " + NAMING + " (see deepinfer_jax/compare.py).")
    d.add_argument("--model", required=True, help="checkpoint directory")
    d.add_argument("--prompts", required=True, help="JSONL: {\"token_ids\": [...]} or {\"prompt\": \"text\"} per line")
    d.add_argument("--out", required=True, help="dump file (.safetensors or .npz)")
    _add_model_args(d)
    d.set_defaults(func=_dump_cmd)

    c = subparsers.add_parser("compare", help="compare our model (or a dump of it) against a reference dump",
                              description="Prints per-layer max abs / max rel error / cosine and logit KL / "
                                          "top-1; exit status 1 when a given threshold is violated, 2 on errors.")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory: run our model on the prompts")
    src.add_argument("--ours", help="an existing dump of ours instead of running --model")
    c.add_argument("--prompts", help="JSONL prompts (default: the reference dump's prompt{i}.tokens)")
    c.add_argument("--ref", required=True, help="reference dump (.safetensors or .npz)")
    c.add_argument("--dump", help="also write our dump here")
    c.add_argument("--plot", help="write the per-layer error curve (PNG)")
    c.add_argument("--max-logit-abs", type=float, help="bound on max |ours - ref| of the logits")
    c.add_argument("--min-top1", type=float, help="lower bound on the top-1 agreement fraction")
    c.add_argument("--max-kl", type=float, help="bound on the largest per-position KL(ref || ours)")
    c.add_argument("--max-layer-rel", type=float, help="bound on every layer's max relative error")
    _add_model_args(c)
    c.set_defaults(func=_compare_cmd)


def main(argv: Iterable[str] | None = None) -> int:
    """Standalone entry (``python -m deepinfer_jax.compare compare ...``) for when cli.py is not wired."""
    ap = argparse.ArgumentParser(prog="deepinfer-jax")
    register_cli(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(None if argv is None else list(argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
