"""A peer on the same slice and weights in the same run (issue 7): our engine against transformers'
``DeepseekV4ForCausalLM`` on a real-width slice of DeepSeek-V4-Flash, as ratios.

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/peer_transformers.py   # H200: one process, jax + torch
    python benchmarks/peer_transformers.py --tiny                                  # CPU smoke run, same code

Why V4-Flash: transformers ships ``deepseek_v4`` (V4-Flash) and no V4.1; our model runs both. The slice
(``slice_model.v4flash_slice_root``) keeps every width of V4-Flash and, by default, 2 layers: a ratio-4
layer (CSA: compressor + lightning indexer, top-512) and a ratio-128 layer (HCA), the pair that layers
2-41 of the real model repeat, with learned routing.

Weights (``slice_model.v4flash_float_params``), made once on the device: every linear unquantized bf16
(the checkpoint's FP8 / FP4 tensors as a bf16 re-upload holds them), F32 tensors holding bf16 values, so
both sides hold exactly the same numbers whichever dtype each keeps a tensor in. With jax and torch in
one interpreter (the GPU image) torch's state dict is taken from the jax arrays through DLPack without
a copy; only transformers' stacked ``gate_up_proj`` is a new array. Where no interpreter has both (here:
our venv has no torch, the torch venv no jax) the torch half runs as ``--side torch`` in the torch
interpreter (``--torch-python``, default $DEEPINFER_TORCH_PYTHON as .ci/run sets it) and reads the weights
from a safetensors directory in transformers' spelling.

The two sides:
* ours: ``model.transformer.forward`` jitted with the cache donated, ``Numerics("bfloat16",
  fake_quant=False, kv_quant=False)``: bf16 activations and caches and none of the reference's simulated
  FP8 quantizers, as transformers runs bf16 weights. Two paths: ``kernels="auto"`` (the Pallas attention
  and grouped-GEMM kernels on Hopper) and ``kernels="xla"`` (the model's own XLA code: float32 attention,
  gathered experts; decode only, at the batches where the gathered expert weights fit). Prefill runs the
  prompt in chunks (``--chunk``) as the engine does; the head is computed for the last position only.
* theirs: bf16 params (the fp32 ones its own modules declare stay fp32), attention ``eager`` (the only
  one V4 supports: FlashAttention caps head_dim at 256, SDPA has no sink), experts by the config's choice
  (``--torch-experts``; transformers picks ``grouped_mm`` where torch has it), its ``DynamicCache``.
  Prefill is one forward over the prompt with ``logits_to_keep=1``.

Sections, in this order (torch first, so its memory is handed back before jax grows its pool):
* check: prefill logits of a short prompt (``--check-len``) on both sides: max abs / relative error
  per position and top-1 agreement (tolerances at ``CHECK_*``). Also the last-position logits of the
  long prefill and the first decode step, reported, not gated. In bf16 runs (``--noise-floor``, default)
  transformers also runs the check prompt in float32 on the same weights after its timings, and the gate
  is ours (bf16) against that float32 reference; transformers' bf16 against it is reported as the floor
  and bf16-vs-bf16 beside it. When the XLA-only path runs (``--xla-batches``),
  it also runs the check prompt in chunks of ``--check-chunk`` tokens, and two diagnostics are reported:
  our XLA-only path vs transformers, and our kernel path vs our XLA-only path (which side a disagreement is on).
* prefill: one prompt of ``--context`` tokens, median of ``--reps`` after a first call (compile /
  warm-up, reported separately).
* decode: the long prompt's cache copied into each of B rows, then ``--steps`` steps at B in
  ``--batches`` after a first call and a warm-up step: ms/step and tokens/s.
Results: a table and $OUT/peer_transformers.json (OUT, default ./out).

Size of the default GPU run (2 layers): weights 28.5 GB ours (experts 2 x 12.9 GB bf16, embedding and
head 2 x 1.06 GB) + 17.2 GB for transformers' gate_up_proj; the rest is shared. The largest transient is
torch's eager prefill attention at 4k (q.k logits [1, 64, 4096, 4096 + 1024] in bf16, 2.7 GB, a few
copies) and our XLA-only decode at B=16 (gathered experts, 4.8 GB). Wall time: the weights take seconds
on the device; torch's steps are sub-second; most of the run is our compiles (e2e_gpu.py measured 45-65 s
a decode batch for 12 layers, so ~10 s for 2) times 7 programs; see the printed phase times.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

# Two frameworks share one device: neither may take most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

# Agreement of the first prefill logits of a short prompt, per position t: rel_t = max |ours - theirs|
# / max |theirs| over the vocabulary (the row's logit scale). float32 (--dtype float32): both sides
# compute the same function in fp32 and differ only in summation order, so every row is held to the
# parity test's 1e-5 (measured ~1e-6 on the tiny slice). bfloat16 (the benchmark's dtype): the same
# weights, but each side rounds to bf16 in its own places (our router, mHC mixes, compressor pooling
# and head in fp32 from bf16 inputs; transformers' pooled sums, router and head in bf16), 2^-9 relative
# per rounding, and a rounding can also flip a discrete choice (a token's expert whose router score ties
# within bf16, an indexer top-k entry), which moves that row by a fraction of its scale. Hence: the
# median row under 5e-2 (tiny slice, measured 1.0e-2), 90 % of rows under 0.2 (flips stay rare), and the
# top-1 token equal on 90 % of rows, held against transformers' float32 logits where it ran them (bf16 vs
# bf16 counts both sides' flips: with V4-Flash's 256 experts it failed on the H200, p90 20.0 %, top-1 81 %,
# and on the tiny slice with 256 experts transformers' own bf16 against its float32 has p90 18.5 %, top-1
# 91 %, while ours against that float32 has 2.6 %, 97 %). A semantic difference (a wrong mask, RoPE position, compressor
# window or weight mapping) moves most rows by O(1) of their scale (one such bug here gave 1.3).
CHECK_TOL = {"bfloat16": dict(median_rel=5e-2, p90_rel=0.2, max_rel=None, top1=0.9),
             "float32": dict(median_rel=1e-5, p90_rel=1e-5, max_rel=1e-5, top1=1.0)}


# Run sizes: (default, --tiny, meaning). Tiny still passes the 128-token window and the first ratio-128
# entry, as the real run does.
SIZES = {
    "context": (4096, 300, "prompt length, and the decode context"),
    "batches": ("1,16,64", "1,4", "decode batches"),
    "xla_batches": ("1,16", "1", "decode batches of our XLA-only path ('' = none)"),
    "steps": (10, 3, "timed decode steps"),
    "reps": (3, 1, "timed prefill runs (median)"),
    "chunk": (1024, 64, "our prefill chunk (1024: the e2e benchmark's)"),
    "check_len": (300, 150, "tokens of the agreement prompt"),
    "check_chunk": (20, 30, "chunk of the XLA-only path's run over the agreement prompt (its gathered experts)"),
}


def log(*a):
    print(*a, flush=True)


def agreement(ours_tv: np.ndarray, ref_tv: np.ndarray, dtype: str) -> dict:
    """Per-position errors of logits [T, V] against the reference, and the verdict (``CHECK_TOL``)."""
    ours_tv, ref_tv = ours_tv.astype(np.float64), ref_tv.astype(np.float64)
    abs_t = np.abs(ours_tv - ref_tv).max(-1)
    rel_t = abs_t / np.abs(ref_tv).max(-1)
    tol = CHECK_TOL[dtype]
    rec = dict(positions=int(len(rel_t)), max_abs=float(abs_t.max()), max_rel=float(rel_t.max()),
               median_rel=float(np.median(rel_t)), p90_rel=float(np.quantile(rel_t, 0.9)),
               worst_position=int(rel_t.argmax()),
               top1_agree=float((ours_tv.argmax(-1) == ref_tv.argmax(-1)).mean()), tolerance=tol)
    rec["passed"] = bool(rec["median_rel"] < tol["median_rel"] and rec["p90_rel"] < tol["p90_rel"]
                         and (tol["max_rel"] is None or rec["max_rel"] < tol["max_rel"])
                         and rec["top1_agree"] >= tol["top1"])
    return rec


# ==== theirs: transformers (imports torch; never jax) ===================================================

def build_torch_model(root: dict, tensors: dict, device: str, dtype: str, experts: str | None):
    """``DeepseekV4ForCausalLM`` on ``device`` holding ``tensors`` (transformers' state-dict names): built on
    the meta device, then the tensors assigned as its parameters (no copy where dtype and device match)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = {k: v for k, v in root.items() if k not in ("quantization_config", "architectures", "model_type",
                                                       "transformers_version", "torch_dtype", "dtype")}
    extra = {"attn_implementation": "eager"}
    if experts:
        extra["experts_implementation"] = experts
    cfg = DeepseekV4Config(**raw, **extra)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # the modules' own fp32 parts stay fp32
    try:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    want = model.state_dict()
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    state = {}
    for name, slot in want.items():
        t = tensors.pop(name)
        if tuple(t.shape) != tuple(slot.shape):
            raise SystemExit(f"{name}: shape {tuple(t.shape)}, the model wants {tuple(slot.shape)}")
        state[name] = t.to(device=device, dtype=slot.dtype)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (the RoPE tables) are in no state dict: rebuild their modules on the device.
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not type(module).__name__.endswith("RotaryEmbedding"):
                raise SystemExit(f"{name} ({type(module).__name__}) has buffers no state dict fills")
            parent, _, child = name.rpartition(".")
            with torch.device(device):
                setattr(model.get_submodule(parent), child, type(module)(module.config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SystemExit(f"still on the meta device: {left}")
    return model.eval()


class TorchClock:
    """Milliseconds of a call on the device's own timeline (CUDA events), or the host clock on CPU."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device.startswith("cuda")

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def ms(self, fn, n: int = 1) -> float:
        """Mean ms over n back-to-back calls of fn."""
        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / n
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) * 1e3 / n


def replicate_cache(torch, cache, batch: int):
    """A copy of a batch-1 ``DynamicCache`` with every per-row tensor repeated into ``batch`` rows (V4's
    layers keep their compressor state in dicts of tensors beside the window keys)."""
    out = copy.deepcopy(cache)

    def rep(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 1:
            return v.repeat(batch, *([1] * (v.dim() - 1)))
        if isinstance(v, dict):
            return {k: rep(x) for k, x in v.items()}
        return v

    for layer in out.layers:
        for k, v in list(vars(layer).items()):
            setattr(layer, k, rep(v))
    return out


def torch_side(plan: dict, tensors: dict) -> tuple[dict, dict]:
    """The transformers half: -> (results, arrays for the agreement check)."""
    import torch
    import transformers
    from transformers.cache_utils import DynamicCache

    dev = plan["torch_device"]
    torch.manual_seed(0)
    if not dev.startswith("cuda"):
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    res: dict = {"torch": torch.__version__, "transformers": transformers.__version__}
    arrays: dict = {}
    t = time.time()
    model = build_torch_model(plan["config"], tensors, dev, plan["dtype"], plan["torch_experts"])
    res["build_s"] = time.time() - t
    res["attn_implementation"] = model.config._attn_implementation
    res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    if dev.startswith("cuda"):
        res["device"] = torch.cuda.get_device_name()
    log(f"[torch] built in {res['build_s']:.1f} s: attention {res['attn_implementation']}, experts "
        f"{res['experts_implementation']}, torch {torch.__version__}, transformers {transformers.__version__}")
    # 5.17 names the cache argument past_key_values; later releases cache (the old name deprecated).
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    clock = TorchClock(torch, dev)

    def call(ids_bt, cache, keep=0):
        return model(input_ids=ids_bt, use_cache=True, logits_to_keep=keep, **{cache_kw: cache}).logits

    def ids(tokens) -> "torch.Tensor":
        return torch.tensor(tokens, dtype=torch.long, device=dev)

    with torch.inference_mode():
        # check: every position's logits of the short prompt
        check = ids([plan["check_prompt"]])
        arrays["check_logits"] = call(check, DynamicCache(config=model.config)).float()[0].cpu().numpy()

        # prefill of the long prompt, head on the last position only
        long_ids = ids([plan["prompt"]])
        caches: list = []
        last_logits: list = []

        def prefill():
            caches.append(DynamicCache(config=model.config))
            last_logits[:] = [call(long_ids, caches[-1], keep=1)]

        t = time.perf_counter()
        prefill()
        clock.sync()
        first_s = time.perf_counter() - t
        runs = []
        for _ in range(plan["reps"]):
            del caches[:-1]  # only the last prefilled cache is kept (decode starts from it)
            runs.append(clock.ms(prefill))
        n = len(plan["prompt"])
        ms = statistics.median(runs)
        res["prefill"] = dict(prompt=n, ms=ms, tokens_per_s=n / (ms * 1e-3), first_call_s=first_s, runs_ms=runs)
        log(f"[torch] prefill {n} tok: {ms:.1f} ms ({n / (ms * 1e-3):.0f} tok/s; first call {first_s:.1f} s)")
        base = caches[-1]
        arrays["prefill_last_logits"] = last_logits[0].float()[0, -1].cpu().numpy()

        res["decode"] = []
        for b in plan["batches"]:
            try:
                res["decode"].append(_torch_decode(torch, clock, call, ids, base, b, plan, arrays))
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest batch: keep the others
                traceback.print_exc()
                res["decode"].append(dict(batch=b, error=f"{type(e).__name__}: {e}"[:500]))
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
        if plan.get("noise_floor") and plan["dtype"] != "float32":
            # The same weights upcast: transformers against itself in float32 is the floor any bf16
            # implementation can reach on this check (last, after the timings: it needs the fp32 copy).
            model.float()
            arrays["check_logits_float32"] = call(check, DynamicCache(config=model.config)).float()[0].cpu().numpy()
    if dev.startswith("cuda"):
        res["peak_bytes"] = torch.cuda.max_memory_allocated()
    return res, arrays  # the model and caches go with this frame; the caller empties torch's cache


def _torch_decode(torch, clock, call, ids, base, b: int, plan: dict, arrays: dict) -> dict:
    cache = replicate_cache(torch, base, b)
    tok = ids([[plan["next_token"]]] * b)
    t = time.perf_counter()
    logits = call(tok, cache)
    clock.sync()
    first_s = time.perf_counter() - t
    if b == 1:
        arrays["decode_logits"] = logits.float()[0, -1].cpu().numpy()
    call(tok, cache)  # warm-up at the next position
    ms = clock.ms(lambda: call(tok, cache), plan["steps"])
    ctx = len(plan["prompt"])
    log(f"[torch] decode B={b:3d} ctx={ctx}: {ms:8.2f} ms/step {b / (ms * 1e-3):9.1f} tok/s (first call {first_s:.2f} s)")
    return dict(batch=b, context=ctx, ms_per_step=ms, tokens_per_s=b / (ms * 1e-3), first_call_s=first_s)


def torch_main(workdir: Path) -> int:
    """``--side torch``: the torch half from files (plan.json, config in it, safetensors shards)."""
    from safetensors.torch import load_file

    plan = json.loads((workdir / "plan.json").read_text())
    tensors = {}
    for f in sorted(workdir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    res, arrays = torch_side(plan, tensors)
    np.savez(workdir / "torch_arrays.npz", **arrays)
    (workdir / "torch.json").write_text(json.dumps(res, indent=1))
    return 0


# ==== ours: jax ==========================================================================================

def transformers_tensors(cfg, params) -> dict:
    """The params pytree under transformers' state-dict names (jax arrays; routed experts stacked as its
    ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I])."""
    import jax.numpy as jnp

    from deepinfer_jax.checkpoint import hf_names
    from deepinfer_jax.checkpoint.names import param_path
    from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, expected_tensors

    out = {}
    for name, spec in expected_tensors(cfg).items():
        if spec.group != BACKBONE or spec.dtype == "F8_E8M0":
            continue
        path, expert = param_path(name)
        if expert is not None:
            continue
        node = params
        for p in path:
            node = node[p]
        out[hf_names.to_transformers(name)] = node
    for i, layer in enumerate(params["layers"]):
        ex = layer["ffn"]["experts"]
        stacked = hf_names.to_transformers(f"layers.{i}.ffn.experts")
        out[f"{stacked}.gate_up_proj"] = jnp.concatenate([ex["w1"]["weight"], ex["w3"]["weight"]], axis=1)
        out[f"{stacked}.down_proj"] = ex["w2"]["weight"]
    return out


def to_torch_in_process(arrays: dict) -> dict:
    """jax arrays -> torch tensors on the same device: through DLPack (no copy), else through the host."""
    import jax
    import torch

    out = {}
    for name in list(arrays):
        a = arrays.pop(name)
        jax.block_until_ready(a)
        try:
            out[name] = torch.from_dlpack(a)
        except Exception as e:  # noqa: BLE001 - a copy costs memory and seconds, not the comparison
            log(f"DLPack refused {name} ({type(e).__name__}: {e}); copying through the host")
            host = np.asarray(a)
            t = (torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16) if str(host.dtype) == "bfloat16"
                 else torch.from_numpy(host))
            out[name] = t.to("cuda" if a.devices().pop().platform == "gpu" else "cpu")
    return out


def write_for_torch(workdir: Path, plan: dict, arrays: dict) -> None:
    """The torch half's inputs as files: plan.json and safetensors shards in transformers' spelling."""
    from deepinfer_jax.checkpoint.safetensors_io import write_checkpoint

    host = {n: np.asarray(a) for n, a in arrays.items()}
    kinds = {"bfloat16": "BF16", "float32": "F32", "int32": "I32"}
    write_checkpoint(workdir, host, {n: kinds[str(a.dtype)] for n, a in host.items()}, max_shard_bytes=1 << 30)
    (workdir / "plan.json").write_text(json.dumps(plan))


class Ours:
    """Our model's programs on one numerics: prefill chunks (head on the last position) and decode steps,
    each jitted with the cache donated, as the engine runs them."""

    def __init__(self, cfg, params, numerics):
        import jax
        import jax.numpy as jnp

        from deepinfer_jax.model.transformer import forward, forward_hidden, lm_head

        self.cfg, self.params, self.numerics = cfg, params, numerics

        def chunk(p, cache, tokens_bt, positions_bt, last_b):
            h, cache = forward_hidden(p, cfg, cache, tokens_bt, positions_bt, None, numerics)
            return lm_head(p, jnp.take_along_axis(h, last_b[:, None, None], axis=1)), cache

        def step(p, cache, tokens_bt, positions_bt):
            return forward(p, cfg, cache, tokens_bt, positions_bt, None, numerics)

        self.chunk = jax.jit(chunk, donate_argnums=1)
        self.step = jax.jit(step, donate_argnums=1)
        self.logits = jax.jit(step)  # every position's logits (the agreement check), cache kept

    def cache(self, batch: int, max_len: int):
        from deepinfer_jax.model.cache import init_cache

        return init_cache(self.cfg, batch, max_len, self.numerics)

    @staticmethod
    def chunks(prompt: list[int], chunk: int):
        """-> (tokens [chunk], positions [chunk], real rows) per chunk of the prompt, the last one padded
        with position -1 rows, so one program serves every chunk."""
        toks = np.asarray(prompt, np.int32)
        for s in range(0, len(toks), chunk):
            part = toks[s:s + chunk]
            n = len(part)
            pos = np.arange(s, s + n, dtype=np.int32)
            if n < chunk:
                part = np.concatenate([part, np.zeros(chunk - n, np.int32)])
                pos = np.concatenate([pos, np.full(chunk - n, -1, np.int32)])
            yield part, pos, n

    def prefill(self, prompt: list[int], chunk: int, max_len: int):
        """-> (last-position logits [V], the batch-1 cache after the prompt)."""
        import jax.numpy as jnp

        cache = self.cache(1, max_len)
        for part, pos, n in self.chunks(prompt, chunk):
            last = np.asarray([n - 1], np.int32)  # the head reads the last real row
            logits, cache = self.chunk(self.params, cache, jnp.asarray(part[None]), jnp.asarray(pos[None]),
                                       jnp.asarray(last))
        return logits, cache

    def all_logits(self, prompt: list[int], chunk: int):
        """-> every position's logits [T, V] of the prompt, run in chunks of ``chunk`` tokens, for paths that
        cannot take the whole prompt in one call."""
        import jax.numpy as jnp

        cache, out = self.cache(1, len(prompt) + chunk), []
        for part, pos, n in self.chunks(prompt, chunk):
            logits, cache = self.step(self.params, cache, jnp.asarray(part[None]), jnp.asarray(pos[None]))
            out.append(np.asarray(logits[0, :n]))
        return np.concatenate(out)


def jax_peak_bytes() -> int | None:
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def ours_side(cfg, params, plan: dict, arrays: dict, label: str, numerics, batches, base=None) -> tuple[dict, dict]:
    """Our half on one numerics -> (results, the batch-1 cache after the long prompt). With ``base`` (that
    cache, from a run on another numerics with the same cache layout) only the decode steps run: the
    XLA-only path cannot prefill 1k-token chunks (its gathered experts would be chunk x 6 expert copies)."""
    import jax
    import jax.numpy as jnp

    res: dict = {"numerics": str(numerics)}
    ours = Ours(cfg, params, numerics)
    n = len(plan["prompt"])
    max_len = n + plan["steps"] + 8
    if base is None:
        check = plan["check_prompt"]
        t = time.time()
        logits, _ = ours.logits(params, ours.cache(1, len(check)), jnp.asarray([check], jnp.int32),
                                jnp.arange(len(check), dtype=jnp.int32)[None])
        arrays["check_logits"] = np.asarray(logits[0])
        res["check_s"] = time.time() - t

        t = time.time()
        logits, base = ours.prefill(plan["prompt"], plan["chunk"], max_len)
        jax.block_until_ready(logits)
        first_s = time.time() - t
        arrays["prefill_last_logits"] = np.asarray(logits[0, -1])
        runs = []
        for _ in range(plan["reps"]):
            t = time.perf_counter()
            jax.block_until_ready(ours.prefill(plan["prompt"], plan["chunk"], max_len))
            runs.append((time.perf_counter() - t) * 1e3)
        ms = statistics.median(runs)
        res["prefill"] = dict(prompt=n, chunk=plan["chunk"], ms=ms, tokens_per_s=n / (ms * 1e-3),
                              first_call_s=first_s, runs_ms=runs)
        log(f"[{label}] prefill {n} tok (chunks of {plan['chunk']}): {ms:.1f} ms ({n / (ms * 1e-3):.0f} tok/s; "
            f"first call {first_s:.1f} s)")
    elif plan.get("check_chunk"):  # the XLA-only path: the agreement prompt in small chunks (diagnostic)
        t = time.time()
        arrays["check_logits"] = ours.all_logits(plan["check_prompt"], plan["check_chunk"])
        res["check_s"] = time.time() - t
    res["decode"] = []
    for b in batches:
        try:
            res["decode"].append(_ours_decode(ours, base, b, plan, arrays, label))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest batch: keep the others
            traceback.print_exc()
            res["decode"].append(dict(batch=b, error=f"{type(e).__name__}: {e}"[:500]))
    res["peak_bytes"] = jax_peak_bytes()
    return res, base


def _ours_decode(ours: Ours, base, b: int, plan: dict, arrays: dict, label: str) -> dict:
    import jax
    import jax.numpy as jnp

    ctx = len(plan["prompt"])
    # new buffers even at b=1: the step donates its cache, and base serves every batch
    cache = jax.tree.map(lambda x: jnp.repeat(x, b, axis=0) if b > 1 else jnp.copy(x), base)
    tok = jnp.full((b, 1), plan["next_token"], jnp.int32)
    pos = [jnp.full((b, 1), ctx + i, jnp.int32) for i in range(plan["steps"] + 2)]
    t = time.time()
    logits, cache = ours.step(ours.params, cache, tok, pos[0])
    jax.block_until_ready(logits)
    first_s = time.time() - t
    if b == 1:
        arrays["decode_logits"] = np.asarray(logits[0, -1])
    logits, cache = ours.step(ours.params, cache, tok, pos[1])  # warm-up at the next position
    jax.block_until_ready(logits)
    t = time.perf_counter()
    for i in range(plan["steps"]):
        logits, cache = ours.step(ours.params, cache, tok, pos[2 + i])
    jax.block_until_ready(logits)
    ms = (time.perf_counter() - t) * 1e3 / plan["steps"]
    log(f"[{label}] decode B={b:3d} ctx={ctx}: {ms:8.2f} ms/step {b / (ms * 1e-3):9.1f} tok/s "
        f"(first call {first_s:.1f} s)")
    return dict(batch=b, context=ctx, ms_per_step=ms, tokens_per_s=b / (ms * 1e-3), first_call_s=first_s)


# ==== the run ============================================================================================

def table(results: dict) -> list[str]:
    """ms and tokens/s per case for each side, and ours / theirs in tokens/s (> 1: ours is faster)."""
    sides = [("ours", results.get("ours") or {}), ("ours-xla", results.get("ours_xla") or {}),
             ("transformers", results.get("torch") or {})]
    rows = [("prefill", results["plan"]["context"], lambda s: (s.get("prefill") or {}))]
    for b in results["plan"]["batches"]:
        rows.append((f"decode B={b}", results["plan"]["context"],
                     lambda s, b=b: next((r for r in s.get("decode", []) if r.get("batch") == b), {})))
    head = f"{'case':14s} {'ctx':>6s} " + " ".join(f"{n + ' ms':>17s} {'tok/s':>9s}" for n, _ in sides)
    lines = [head + f" {'ours/theirs':>11s} {'xla/theirs':>10s}"]
    for case, ctx, pick in rows:
        cells, tps = [], {}
        for name, s in sides:
            r = pick(s)
            ms = r.get("ms_per_step", r.get("ms"))
            if ms is None:
                cells.append(f"{(r.get('error') or '-')[:17]:>17s} {'':>9s}")
                continue
            tps[name] = r["tokens_per_s"]
            cells.append(f"{ms:17.2f} {r['tokens_per_s']:9.1f}")
        theirs = tps.get("transformers")
        ratio = lambda k: f"{tps[k] / theirs:.2f}x" if theirs and k in tps else "-"  # noqa: E731
        lines.append(f"{case:14s} {ctx:6d} " + " ".join(cells) + f" {ratio('ours'):>11s} {ratio('ours-xla'):>10s}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=("both", "torch"), default="both",
                    help="torch: only the transformers half, from --workdir (run by the split mode)")
    ap.add_argument("--workdir", type=Path, help="files between the two halves (split mode)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hash-layers", type=int, default=0)
    ap.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                    help="set a config.json field of the slice (repeatable), e.g. n_routed_experts=64: fewer "
                         "experts keep every width and fit --dtype float32 on one H200 (256 ran out of memory, "
                         "2 x 57 GB + 34 GB)")
    for name, (full, tiny, what) in SIZES.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(full), help=f"{what} (default {full!r}; tiny {tiny!r})")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--torch-experts", default=None, help="transformers' experts_implementation (default: its own)")
    ap.add_argument("--noise-floor", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 runs: also run transformers' check in float32 on the same weights; the gate is "
                         "then ours (bf16) against that float32 reference, and transformers' own bf16 against "
                         "it is reported as the floor (default on)")
    ap.add_argument("--split", action="store_true", help="run the torch half in --torch-python even if torch imports")
    ap.add_argument("--torch-python", default=os.environ.get("DEEPINFER_TORCH_PYTHON"),
                    help="the torch interpreter of the split mode (default: $DEEPINFER_TORCH_PYTHON)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny widths and sizes on the CPU: a smoke run of this script")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    if args.side == "torch":
        return torch_main(args.workdir)
    for name, (full, tiny, _) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_run = time.time()
    phases: dict = {}

    import jax

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.model.numerics import Numerics
    from slice_model import tree_bytes, v4flash_float_params, v4flash_slice_root

    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    root = v4flash_slice_root(args.layers, num_hash_layers=args.hash_layers, tiny_widths=args.tiny)
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep or key not in root:
            raise SystemExit(f"--override {item!r}: expected KEY=JSON with KEY one of the config's fields")
        try:
            root[key] = json.loads(value)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--override {item!r}: the value is not JSON ({e})") from None
    cfg = ModelConfig.from_dict(root, source=f"v4flash-slice-{args.layers}")
    rng = np.random.default_rng(args.seed)
    plan = dict(config=root, dtype=args.dtype, torch_experts=args.torch_experts, batches=ints(args.batches),
                noise_floor=args.noise_floor,
                steps=args.steps, reps=args.reps, chunk=args.chunk, context=args.context, check_chunk=args.check_chunk,
                check_prompt=rng.integers(3, cfg.vocab_size, args.check_len).tolist(),
                prompt=rng.integers(3, cfg.vocab_size, args.context).tolist(),
                next_token=int(rng.integers(3, cfg.vocab_size)))
    results: dict = {"plan": {k: v for k, v in plan.items() if k not in ("check_prompt", "prompt")},
                     "jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "phases_s": phases}
    log(f"jax {jax.__version__} on {results['device']}; V4-Flash slice of {args.layers} layers "
        f"(ratios {list(cfg.compress_ratios[:args.layers])}), {args.dtype}")

    def save():
        (out / "peer_transformers.json").write_text(json.dumps(results, indent=1, default=str))

    t = time.time()
    params = v4flash_float_params(cfg, seed=args.seed)
    if args.dtype == "float32":
        params = jax.tree.map(lambda x: x.astype("float32") if x.dtype == "bfloat16" else x, params)
    hf = transformers_tensors(cfg, params)
    jax.block_until_ready(hf)
    phases["weights"] = time.time() - t
    results["weight_bytes"] = {"ours": tree_bytes(params), "transformers_new": sum(
        a.nbytes for n, a in hf.items() if n.endswith("gate_up_proj"))}
    log(f"weights: {results['weight_bytes']} in {phases['weights']:.1f} s")

    # ---- theirs first: its memory goes back before jax's pool grows for our programs
    t = time.time()
    torch_arrays: dict = {}
    in_process = not args.split and all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    try:
        if in_process:
            plan["torch_device"] = "cuda" if jax.devices()[0].platform == "gpu" else "cpu"
            results["torch"], torch_arrays = torch_side(plan, to_torch_in_process(hf))
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand torch's cached blocks back before jax grows its pool
        else:
            if not args.torch_python:
                raise RuntimeError("torch is not importable here and no --torch-python / DEEPINFER_TORCH_PYTHON")
            import tempfile

            plan["torch_device"] = "cpu"
            with tempfile.TemporaryDirectory(prefix="peer_transformers_") as tmp:
                work = Path(args.workdir or tmp)
                work.mkdir(parents=True, exist_ok=True)
                write_for_torch(work, plan, hf)
                proc = subprocess.run([args.torch_python, str(Path(__file__).resolve()), "--side", "torch",
                                       "--workdir", str(work)], text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"the torch half exited with {proc.returncode}")
                results["torch"] = json.loads((work / "torch.json").read_text())
                torch_arrays = dict(np.load(work / "torch_arrays.npz"))
        results["torch"]["mode"] = "in-process (DLPack)" if in_process else "split (safetensors files)"
    except Exception as e:  # noqa: BLE001 - our half still runs and reports
        traceback.print_exc()
        results["torch"] = {"error": f"{type(e).__name__}: {e}"[:3000]}
    hf.clear()
    phases["torch"] = time.time() - t
    save()

    # ---- ours: the kernel path (auto), then the XLA-only path at the batches where it fits
    dt = args.dtype
    ours_arrays: dict = {}
    base = None
    t = time.time()
    try:
        results["ours"], base = ours_side(cfg, params, plan, ours_arrays, "ours",
                                          Numerics(dt, fake_quant=False, kv_quant=False, kernels="auto"),
                                          plan["batches"])
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        results["ours"] = {"error": f"{type(e).__name__}: {e}"[:3000]}
    phases["ours"] = time.time() - t
    save()
    t = time.time()
    xla_arrays: dict = {}
    if base is not None and ints(args.xla_batches):
        try:
            results["ours_xla"], _ = ours_side(cfg, params, plan, xla_arrays, "ours-xla",
                                               Numerics(dt, fake_quant=False, kv_quant=False, kernels="xla"),
                                               ints(args.xla_batches), base=base)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["ours_xla"] = {"error": f"{type(e).__name__}: {e}"[:3000]}
    phases["ours_xla"] = time.time() - t

    # ---- agreement: the check prompt gates; the long prefill's last position and the first decode step
    # (context = prompt) are reported
    check = {}
    for key in ("check_logits", "prefill_last_logits", "decode_logits"):
        if key in ours_arrays and key in torch_arrays:
            o, r = np.atleast_2d(ours_arrays[key]), np.atleast_2d(torch_arrays[key])
            check[key] = agreement(o, r, dt)
    # bf16 against bf16 counts two implementations' roundings, and each flips near-tied expert choices
    # (random router weights, 256 experts, top-6) at its own positions: on the tiny slice with 256 experts,
    # transformers' bf16 against its own float32 has p90 18.5 % and top-1 91 %. So with the float32 run of
    # transformers (--noise-floor), the gate is ours (bf16) against that float32 reference, and
    # transformers' bf16 against it is reported beside it as the floor.
    gate_key = "check_logits"
    if "check_logits_float32" in torch_arrays:
        ref32 = torch_arrays["check_logits_float32"]
        if "check_logits" in ours_arrays:
            gate_key = "check_logits_vs_transformers_float32"
            check[gate_key] = agreement(ours_arrays["check_logits"], ref32, dt)
        if "check_logits" in torch_arrays:
            check["check_logits_transformers_vs_its_float32"] = agreement(torch_arrays["check_logits"], ref32, dt)
    results["gate"] = gate_key
    # Diagnostics, reported and not gated: whether a disagreement is between implementations of the same
    # numbers (our XLA-only path vs theirs) or between our two paths (kernels vs XLA-only).
    if "check_logits" in xla_arrays:
        if "check_logits" in torch_arrays:
            check["check_logits_xla_vs_transformers"] = agreement(xla_arrays["check_logits"],
                                                                  torch_arrays["check_logits"], dt)
        if "check_logits" in ours_arrays:
            check["check_logits_kernels_vs_xla"] = agreement(ours_arrays["check_logits"],
                                                             xla_arrays["check_logits"], dt)
    results["check"] = check
    phases["total"] = time.time() - t_run
    save()

    log("\n==== peer summary (tokens/s ratio ours / transformers: > 1 = ours faster) ====")
    for line in table(results):
        log(line)
    for key, c in check.items():
        verdict = ("PASS" if c["passed"] else "FAIL") if key == gate_key else "(reported, not gated)"
        log(f"agreement {key} ({c['positions']} positions): max abs {c['max_abs']:.3g}, rel max {c['max_rel']:.3g} "
            f"p90 {c['p90_rel']:.3g} median {c['median_rel']:.3g}, top-1 {c['top1_agree']:.3f} {verdict}")
    log(f"phases (s): {', '.join(f'{k} {v:.1f}' for k, v in phases.items())}")
    log(f"wrote {out / 'peer_transformers.json'}")
    ok = check.get(gate_key, {}).get("passed", False)
    errors = [k for k in ("torch", "ours", "ours_xla") if "error" in (results.get(k) or {})]
    if errors:
        log("errors in:", errors)
    return 0 if ok and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
