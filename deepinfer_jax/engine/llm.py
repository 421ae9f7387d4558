"""The public offline API, in the shape of vLLM/SGLang's: ``LLM(path).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from deepinfer_jax.checkpoint.loader import load_params
from deepinfer_jax.compile_cache import enable_compile_cache
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine.encoding import encode_messages
from deepinfer_jax.engine.sampling import SamplingParams
from deepinfer_jax.engine.scheduler import EngineConfig, Request, Scheduler
from deepinfer_jax.engine.token_map import compressed_token_map
from deepinfer_jax.engine.tokenizer import Tokenizer
from deepinfer_jax.model.cache import cache_bytes
from deepinfer_jax.model.dense_fp8 import prepare_dense_fp8
from deepinfer_jax.model.linear import dequantize_dense_fp8
from deepinfer_jax.model.mhc import prepare_stream_dots
from deepinfer_jax.model.moe import experts_run_kernel, prepare_experts_for_kernel
from deepinfer_jax.model.numerics import Numerics, as_numerics
from deepinfer_jax.planner import MemoryPlan, PlanError, parse_bytes, plan_memory
from deepinfer_jax.sharding import DEFAULT_RULES, MeshSpec, ShardingRules, make_mesh, mesh_spec_of, \
    validate_model_mesh

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"

Prompt = str | Sequence[int] | dict


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token or string) or "length" (max_tokens or the context)
    logprobs: list[float]  # log p(sampled token) under the model, per generated token
    top_logprobs: list[dict[int, float]] | None  # the top-n per generated token when logprobs=n > 0
    prompt_logprobs: list[float | None] | None  # when asked: None for the first prompt token

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["top_logprobs"] is not None:  # JSON keys are strings
            d["top_logprobs"] = [{str(k): v for k, v in t.items()} for t in d["top_logprobs"]]
        return d


def _device_memory_bytes() -> int | None:
    """Usable bytes of one device: the allocator's limit on GPU/TPU; on CPU the host's physical memory
    shared by its (possibly simulated) devices."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, jax.local_device_count())
    except (ValueError, OSError):
        return None


def sampler_state_bytes(cfg: ModelConfig) -> int:
    """Device bytes of the engine's own state per slot beyond the KV/state cache: the sampler's token
    counts and seen-mask (int32 + bool per vocabulary id), the next token and the Engram history."""
    return cfg.vocab_size * 5 + 4 + 4 * max(cfg.engram_max_ngram_size - 1, 0)


def slot_state_bytes(cfg: ModelConfig, max_len: int, numerics: Numerics) -> int:
    """Device bytes one slot needs on one device: its KV/state cache plus ``sampler_state_bytes``."""
    return cache_bytes(cfg, 1, max_len, numerics) + sampler_state_bytes(cfg)


def check_memory(cfg: ModelConfig, slots: int, max_len: int, numerics: Numerics, limit: int | str | None, *,
                 mesh: "MeshSpec | str" = "data=1", chunk_size: int = 1,
                 rules: ShardingRules = DEFAULT_RULES) -> MemoryPlan:
    """The engine's memory plan (``planner.plan_memory``: weights, caches, the engine's per-slot state and
    the activations of a ``chunk_size`` prefill step, per device of ``mesh``). Raises PlanError (a
    MemoryError) saying how many slots fit when it exceeds ``limit`` bytes per device (None: no check)."""
    # the engine's steps run the LM head on one position per slot; the sampler reads whole rows after it
    plan = plan_memory(cfg, mesh, slots, max_len, numerics, step_tokens=chunk_size, rules=rules,
                       extra_per_slot_bytes=sampler_state_bytes(cfg), head_tokens=1, sampler=True,
                       dense_bf16=experts_run_kernel(as_numerics(numerics)),
                       stream_dot_parts=as_numerics(numerics).bf16_stream_dot())
    if limit is None:
        return plan
    limit = parse_bytes(limit)
    try:
        plan.check_fits(limit)
    except PlanError as e:
        fits = plan.max_slots(limit)
        raise PlanError(f"max_slots={slots} x max_len={max_len} needs {plan.total_bytes / 2**30:.2f} GiB per device "
                        f"on mesh {plan.mesh} (weights {plan.weight_bytes / 2**30:.2f} GiB, caches and engine state "
                        f"{plan.cache_bytes / 2**30:.2f} GiB, activations {plan.activation_bytes / 2**30:.2f} GiB) "
                        f"but a device has {limit / 2**30:.2f} GiB; {fits} slots fit at this max_len "
                        f"(planner: {e})") from None
    return plan


class LLM:
    """Offline batch inference on one checkpoint directory (official layout)."""

    def __init__(self, model: str | Path, *, max_slots: int = 8, max_len: int = 256, chunk_size: int = 16,
                 numerics: str | Numerics = "reference", bounded_replay: bool = True, engine_seed: int = 0,
                 progress: bool = False, mesh: "str | MeshSpec | jax.sharding.Mesh | None" = None,
                 rules: ShardingRules = DEFAULT_RULES, device_memory: int | str | None = None,
                 compile_cache: str | Path | None = None, xla_options: dict[str, Any] | None = None):
        """mesh: run over a (data, tensor, expert) device mesh, e.g. ``"data=2,tensor=2,expert=2"`` (a spec
        over all devices, or a ``jax.sharding.Mesh`` from ``sharding.make_mesh``): params and caches are
        sharded by ``rules`` (``sharding.DEFAULT_RULES``) and the slots split over ``data``. None: one
        device. device_memory: usable bytes per device for the memory check (default: what the device
        reports; on CPU the host memory divided among its devices). compile_cache: a directory for jax's
        persistent compilation cache (``compile_cache.enable_compile_cache``; process-wide): a later
        engine with the same model and shapes loads its programs instead of compiling them, and on a
        GPU reuses the first compilation's autotuned kernel choices for XLA's GEMMs (compiled afresh,
        XLA may time its way to another kernel, with other bits). xla_options: more XLA compile options
        for every engine program (``EngineConfig.xla_options``), e.g. ``{"xla_gpu_enable_command_buffer":
        ""}``; an unknown name fails at the first compile."""
        if compile_cache is not None:
            enable_compile_cache(compile_cache)
        path = Path(model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: no config.json (expected a checkpoint directory in the official "
                                    f"layout, e.g. a download of {DEFAULT_MODEL})")
        self.engine_config = EngineConfig(max_slots, max_len, chunk_size, bool(bounded_replay), engine_seed,
                                          xla_options=tuple(sorted((xla_options or {}).items())))
        self.cfg = ModelConfig.from_json(path)
        if max_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context "
                             f"({self.cfg.max_position_embeddings} positions)")
        self.numerics = as_numerics(numerics)
        if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
            mesh = make_mesh(mesh)
        self.mesh = mesh
        mesh_spec = MeshSpec() if mesh is None else mesh_spec_of(mesh)
        validate_model_mesh(self.cfg, mesh_spec, rules, slots=max_slots)
        self.memory_plan = check_memory(self.cfg, max_slots, max_len, self.numerics,
                                        device_memory if device_memory is not None else _device_memory_bytes(),
                                        mesh=mesh_spec, chunk_size=chunk_size, rules=rules)
        self.tokenizer = Tokenizer.from_dir(path)
        self.token_map, n_keys = compressed_token_map(path / "tokenizer.json", self.cfg.vocab_size)
        if self.cfg.engram_layer_ids and n_keys != self.cfg.engram_compressed_vocab_size:
            raise ValueError(f"{path}: the tokenizer gives {n_keys} Engram keys, config.json says "
                             f"engram_compressed_vocab_size={self.cfg.engram_compressed_vocab_size}")
        self.params = self._load(path, rules, progress)
        if experts_run_kernel(self.numerics):    # the GPU path: work done once instead of in every step
            # (on a mesh the routed experts run ParallelContext's local XLA path, which would lay tile-major
            # weights back every step: they keep the checkpoint's layout there)
            self.params, self.numerics = prepare_experts_for_kernel(self.params, self.numerics,
                                                                    tile_major=mesh is None, donate=True)
            if self.numerics.dense_kernel != "off" and mesh is None:
                self.params = prepare_dense_fp8(self.params, self.cfg, linears=self.numerics.dense_kernel_linears)
            self.params = dequantize_dense_fp8(self.params)
        if self.numerics.bf16_stream_dot():
            self.params = prepare_stream_dots(self.params)
        if mesh is None:
            self.scheduler = Scheduler(self.params, self.cfg, self.tokenizer, self.token_map, self.numerics,
                                       self.engine_config)
        else:
            from deepinfer_jax.parallel import ParallelContext
            from deepinfer_jax.parallel.engine import mesh_scheduler

            self.scheduler = mesh_scheduler(self.params, self.cfg, self.tokenizer, self.token_map, self.numerics,
                                            self.engine_config, ParallelContext(mesh, rules))

    def _load(self, path: Path, rules: ShardingRules, progress: bool) -> dict:
        """Official safetensors, or an orbax checkpoint written by ``deepinfer-jax convert`` (any mesh)."""
        from deepinfer_jax.checkpoint.orbax_io import is_orbax_checkpoint, load_orbax

        if is_orbax_checkpoint(path):
            target = self.mesh if self.mesh is not None else make_mesh("data=1", jax.local_devices()[:1])
            return load_orbax(path, target, cfg=self.cfg, rules=rules)
        if self.mesh is None:
            return load_params(path, self.cfg, progress=progress)
        from deepinfer_jax.sharding import make_place

        return load_params(path, self.cfg, place=make_place(self.cfg, self.mesh, rules), progress=progress)

    @property
    def manifest(self) -> dict[str, Any]:
        """What the bitwise promise is pinned to (record it next to results)."""
        dev = jax.devices()[0]
        return {"jax": jax.__version__, "backend": dev.platform, "device": dev.device_kind,
                "prng": "threefry2x32", "threefry_partitionable": True,
                "mesh": None if self.mesh is None else str(mesh_spec_of(self.mesh)),
                "engine": dataclasses.asdict(self.engine_config), "numerics": dataclasses.asdict(self.numerics)}

    # ------------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):  # vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or len(prompt) != 1:
                raise ValueError(f"a dict prompt holds exactly one of 'prompt' or 'prompt_token_ids', got {sorted(prompt)}")
            return self._prompt_ids(next(iter(prompt.values())))
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise ValueError("a token-id prompt must be a list of integers")
        return [int(t) for t in ids], None

    def make_requests(self, prompts: Sequence[Prompt], sampling_params=None,
                      request_ids: Sequence[str] | None = None) -> list[Request]:
        """Tokenize and check (raises ValueError naming the request) without running anything."""
        n = len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {n} prompts and {len(sampling_params)} sampling params")
        if not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise TypeError("sampling_params must be SamplingParams (or a list of them, one per prompt)")
        ids = [str(i) for i in range(n)] if request_ids is None else [str(i) for i in request_ids]
        if len(ids) != n:
            raise ValueError(f"got {n} prompts and {len(ids)} request ids")
        reqs = []
        for rid, prompt, sp in zip(ids, prompts, sampling_params):
            tokens, text = self._prompt_ids(prompt)
            req = Request(rid, tokens, sp, prompt=text)
            self.scheduler.validate(req)
            reqs.append(req)
        return reqs

    def run(self, requests: Sequence[Request], *, on_finish: Callable[[RequestOutput], None] | None = None,
            on_tokens: Callable[[int], None] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), unit="req", desc="generate")
        t0, total = time.perf_counter(), [0]

        def finished(r: Request) -> None:
            if bar is not None:
                bar.update(1)
            if on_finish is not None:
                on_finish(self._output(r))

        def tokens(n: int) -> None:
            total[0] += n
            if bar is not None:
                bar.set_postfix(tok_s=f"{total[0] / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)
            if on_tokens is not None:
                on_tokens(n)

        try:
            self.scheduler.run(requests, on_finish=finished, on_tokens=tokens)
        finally:
            if bar is not None:
                bar.close()
        return [self._output(r) for r in requests]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 request_ids: Sequence[str] | None = None, use_tqdm: bool = False,
                 on_finish: Callable[[RequestOutput], None] | None = None,
                 on_tokens: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Prompts are raw strings (tokenized as given: no BOS unless written), token-id lists, or vLLM-style
        dicts. Outputs come back in prompt order. Request ids default to "0", "1", ...: with no explicit
        seed the id seeds the sampler, so give stable ids to reproduce sampled runs."""
        if isinstance(prompts, (str, dict)) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        reqs = self.make_requests(prompts, sampling_params, request_ids)
        return self.run(reqs, on_finish=on_finish, on_tokens=on_tokens, use_tqdm=use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, *, thinking: bool = False,
             reasoning_effort: str | int | None = None, tools: list | None = None, **kw) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; encoded with the V4.1 prompt format."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [encode_messages(c, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools)
                   for c in convs]
        return self.generate(prompts, sampling_params, **kw)

    @staticmethod
    def _output(r: Request) -> RequestOutput:
        return RequestOutput(r.request_id, r.prompt, list(r.prompt_ids), r.text, list(r.generated), r.finish_reason,
                             list(r.logprobs), list(r.top_logprobs) if r.params.logprobs else None,
                             list(r.prompt_logprobs) if r.params.prompt_logprobs else None)


__all__ = ["LLM", "RequestOutput", "SamplingParams"]
