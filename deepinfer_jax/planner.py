"""Memory planner: bytes per device for weights, KV/state caches and activations on a mesh.

``plan_memory(cfg, mesh, slots, max_len, numerics)`` needs no devices and allocates nothing: weights
come from the tensor list laid out by the sharding rules (padded tables included), caches from
``cache_shapes`` (slots split over ``data``), activations from an estimate of the largest live set of
one model step of the XLA path (documented term by term in ``_activation_terms``). ``check_fits``
refuses a plan that does not fit and says what would.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
from typing import Sequence

import jax.numpy as jnp

from deepinfer_jax.config import AttnMode, ModelConfig
from deepinfer_jax.model.cache import cache_shapes, compressed_entries
from deepinfer_jax.model.linear import held_as_bf16
from deepinfer_jax.model.mhc import is_stream_mix_fn
from deepinfer_jax.model.numerics import ENGINE_NUMERICS, Numerics, as_numerics
from deepinfer_jax.sharding import (DEFAULT_RULES, MeshSpec, ShardingRules, abstract_params, leaf_spec, local_shape,
                                    tree_paths, validate_model_mesh)
from pallas_kernels.indexer.xla import KEY_BLOCK as INDEX_KEY_BLOCK


class PlanError(MemoryError):
    """A plan that does not fit on the device (the message says what would)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:,.3f} GiB" if n >= 2**27 else f"{n / 2**20:,.3f} MiB"


def parse_bytes(text: str | int) -> int:
    """'139GiB', '80GB', '512MiB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read a byte count from {text!r} (e.g. 139GiB, 80GB, 512MiB)")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(float(m.group(1)) * scale[unit])


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    mesh: MeshSpec
    slots: int
    max_len: int
    step_tokens: int
    numerics: Numerics
    weights: tuple[tuple[str, int], ...]  # (what, bytes per device)
    caches: tuple[tuple[str, int], ...]
    activations: tuple[tuple[str, int], ...]
    # inputs needed to re-plan in check_fits' suggestions
    _cfg: ModelConfig = dataclasses.field(repr=False, compare=False, default=None)
    _groups: tuple[str, ...] = dataclasses.field(repr=False, compare=False, default=("backbone",))
    _rules: ShardingRules = dataclasses.field(repr=False, compare=False, default=DEFAULT_RULES)
    _extra_per_slot: int = dataclasses.field(repr=False, compare=False, default=0)
    _experts_path: str = dataclasses.field(repr=False, compare=False, default="gather")
    _head_tokens: int | None = dataclasses.field(repr=False, compare=False, default=None)
    _sampler: bool = dataclasses.field(repr=False, compare=False, default=False)
    _dense_bf16: bool = dataclasses.field(repr=False, compare=False, default=False)
    _stream_dot_parts: bool = dataclasses.field(repr=False, compare=False, default=False)

    @property
    def weight_bytes(self) -> int:
        return sum(b for _, b in self.weights)

    @property
    def cache_bytes(self) -> int:
        return sum(b for _, b in self.caches)

    @property
    def activation_bytes(self) -> int:
        return sum(b for _, b in self.activations)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.activation_bytes

    def table(self) -> str:
        plural = "s" if self.mesh.size > 1 else ""
        head = (f"memory per device on mesh {self.mesh} ({self.mesh.size} device{plural}): {self.slots} slots x "
                f"max_len {self.max_len}, {self.step_tokens} tokens per slot per step, "
                f"{self.numerics.act_dtype}{' + quantized KV' if self.numerics.kv_quant else ''}")
        rows = [head, "-" * len(head)]
        for title, items, total in (("weights", self.weights, self.weight_bytes),
                                    ("KV / state caches", self.caches, self.cache_bytes),
                                    ("activations (estimate, peak of one step)", self.activations,
                                     self.activation_bytes)):
            rows.append(f"{title:<48}{_gib(total):>16}")
            rows += [f"    {what:<44}{_gib(b):>16}" for what, b in items if b]
        rows.append(f"{'total':<48}{_gib(self.total_bytes):>16}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def _replan(self, **changes) -> "MemoryPlan":
        args = dict(cfg=self._cfg, mesh_shape=self.mesh, slots=self.slots, max_len=self.max_len,
                    numerics=self.numerics, step_tokens=self.step_tokens, groups=self._groups, rules=self._rules,
                    extra_per_slot_bytes=self._extra_per_slot, experts_path=self._experts_path,
                    head_tokens=self._head_tokens, sampler=self._sampler, dense_bf16=self._dense_bf16,
                    stream_dot_parts=self._stream_dot_parts)
        args.update(changes)
        return plan_memory(**args)

    def max_slots(self, device_bytes: int) -> int:
        """The most slots (a multiple of the data axis) that fit at this max_len; 0 if none."""
        step = self.mesh.axis_size(self._rules.mesh_axes("batch"))
        lo, hi = 0, 1
        while self._replan(slots=hi * step).total_bytes <= device_bytes:
            lo, hi = hi, hi * 2
            if hi > 2**24:
                break
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._replan(slots=mid * step).total_bytes <= device_bytes else (lo, mid)
        return lo * step

    def max_len_that_fits(self, device_bytes: int) -> int:
        """The longest max_len that fits with these slots (0 if none); caches grow linearly in it."""
        if self._replan(max_len=self.step_tokens).total_bytes > device_bytes:
            return 0
        lo, hi = self.step_tokens, self.max_len
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._replan(max_len=mid).total_bytes <= device_bytes else (lo, mid)
        return lo

    def check_fits(self, device_bytes: int | str) -> None:
        """Raise PlanError naming what does not fit and what would, if the plan exceeds ``device_bytes``."""
        device_bytes = parse_bytes(device_bytes)
        if self.total_bytes <= device_bytes:
            return
        need = (f"needs {_gib(self.total_bytes)} per device (weights {_gib(self.weight_bytes)}, KV/state caches "
                f"{_gib(self.cache_bytes)}, activations {_gib(self.activation_bytes)}) but the device has "
                f"{_gib(device_bytes)}")
        where = f"{self.slots} slots x max_len {self.max_len} on mesh {self.mesh}"
        if self.weight_bytes >= device_bytes:
            biggest = max(self.weights, key=lambda kv: kv[1])
            raise PlanError(f"{where} does not fit: {need}. The weights alone do not fit (largest: {biggest[0]}, "
                            f"{_gib(biggest[1])}); {self._bigger_meshes(device_bytes)}")
        options = []
        n = self.max_slots(device_bytes)
        if n:
            options.append(f"{n} slots at max_len {self.max_len}")
        length = self.max_len_that_fits(device_bytes)
        if length:
            options.append(f"max_len {length} with {self.slots} slots")
        if self.step_tokens > 1 and self._replan(step_tokens=1).total_bytes <= device_bytes:
            options.append("decode-only steps (step_tokens=1; a smaller prefill chunk)")
        would = ("would fit: " + "; or ".join(options)) if options else self._bigger_meshes(device_bytes)
        raise PlanError(f"{where} does not fit: {need}. {would}")

    def _bigger_meshes(self, device_bytes: int) -> str:
        tried = []
        for axis in ("expert", "tensor"):
            for factor in (2, 4, 8):
                cand = dataclasses.replace(self.mesh, **{axis: getattr(self.mesh, axis) * factor})
                try:
                    p = self._replan(mesh_shape=cand)
                except ValueError:
                    continue
                tried.append((p.total_bytes, cand))
                if p.total_bytes <= device_bytes:
                    return f"a mesh with {axis}={getattr(cand, axis)} ({cand}) would need {_gib(p.total_bytes)}"
        if tried:
            best = min(tried, key=lambda t: t[0])
            return f"no larger mesh tried fits either (best: {best[1]}, {_gib(best[0])} per device)"
        return "no larger mesh splits this model"


def _weight_group(path: tuple) -> str:
    rel = path[2:] if path[0] in ("layers", "mtp") else path
    dspark = " (DSpark)" if path[0] == "mtp" else ""
    if "experts" in rel and "shared_experts" not in rel:
        return "routed experts" + dspark
    if rel[0] == "engram":
        return "Engram tables and projections"
    if path[0] in ("embed", "head") or rel[0] == "markov_head":
        return "embedding + LM head" + dspark
    if rel[0] == "attn":
        return "attention (q/kv/o, compressor, indexer)" + dspark
    if rel[0] == "ffn":
        return "shared expert + router" + dspark
    return "mHC, norms and the rest" + dspark


def _local_bytes(tree, ms: MeshSpec, rules: ShardingRules, cfg: ModelConfig, group_of) -> dict[str, int]:
    out: dict[str, int] = {}
    for path, sd in tree_paths(tree):
        spec = leaf_spec(path, sd.shape, ms, rules, cfg)
        n = math.prod(local_shape(sd.shape, spec, ms)) * jnp.dtype(sd.dtype).itemsize
        key = group_of(path)
        out[key] = out.get(key, 0) + n
    return out


def _cache_group(path: tuple) -> str:
    if path[0] == "window":
        return "sliding-window KV rings"
    if path[2] == "kv":
        return "compressed KV"
    if path[2] == "index_k":
        return "indexer keys"
    return "compressor pending state"


@functools.lru_cache(maxsize=32)
def _weight_bytes(cfg: ModelConfig, ms: MeshSpec, rules: ShardingRules, groups: tuple[str, ...]) -> dict[str, int]:
    params = abstract_params(cfg, groups, mesh=ms, rules=rules)
    return _local_bytes(params, ms, rules, cfg, _weight_group)


EXPERT_PATHS = ("gather", "grouped")


@functools.lru_cache(maxsize=32)
def _dequantized_layer_elements(cfg: ModelConfig, ms: MeshSpec, rules: ShardingRules) -> int:
    """Elements per device of one layer's non-expert matrices (the largest layer): the XLA path
    dequantizes (FP8) or casts (BF16) each to the compute dtype inside the step. Routed experts are
    counted with their path; the Engram table is read by rows, never whole."""
    params = abstract_params(cfg, ("backbone",), mesh=ms, rules=rules)
    worst = 0
    for layer_id, layer in enumerate(params["layers"]):
        n = 0
        for path, sd in tree_paths(layer):
            if len(sd.shape) != 2 or path[-1] != "weight" or "experts" in path or path[:2] == ("engram", "embed"):
                continue
            full = ("layers", layer_id) + path
            n += math.prod(local_shape(sd.shape, leaf_spec(full, sd.shape, ms, rules, cfg), ms))
        worst = max(worst, n)
    return worst


def _dense_fp8_bytes(cfg: ModelConfig, ms: MeshSpec, rules: ShardingRules, groups: tuple[str, ...]) -> int:
    """Bytes per device of the dense FP8 linears that ``linear.dequantize_dense_fp8`` holds as bf16 (one
    byte per element more than stored; which ones: ``linear.held_as_bf16``)."""
    params = abstract_params(cfg, groups, mesh=ms, rules=rules)
    return sum(math.prod(local_shape(sd.shape, leaf_spec(path, sd.shape, ms, rules, cfg), ms))
               for path, sd in tree_paths(params) if held_as_bf16(path, sd))


def _stream_dot_parts_bytes(cfg: ModelConfig, ms: MeshSpec, rules: ShardingRules, groups: tuple[str, ...]) -> int:
    """Bytes per device of the bf16 parts ``mhc.prepare_stream_dots`` holds beside each mHC ``hc_*_fn``
    (3 bf16 values per fp32 one, laid out as fn)."""
    params = abstract_params(cfg, groups, mesh=ms, rules=rules)
    return sum(3 * 2 * math.prod(local_shape(sd.shape, leaf_spec(path, sd.shape, ms, rules, cfg), ms))
               for path, sd in tree_paths(params) if is_stream_mix_fn(path[-1], sd))


def _activation_terms(cfg: ModelConfig, ms: MeshSpec, rules: ShardingRules, slots: int, max_len: int,
                      step_tokens: int, numerics: Numerics, experts_path: str, head_tokens: int | None = None,
                      sampler: bool = False) -> list[tuple[str, int]]:
    """The largest live set of one step of the XLA path, per device, as stages that do not overlap.

    Live at once: the 4-stream residual (fp32 copies in mHC), one layer's dequantized weights, the
    fp32 head copy, the largest of the stages below (each with its transient fp32 copies; the shapes
    are those of model/*.py) and the step's logits. A 50% margin covers what XLA's buffer assignment
    adds on top: it overlaps the weight dequantizations of neighbouring layers and keeps fusion
    temporaries (measured on the CPU compile of the test config, where the estimate without margin
    came out between 0.92x and 1.6x the compiled temp bytes; tests/test_planner.py checks the
    estimate with margin covers them and stays within 2.5x). GPU buffer assignment differs in detail;
    the dominant terms at V4.1 size (experts, indexer, head) are the same arithmetic."""
    f32 = 4
    act = jnp.dtype(numerics.dtype).itemsize
    wdt = 4 if numerics.dtype == jnp.float32 else 2  # dequantized weight dtype of the XLA path
    b_loc = -(-slots // ms.axis_size(rules.mesh_axes("batch")))
    m = b_loc * step_tokens
    d, hc = cfg.hidden_size, cfg.hc_mult
    h_loc = cfg.num_attention_heads // ms.axis_size(rules.mesh_axes("heads"))
    v_loc = -(-cfg.vocab_size // ms.axis_size(rules.mesh_axes("vocab")))
    w, hd, topk = cfg.sliding_window, cfg.head_dim, cfg.index_topk
    stream = 3 * m * hc * d * f32  # x, the mixed streams and the new streams of mhc.post_apply

    # attention: queries, window + selected keys (fp32), scores and exponentials over W+T+K keys,
    # plus for indexed layers the index scores over every compressed entry of the longest source (the
    # fp32 per-head dots of one key block of the XLA path at a time: pallas_kernels/indexer/xla.py).
    keys = w + step_tokens + topk
    attn = (m * h_loc * hd * f32 + b_loc * (w + step_tokens) * hd * f32 + m * topk * hd * f32
            + 2 * m * h_loc * keys * f32 + 2 * m * h_loc * hd * f32)
    index = 0
    for plan in cfg.layer_plans:
        if plan.mode in (AttnMode.FULL, AttnMode.REINDEX):
            s = compressed_entries(max_len, plan.ratio)
            index = max(index, m * cfg.index_n_heads * min(s, INDEX_KEY_BLOCK) * f32 + 2 * m * s * f32 + m * s
                        + b_loc * s * cfg.index_head_dim * act)
    # routed experts. gather path (model.moe.routed_experts_gather): each token's k experts dequantized
    # per matrix ([M, k, inter, D]; the fp32 nibble tables of dequant_fp4 while one matrix is built, the
    # three matrices in wdt). grouped: a grouped GEMM reading the stored weights in place, so only the
    # [M, k, inter] hidden and [M, k, D] outputs. Under expert parallelism every device evaluates all
    # of its data shard's tokens.
    k, inter = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    experts = m * k * (2 * inter + d) * f32
    if experts_path == "gather":
        experts += m * k * inter * d * (3 * wdt + 2 * f32)
    # LM head: fp32 logits of the local vocabulary slice (its fp32 weight copy is counted as always
    # live: the convert does not depend on the step's activations, so XLA may schedule it anywhere).
    # ``head_tokens``: tokens per slot the head runs on (the engine's steps: 1, the last position).
    m_head = b_loc * (step_tokens if head_tokens is None else min(head_tokens, step_tokens))
    head = m_head * v_loc * f32
    # The engine's sampler works on whole vocabulary rows (gathered over the vocab axes): the gathered
    # logits, the penalised copy and log-softmax its first stage hands on, the renormalised
    # probabilities, the keep masks and the Gumbel noise of the later programs: ~6 fp32 [slots, V] arrays.
    v_whole = cfg.vocab_size
    sample = 6 * b_loc * v_whole * f32 if sampler else 0
    engram = (m * cfg.engram_columns * cfg.engram_head_dim * f32 + m * (hc + 1) * d * f32
              if cfg.engram_layer_ids else 0)
    stages = {"attention": attn, "indexer scores": index, f"routed experts ({experts_path} path)": experts,
              "LM head": head, "Engram": engram, "sampler": sample}
    worst = max(stages, key=stages.get)
    terms = [("residual streams (4 x fp32 copies)", stream),
             ("dequantized weights of one layer", _dequantized_layer_elements(cfg, ms, rules) * wdt),
             ("fp32 copy of the LM head rows", v_loc * d * f32),
             (f"largest stage: {worst}", stages[worst]),
             ("step outputs (fp32 logits)", m_head * v_loc * f32)]
    return terms + [("buffer-assignment margin (50%)", sum(b for _, b in terms) // 2)]


def plan_memory(cfg: ModelConfig, mesh_shape: MeshSpec | str | Sequence[int], slots: int, max_len: int,
                numerics: Numerics | str = "reference", *, step_tokens: int = 1, groups: Sequence[str] = ("backbone",),
                rules: ShardingRules = DEFAULT_RULES, extra_per_slot_bytes: int = 0,
                experts_path: str = "gather", head_tokens: int | None = None, sampler: bool = False,
                dense_bf16: bool = False, stream_dot_parts: bool = False) -> MemoryPlan:
    """Bytes per device. ``step_tokens``: tokens per slot in one step (1 = decode, the prefill chunk
    otherwise). ``extra_per_slot_bytes``: the engine's own per-slot device state (e.g. sampler counts).
    ``experts_path``: "gather" (the XLA path today) or "grouped" (a grouped-GEMM kernel).
    ``head_tokens``: tokens per slot the LM head runs on (None: every step token, as ``forward``; the
    engine passes 1). ``sampler``: count the engine's sampler over whole vocabulary rows.
    ``dense_bf16``: the dense FP8 linears are held dequantized (the GPU engine, ``dequantize_dense_fp8``).
    ``stream_dot_parts``: mHC's stream-mix weights are held with their bf16 parts too (the engine, with
    ``Numerics.bf16_stream_dot``: ``mhc.prepare_stream_dots``)."""
    if experts_path not in EXPERT_PATHS:
        raise ValueError(f"experts_path must be one of {EXPERT_PATHS}, got {experts_path!r}")
    ms = MeshSpec.parse(mesh_shape)
    num = as_numerics(numerics)
    if slots < 1 or max_len < 1 or step_tokens < 1:
        raise ValueError(f"slots, max_len and step_tokens must be positive (got {slots}, {max_len}, {step_tokens})")
    validate_model_mesh(cfg, ms, rules, slots=slots)
    weights = _weight_bytes(cfg, ms, rules, tuple(groups))
    if dense_bf16:
        weights["dense FP8 linears held as bf16 (+1 B each)"] = _dense_fp8_bytes(cfg, ms, rules, tuple(groups))
    if stream_dot_parts:
        weights["mHC stream-mix weights' bf16 parts"] = _stream_dot_parts_bytes(cfg, ms, rules, tuple(groups))
    caches = _local_bytes(cache_shapes(cfg, slots, max_len, num), ms, rules, cfg, _cache_group)
    if extra_per_slot_bytes:
        caches["engine per-slot state"] = extra_per_slot_bytes * (slots // ms.axis_size(rules.mesh_axes("batch")))
    acts = _activation_terms(cfg, ms, rules, slots, max_len, step_tokens, num, experts_path, head_tokens, sampler)
    return MemoryPlan(ms, slots, max_len, step_tokens, num, tuple(sorted(weights.items(), key=lambda kv: -kv[1])),
                      tuple(sorted(caches.items(), key=lambda kv: -kv[1])), tuple(acts), cfg, tuple(groups), rules,
                      extra_per_slot_bytes, experts_path, head_tokens, sampler, dense_bf16, stream_dot_parts)


# ------------------------------------------------------------------------------------------------------
# CLI


def plan(config: str, mesh: str = "data=1", slots: int = 8, max_len: int = 4096, numerics: str = "reference",
         step_tokens: int = 1, groups: Sequence[str] = ("backbone",), device_memory: str | int | None = None,
         experts_path: str = "gather", out=None) -> MemoryPlan:
    """Print the plan's table; with ``device_memory``, raise PlanError if it does not fit."""
    out = out or sys.stdout
    cfg = ModelConfig.from_json(config)
    p = plan_memory(cfg, mesh, slots, max_len, numerics, step_tokens=step_tokens, groups=groups,
                    experts_path=experts_path)
    print(p.table(), file=out)
    if device_memory is not None:
        p.check_fits(device_memory)
        print(f"fits in {_gib(parse_bytes(device_memory))} per device", file=out)
    return p


def _plan_cli(args: argparse.Namespace) -> int:
    try:
        plan(args.config, args.mesh, args.slots, args.max_len, args.numerics, args.step_tokens,
             tuple(args.groups.split(",")), args.device_memory, args.experts_path)
    except (PlanError, ValueError) as e:
        print(f"deepinfer-jax plan: {e}", file=sys.stderr)
        return 2
    return 0


def register_cli(subparsers) -> None:
    """Adds ``deepinfer-jax plan`` to the CLI's subparsers."""
    from deepinfer_jax.cli import DEFAULT_TINY

    p = subparsers.add_parser("plan", help="bytes per device for weights, caches and activations on a mesh",
                              description="Prints the memory plan; with --device-memory, exits 2 with what "
                                          "would fit when it does not.")
    p.add_argument("--config", default=str(DEFAULT_TINY), help="config.json or a checkpoint directory")
    p.add_argument("--mesh", default="data=1", help="e.g. data=1,tensor=2,expert=4")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--step-tokens", type=int, default=1, help="tokens per slot per step (the prefill chunk)")
    p.add_argument("--numerics", default="reference", choices=sorted(ENGINE_NUMERICS))
    p.add_argument("--groups", default="backbone", help="comma-separated: backbone,dspark,image")
    p.add_argument("--device-memory", default=None, help="usable bytes per device, e.g. 139GiB")
    p.add_argument("--experts-path", default="gather", choices=EXPERT_PATHS,
                   help="routed-expert implementation the activations are planned for")
    p.set_defaults(func=_plan_cli)


__all__ = ["MemoryPlan", "PlanError", "plan_memory", "plan", "parse_bytes", "register_cli"]
