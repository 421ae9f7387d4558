"""Float64 numpy reference of the DeepSeek-V4.1-Flash text forward pass (architecture spec §2.1-2.6, 2.9, 2.10).

This is the oracle the JAX model is tested against, so it is written from the spec alone: it imports
nothing from ``deepinfer_jax`` and reads the raw ``config.json`` dict itself. It favours readability over
speed (tiny configs only; the real model does not fit in float64 host memory).

Semantics: one causal "prefill over the whole sequence" starting at position 0 (the official reference's
``start_pos = 0`` call; §7: no SWA replay). Every intermediate is float64; the BF16 casts of the official
reference are *not* simulated. ``fake_quant=True`` additionally applies the simulated FP8/FP4 quantizers of
§2.9/§2.10 at their sites; it is off by default because a float64-vs-float32 comparison is meaningless once
a discrete quantizer flips.

Conventions: ``T`` tokens, ``D`` hidden size, ``hc`` residual streams, ``H`` heads of width ``d``,
``S`` compressed entries. Linear weights are [out, in] (``y = x @ W.T``), as stored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

# ---------------------------------------------------------------------------------------------------------
# Checkpoint reading (official-format safetensors, own header parser)
# ---------------------------------------------------------------------------------------------------------

_RAW_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F32": np.dtype(np.float32),
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I8": np.dtype(np.uint8),  # packed FP4 (two E2M1 codes per byte); read as raw bytes
}

# §5.4: nibble code -> E2M1 value (codes 8..15 are the negatives, 8 = -0).
FP4_E2M1_TABLE = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)

FP4_SCALE_BLOCK = 32  # routed experts: one E8M0 scale per 1x32 along K (§2.9)
ENGRAM_SCALE_BLOCK = 32  # Engram tables: one E8M0 scale per 32 consecutive columns of a row (§2.2)


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor entries by name, byte offset of the data section) of one safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: shorter than the 8-byte safetensors header length")
        n = int.from_bytes(head, "little")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError(f"{path}: header claims {n} bytes but the file ends early")
    header = json.loads(raw.decode("utf-8"))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_raw_tensor(path: Path, name: str, entry: dict, data_start: int) -> np.ndarray:
    """The stored values of one tensor in their stored dtype (I8 stays as uint8 bytes)."""
    dtype_str = entry["dtype"]
    if dtype_str not in _RAW_DTYPES:
        raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype_str}")
    dtype = np.dtype(_RAW_DTYPES[dtype_str])
    shape = tuple(int(s) for s in entry["shape"])
    begin, end = (int(o) for o in entry["data_offsets"])
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise ValueError(f"{path}: tensor {name} spans {end - begin} bytes; shape {shape} x {dtype_str} "
                         f"needs {expected}")
    if expected == 0:
        return np.zeros(shape, dtype)
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start + begin, shape=(end - begin,))
    return np.array(raw).view(dtype).reshape(shape)


def e8m0_to_float64(scale: np.ndarray) -> np.ndarray:
    """2^(b - 127) per byte; b = 255 decodes to NaN (propagated, §5.4)."""
    return np.asarray(scale).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def dequant_fp8_blocks(w: np.ndarray, scale: np.ndarray, block: int, name: str = "?") -> np.ndarray:
    """FP8 weight [out, in] with one E8M0 scale per block x block tile: W = e4m3(w) * 2^(s - 127)."""
    out_dim, in_dim = w.shape
    want = (math.ceil(out_dim / block), math.ceil(in_dim / block))
    if scale.shape != want:
        raise ValueError(f"{name}: FP8 {block}x{block} scale has shape {scale.shape}, weight {w.shape} needs {want}")
    s = e8m0_to_float64(scale)
    s_full = np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:out_dim, :in_dim]
    return w.astype(np.float64) * s_full


def dequant_fp8_rows(w: np.ndarray, scale: np.ndarray, block: int = ENGRAM_SCALE_BLOCK, name: str = "?") -> np.ndarray:
    """FP8 table [N, cols] with one E8M0 scale per 1 x block run of columns (Engram tables)."""
    rows, cols = w.shape
    want = (rows, math.ceil(cols / block))
    if scale.shape != want:
        raise ValueError(f"{name}: per-row FP8 scale has shape {scale.shape}, table {w.shape} needs {want}")
    s_full = np.repeat(e8m0_to_float64(scale), block, axis=1)[:, :cols]
    return w.astype(np.float64) * s_full


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """uint8 [out, in/2] -> E2M1 values [out, in]: byte k holds element 2k (low nibble) and 2k+1 (high)."""
    packed = np.asarray(packed).view(np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return FP4_E2M1_TABLE[codes]


def dequant_fp4(packed: np.ndarray, scale: np.ndarray, block: int = FP4_SCALE_BLOCK, name: str = "?") -> np.ndarray:
    """Packed FP4 weight with one E8M0 scale per 1 x block along K: W = e2m1 * 2^(s - 127)."""
    values = unpack_fp4(packed)
    out_dim, in_dim = values.shape
    want = (out_dim, math.ceil(in_dim / block))
    if scale.shape != want:
        raise ValueError(f"{name}: FP4 scale has shape {scale.shape}, weight [{out_dim}, {in_dim}] needs {want}")
    return values * np.repeat(e8m0_to_float64(scale), block, axis=1)[:, :in_dim]


def _shard_map(ckpt_dir: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from the index json (or a lone model.safetensors)."""
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: ckpt_dir / fname for name, fname in weight_map.items()}
    single = ckpt_dir / "model.safetensors"
    if single.exists():
        return {name: single for name in read_safetensors_header(single)[0]}
    raise FileNotFoundError(f"{ckpt_dir}: neither model.safetensors.index.json nor model.safetensors exists")


def load_reference_weights(
    ckpt_dir: str | Path, keep: Callable[[str], bool] | None = None, fp8_block: int | None = None
) -> dict[str, np.ndarray]:
    """Every tensor of an official-format checkpoint, dequantized to float64, keyed by native name.

    FP8 weights and packed-FP4 (I8) weights are combined with their ``.scale`` companions, which are
    therefore not returned on their own. ``keep(name)`` selects a subset (by the weight's name).
    ``fp8_block`` defaults to ``quantization_config.weight_block_size`` of the directory's config.json
    (32 when absent).
    """
    ckpt_dir = Path(ckpt_dir)
    if fp8_block is None:
        fp8_block = 32
        cfg_path = ckpt_dir / "config.json"
        if cfg_path.exists():
            block = json.loads(cfg_path.read_text()).get("quantization_config", {}).get("weight_block_size")
            if block is not None:
                if block[0] != block[1]:
                    raise ValueError(f"{cfg_path}: non-square weight_block_size {block} is not supported")
                fp8_block = int(block[0])
    shard_of = _shard_map(ckpt_dir)
    headers: dict[Path, tuple[dict, int]] = {}

    def entry(name: str) -> tuple[Path, dict, int]:
        path = shard_of[name]
        if path not in headers:
            headers[path] = read_safetensors_header(path)
        header, start = headers[path]
        if name not in header:
            raise KeyError(f"{path}: the index maps {name} here but the shard header does not list it")
        return path, header[name], start

    def raw(name: str) -> np.ndarray:
        path, ent, start = entry(name)
        return read_raw_tensor(path, name, ent, start)

    out: dict[str, np.ndarray] = {}
    for name in sorted(shard_of):
        if keep is not None and not keep(name):
            continue
        dt = entry(name)[1]["dtype"]
        scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        if dt == "F8_E8M0":
            base = name[: -len("scale")] + "weight" if name.endswith(".scale") else None
            if base is None or base not in shard_of:
                raise ValueError(f"{name}: an E8M0 tensor without the weight it scales")
            continue  # folded into its weight below
        if dt in ("F8_E4M3", "I8"):
            if scale_name is None or scale_name not in shard_of:
                raise ValueError(f"{name}: {dt} weight without its .scale tensor")
            w, s = raw(name), raw(scale_name)
            if dt == "I8":
                out[name] = dequant_fp4(w, s, name=name)
            elif name.endswith(".engram.embed.weight"):
                out[name] = dequant_fp8_rows(w, s, name=name)
            else:
                out[name] = dequant_fp8_blocks(w, s, fp8_block, name=name)
        else:
            out[name] = raw(name).astype(np.float64)
    return out


# ---------------------------------------------------------------------------------------------------------
# Config and layer plan (from the raw config.json dict)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RefConfig:
    """The text-model hyper-parameters the reference needs, read from the root config.json dict."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_original_max_pos: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int | None


def text_config_of(config: dict) -> dict:
    """The ``text_config`` of a root config.json dict (a dict without one is taken as the text config)."""
    return config["text_config"] if "text_config" in config else config


def parse_config(config: dict) -> RefConfig:
    tc = text_config_of(config)

    def get(key, default=KeyError):
        if key in tc:
            return tc[key]
        if default is KeyError:
            raise KeyError(f"config.json text_config lacks the key {key!r}")
        return default

    if get("scoring_func") != "sqrtsoftplus":
        raise ValueError(f"config.json scoring_func={get('scoring_func')!r}: only 'sqrtsoftplus' is specified")
    yarn = get("rope_scaling", None) or {}
    return RefConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_layers=int(get("num_hidden_layers")),
        n_heads=int(get("num_attention_heads")),
        head_dim=int(get("head_dim")),
        rope_dim=int(get("qk_rope_head_dim")),
        q_lora_rank=int(get("q_lora_rank")),
        o_lora_rank=int(get("o_lora_rank")),
        o_groups=int(get("o_groups")),
        swiglu_limit=float(get("swiglu_limit")),
        norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(get("rope_theta")),
        compress_rope_theta=float(get("compress_rope_theta")),
        yarn_factor=float(yarn.get("factor", 1.0)),
        yarn_beta_fast=float(yarn.get("beta_fast", 32)),
        yarn_beta_slow=float(yarn.get("beta_slow", 1)),
        yarn_original_max_pos=int(yarn.get("original_max_position_embeddings", 0)),
        n_routed_experts=int(get("n_routed_experts")),
        n_shared_experts=int(get("n_shared_experts")),
        top_k=int(get("num_experts_per_tok")),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        norm_topk_prob=bool(get("norm_topk_prob")),
        sliding_window=int(get("sliding_window")),
        compress_ratios=tuple(int(r) for r in get("compress_ratios")),
        kv_source_layer_ids=tuple(int(i) for i in get("kv_source_layer_ids", [])),
        index_source_layer_ids=tuple(int(i) for i in get("index_source_layer_ids", [])),
        index_n_heads=int(get("index_n_heads")),
        index_head_dim=int(get("index_head_dim")),
        index_topk=int(get("index_topk")),
        candidate_source_layer_id=get("candidate_source_layer_id", None),
        candidate_topk_blocks=int(get("candidate_topk_blocks", 0)),
        candidate_block_size=int(get("candidate_block_size", 1)),
        hc_mult=int(get("hc_mult")),
        hc_sinkhorn_iters=int(get("hc_sinkhorn_iters")),
        hc_eps=float(get("hc_eps")),
        engram_layer_ids=tuple(int(i) for i in get("engram_layer_ids", [])),
        engram_max_ngram_size=int(get("engram_max_ngram_size", 0)),
        engram_vocab_size=int(get("engram_vocab_size", 0)),
        engram_n_heads=int(get("engram_n_heads", 0)),
        engram_head_dim=int(get("engram_head_dim", 0)),
        engram_pad_token_id=int(get("engram_pad_token_id", 0)),
        engram_compressed_vocab_size=get("engram_compressed_vocab_size", None),
    )


SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


@dataclasses.dataclass(frozen=True)
class RefLayerPlan:
    """What one backbone layer's attention does (§2.4 layer roles)."""

    layer_id: int
    ratio: int  # compress ratio; 0 = sliding window only
    mode: str  # SWA | FULL (own compressor + indexer) | REINDEX (own indexer on a source's KV) | REUSE
    kv_source: int | None  # layer whose compressed KV (and index-K) this layer reads
    index_source: int | None  # layer whose top-k selection this layer uses (itself unless REUSE)
    is_candidate_source: bool  # computes the candidate pool from its own scores
    uses_candidate_pool: bool  # REINDEX on the candidate source's KV: scores masked to the pool
    engram_before: bool  # Engram injection runs on the stream before this block


def layer_plans(config: dict) -> list[RefLayerPlan]:
    """Per-layer roles derived from compress_ratios / kv_source_layer_ids / index_source_layer_ids /
    candidate_source_layer_id / engram_layer_ids (source rule: the latest source at or below the layer)."""
    cfg = parse_config(config)
    ratios = cfg.compress_ratios
    if len(ratios) < cfg.num_layers:
        raise ValueError(f"config.json compress_ratios has {len(ratios)} entries, fewer than {cfg.num_layers} layers")
    kv_ids, idx_ids = set(cfg.kv_source_layer_ids), set(cfg.index_source_layer_ids)
    plans: list[RefLayerPlan] = []
    for layer in range(cfg.num_layers):
        r = ratios[layer]
        engram = layer in cfg.engram_layer_ids
        if r == 0:
            if layer in kv_ids or layer in idx_ids:
                raise ValueError(f"config.json: layer {layer} has compress ratio 0 but is listed as a KV/index source")
            plans.append(RefLayerPlan(layer, 0, SWA, None, None, False, False, engram))
            continue
        kv_below = [s for s in kv_ids if s <= layer]
        idx_below = [s for s in idx_ids if s <= layer]
        if not kv_below or not idx_below:
            raise ValueError(f"config.json: layer {layer} (compress ratio {r}) has no KV/index source at or below it")
        kv_src, idx_src = max(kv_below), max(idx_below)
        for what, src in (("kv_source", kv_src), ("index_source", idx_src)):
            if ratios[src] != r:
                raise ValueError(f"config.json: layer {layer} has ratio {r} but its {what} {src} "
                                 f"has ratio {ratios[src]}")
        if layer in kv_ids:
            if layer not in idx_ids:
                raise ValueError(f"config.json: KV source {layer} is not in index_source_layer_ids")
            mode = FULL
        elif layer in idx_ids:
            mode = REINDEX
        else:
            mode = REUSE
        is_cand = layer == cfg.candidate_source_layer_id
        if is_cand and mode != FULL:
            raise ValueError(f"config.json: candidate_source_layer_id {layer} is not a KV source")
        uses_pool = mode == REINDEX and kv_src == cfg.candidate_source_layer_id
        own_selection = layer if mode != REUSE else idx_src
        plans.append(RefLayerPlan(layer, r, mode, kv_src, own_selection, is_cand, uses_pool, engram))
    for p in plans:  # a REUSE layer's selection indexes its index source's KV source: they must agree
        if p.mode == REUSE and plans[p.index_source].kv_source != p.kv_source:
            raise ValueError(f"config.json: layer {p.layer_id} reads KV of {p.kv_source} but reuses the selection of "
                             f"{p.index_source}, which indexes the KV of {plans[p.index_source].kv_source}")
    return plans


# ---------------------------------------------------------------------------------------------------------
# Simulated quantizers (§2.10), float64 in and out
# ---------------------------------------------------------------------------------------------------------

FP8_MAX, FP4_MAX = 448.0, 6.0


def _ceil_log2(x: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(x)) for positive finite x (via the binary exponent, like the reference's bit trick)."""
    mant, exp = np.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    return np.where(mant == 0.5, exp - 1, exp)


def _blocked(x: np.ndarray, block: int) -> np.ndarray:
    if x.shape[-1] % block:
        raise ValueError(f"quantizer block {block} does not divide the last axis of shape {x.shape}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _round_e4m3(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float4_e2m1fn).astype(np.float64)


def fake_quant_fp8(x: np.ndarray, block: int = 32) -> np.ndarray:
    """FP8-E4M3 per 1 x block along the last axis with a power-of-two (UE8M0) scale."""
    xb = _blocked(np.asarray(x, np.float64), block)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), 1e-4)
    s = np.ldexp(1.0, _ceil_log2(amax / FP8_MAX))
    return (_round_e4m3(np.clip(xb / s, -FP8_MAX, FP8_MAX)) * s).reshape(x.shape)


def fake_quant_fp4_pow2(x: np.ndarray, block: int = 32) -> np.ndarray:
    """FP4-E2M1 per 1 x block with a power-of-two (E8M0) scale (index Q and index K)."""
    xb = _blocked(np.asarray(x, np.float64), block)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), FP4_MAX * 2.0**-126)
    s = np.ldexp(1.0, _ceil_log2(amax / FP4_MAX))
    return (_round_e2m1(np.clip(xb / s, -FP4_MAX, FP4_MAX)) * s).reshape(x.shape)


def fake_quant_fp4_e4m3(x: np.ndarray, block: int = 16) -> np.ndarray:
    """FP4-E2M1 per 1 x block with an ordinary E4M3 scale (compressed KV)."""
    xb = _blocked(np.asarray(x, np.float64), block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    s = _round_e4m3(np.maximum(amax, FP4_MAX * 2.0**-9) / FP4_MAX)
    return (_round_e2m1(np.clip(xb / s, -FP4_MAX, FP4_MAX)) * s).reshape(x.shape)


def _act_quant(x: np.ndarray, fake_quant: bool) -> np.ndarray:
    """Activation quantization in front of an FP8/FP4 GEMM (a no-op unless fake_quant)."""
    return fake_quant_fp8(x) if fake_quant else x


# ---------------------------------------------------------------------------------------------------------
# Small building blocks
# ---------------------------------------------------------------------------------------------------------


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # exact identity; no overflow for large |x|


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis."""
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope_freqs(
    rope_dim: int, ratio: int, rope_theta: float, compress_rope_theta: float, yarn_factor: float,
    yarn_original_max_pos: int, beta_fast: float, beta_slow: float,
) -> np.ndarray:
    """Per-pair angular frequencies [rope_dim / 2].

    ratio 0: theta = rope_theta, no YaRN. ratio > 0: theta = compress_rope_theta with the DeepSeek-YaRN
    ramp between the correction dims of beta_fast and beta_slow (no mscale, §2.4).
    """
    i = np.arange(rope_dim // 2, dtype=np.float64)
    theta = rope_theta if ratio == 0 else compress_rope_theta
    base = theta ** (-2.0 * i / rope_dim)
    if ratio == 0:
        return base

    def correction_dim(beta: float) -> float:
        return rope_dim * math.log(yarn_original_max_pos / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if high == low:
        high += 0.001  # DeepSeek's guard against a zero-width ramp
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    return base * (1.0 - ramp) + (base / yarn_factor) * ramp


def layer_rope_freqs(cfg: RefConfig, ratio: int) -> np.ndarray:
    return rope_freqs(cfg.rope_dim, ratio, cfg.rope_theta, cfg.compress_rope_theta, cfg.yarn_factor,
                      cfg.yarn_original_max_pos, cfg.yarn_beta_fast, cfg.yarn_beta_slow)


def apply_rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate the last 2*len(freqs) dims of x [T, ..., d] as adjacent (real, imag) pairs by position * freq.

    positions [T] are absolute token positions; inverse=True applies the conjugate rotation.
    """
    rd = 2 * len(freqs)
    angle = np.asarray(positions, np.float64)[:, None] * freqs[None, :]  # [T, rd/2]
    angle = angle.reshape(angle.shape[0], *([1] * (x.ndim - 2)), angle.shape[1])
    cos, sin = np.cos(angle), np.sin(angle) * (-1.0 if inverse else 1.0)
    pairs = x[..., x.shape[-1] - rd:].reshape(*x.shape[:-1], rd // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    rotated = np.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(*x.shape[:-1], rd)
    return np.concatenate([x[..., : x.shape[-1] - rd], rotated], axis=-1)


# ---------------------------------------------------------------------------------------------------------
# mHC (§2.3)
# ---------------------------------------------------------------------------------------------------------


def sinkhorn(logits: np.ndarray, iters: int, hc_eps: float) -> np.ndarray:
    """[..., hc, hc] (row j, col k): row softmax + eps, column-normalise, then iters-1 rounds of
    {row-normalise, column-normalise} -- iters normalisations in all, ending on the columns."""
    z = logits - logits.max(axis=-1, keepdims=True)
    c = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True) + hc_eps
    c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + hc_eps)
        c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
    return c


def mhc_mixes(
    x_shd: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, norm_eps: float, hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre [..., hc], post [..., hc], C [..., hc, hc]) from the stream x [..., hc, D].

    fn [(2 + hc) * hc, hc * D] has stream-major columns; one RMS statistic over all hc * D values.
    """
    hc = x_shd.shape[-2]
    f = x_shd.reshape(*x_shd.shape[:-2], -1)
    m = (f @ fn.T) / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + norm_eps)
    pre = sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c_logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    return pre, post, sinkhorn(c_logits, sinkhorn_iters, hc_eps)


def pre_apply(x_shd: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """Collapse the streams: sum_c pre_c * x_c -> [..., D]."""
    return np.einsum("...c,...cd->...d", pre, x_shd)


def post_apply(y: np.ndarray, x_shd: np.ndarray, post: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Expand: out_k = post_k * y + sum_j C[j, k] * x_j -> [..., hc, D]."""
    return post[..., :, None] * y[..., None, :] + np.einsum("...jk,...jd->...kd", c, x_shd)


# ---------------------------------------------------------------------------------------------------------
# Engram (§2.2)
# ---------------------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % f for f in range(3, math.isqrt(n) + 1, 2))


def engram_primes(cfg: RefConfig) -> dict[int, np.ndarray]:
    """layer id -> int64 [max_ngram - 1, n_heads] primes.

    Layers in engram_layer_ids order, orders 2..max, heads: each takes the smallest prime above
    engram_vocab_size - 1 (restarted for every order) that no earlier (layer, order, head) took.
    """
    used: set[int] = set()
    out = {}
    for layer in cfg.engram_layer_ids:
        table = []
        for _order in range(2, cfg.engram_max_ngram_size + 1):
            row = []
            for _head in range(cfg.engram_n_heads):
                p = cfg.engram_vocab_size  # candidates strictly above the restart value vocab - 1
                while p in used or not _is_prime(p):
                    p += 1
                used.add(p)
                row.append(p)
            table.append(row)
        out[layer] = np.array(table, dtype=np.int64)
    return out


def engram_offsets(primes: np.ndarray) -> np.ndarray:
    """int64 [(max_ngram - 1) * n_heads]: column c starts at the sum of the layer's primes before c."""
    flat = primes.reshape(-1)
    return np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)


def engram_multipliers(layer_id: int, max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    """int64 [max_ngram] odd multipliers 2v + 1, v ~ default_rng(10007 * layer_id) in [0, B)."""
    bound = (np.iinfo(np.int64).max // compressed_vocab_size) // 2
    v = np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram, dtype=np.int64)
    return 2 * v + 1


def engram_hash_rows(comp_ids: np.ndarray, primes: np.ndarray, multipliers: np.ndarray, pad: int) -> np.ndarray:
    """Table rows int64 [T, (max_ngram - 1) * n_heads] of a sequence starting at position 0.

    Slot s of position t holds the compressed id at t - s; once t - s < 0 or the id is -1 (dead) every
    further slot holds pad. Rolling R_1 = tok_0 m_0, R_{s+1} = R_s xor tok_s m_s; the (s+1)-gram of head h
    is (R_{s+1} mod primes[s-1, h]) + offset.
    """
    comp_ids = np.asarray(comp_ids, np.int64)
    n_orders, n_heads = primes.shape
    offsets = engram_offsets(primes).reshape(n_orders, n_heads)
    t_len = len(comp_ids)
    tok = np.empty((t_len, n_orders + 1), np.int64)
    alive = np.ones(t_len, bool)
    for s in range(n_orders + 1):
        src = np.arange(t_len) - s
        cand = comp_ids[np.clip(src, 0, None)]
        alive = alive & (src >= 0) & (cand >= 0)
        tok[:, s] = np.where(alive, cand, np.int64(pad))
    rolling = tok[:, 0] * multipliers[0]
    rows = np.empty((t_len, n_orders, n_heads), np.int64)
    for s in range(1, n_orders + 1):
        rolling = rolling ^ (tok[:, s] * multipliers[s])
        rows[:, s - 1, :] = rolling[:, None] % primes[s - 1][None, :] + offsets[s - 1][None, :]
    return rows.reshape(t_len, -1)


def engram_inject(
    x_thd: np.ndarray, rows_tc: np.ndarray, table: np.ndarray, wkv: np.ndarray, q_weight: np.ndarray,
    k_weight: np.ndarray, eps: float, fake_quant: bool = False,
) -> np.ndarray:
    """Gate a looked-up n-gram value into every stream copy separately: [T, hc, D] -> [T, hc, D].

    table [N, dh] (dequantized); wkv [(hc + 1) * D, C * dh]; q_weight, k_weight [hc, D].
    """
    t_len, hc, d = x_thd.shape
    u = table[rows_tc].reshape(t_len, -1)  # [T, C * dh], columns concatenated in column order
    kv = _act_quant(u, fake_quant) @ wkv.T  # [T, (hc + 1) * D]
    keys, val = kv[:, : hc * d].reshape(t_len, hc, d), kv[:, hc * d:]
    w = q_weight * k_weight
    dot = (np.sum(x_thd * w * keys, axis=-1)
           / np.sqrt(np.mean(x_thd * x_thd, axis=-1) + eps)
           / np.sqrt(np.mean(keys * keys, axis=-1) + eps)
           / math.sqrt(d))
    gate = sigmoid(np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6)))  # [T, hc]
    return x_thd + gate[..., None] * val[:, None, :]


# ---------------------------------------------------------------------------------------------------------
# Compressor, indexer, selection (§2.4)
# ---------------------------------------------------------------------------------------------------------


def compress_pairs(x_td: np.ndarray, wkv: np.ndarray, wgate: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """Ratio-2 latents [T // 2, d] (pre-RoPE): per channel softmax over the pair (2j, 2j+1) of gate scores
    weighting the pair's projections; only complete pairs are emitted."""
    n = x_td.shape[0] // 2
    k = (x_td[: 2 * n] @ wkv.T).reshape(n, 2, wkv.shape[0])
    s = (x_td[: 2 * n] @ wgate.T).reshape(n, 2, wgate.shape[0])
    w = np.exp(s - s.max(axis=1, keepdims=True))
    c = np.sum(w * k, axis=1) / np.sum(w, axis=1)
    return rms_norm(c, norm_w, eps)


def compress_ratio1(x_td: np.ndarray, wkv: np.ndarray, norm_w: np.ndarray, eps: float) -> np.ndarray:
    """Ratio-1 latents [T, d] (pre-RoPE): one normalised projection per token, no gate."""
    return rms_norm(x_td @ wkv.T, norm_w, eps)


def visible_count(query_positions: np.ndarray, ratio: int) -> np.ndarray:
    """Compressed entries visible to each query: entry j is visible to position p iff j < (p + 1) // ratio."""
    return (np.asarray(query_positions) + 1) // ratio


def index_scores(
    iq_thk: np.ndarray, head_w_th: np.ndarray, index_k_sk: np.ndarray, query_positions: np.ndarray, ratio: int
) -> np.ndarray:
    """I[t, s] = sum_h w[t, h] * relu(iq[t, h] . K[s]); entries not yet visible get -inf. [T, S]."""
    dots = np.einsum("thk,sk->ths", iq_thk, index_k_sk)
    scores = np.einsum("th,ths->ts", head_w_th, np.maximum(dots, 0.0))
    visible = np.arange(index_k_sk.shape[0])[None, :] < visible_count(query_positions, ratio)[:, None]
    return np.where(visible, scores, -np.inf)


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Per row, the k indices of the largest values; ties go to the lower index."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def candidate_mask(
    scores_ts: np.ndarray, query_positions: np.ndarray, ratio: int, block_size: int, topk_blocks: int
) -> np.ndarray:
    """bool [T, S]: positions inside each query's candidate pool.

    Blocks of block_size positions score the max of their positions; the block holding the newest visible
    position is pinned (+inf); the top topk_blocks reachable blocks (score > -inf) are kept.
    """
    t_len, s_len = scores_ts.shape
    n_blocks = -(-s_len // block_size)
    padded = np.full((t_len, n_blocks * block_size), -np.inf)
    padded[:, :s_len] = scores_ts
    block_scores = padded.reshape(t_len, n_blocks, block_size).max(axis=-1)
    newest = visible_count(query_positions, ratio) - 1
    for t in range(t_len):
        if newest[t] >= 0:
            block_scores[t, newest[t] // block_size] = np.inf
    keep_blocks = np.zeros((t_len, n_blocks), bool)
    top = _top_indices(block_scores, topk_blocks)
    reachable = np.take_along_axis(block_scores, top, axis=-1) > -np.inf
    np.put_along_axis(keep_blocks, top, reachable, axis=-1)
    return np.repeat(keep_blocks, block_size, axis=1)[:, :s_len]


def select_topk(scores_ts: np.ndarray, k: int) -> np.ndarray:
    """int64 [T, k]: per query the k best-scoring reachable positions (ties: lower index) in ascending
    position order, followed by -1 for the slots no reachable position fills."""
    top = _top_indices(scores_ts, min(k, scores_ts.shape[1]))
    reachable = np.take_along_axis(scores_ts, top, axis=-1) > -np.inf
    out = np.full((scores_ts.shape[0], k), -1, np.int64)
    for t in range(scores_ts.shape[0]):
        chosen = np.sort(top[t][reachable[t]])
        out[t, : len(chosen)] = chosen
    return out


def window_indices(t_len: int, window: int) -> np.ndarray:
    """int64 [T, W]: query t's window rows max(0, t - W + 1)..t of the chunk, -1 where before position 0."""
    idx = np.arange(t_len)[:, None] - window + 1 + np.arange(window)[None, :]
    return np.where(idx >= 0, idx, -1)


def sparse_sink_attention(
    q_thd: np.ndarray, kv_nd: np.ndarray, indices_tk: np.ndarray, sink_h: np.ndarray, softmax_scale: float
) -> np.ndarray:
    """o [T, H, d]: softmax attention of each query over the rows indices[t] (-1 = skip) of kv (K = V),
    with the per-head sink logit only enlarging the denominator."""
    valid = indices_tk >= 0
    rows = kv_nd[np.where(valid, indices_tk, 0)]  # [T, K, d]
    z = np.einsum("thd,tkd->thk", q_thd, rows) * softmax_scale
    z = np.where(valid[:, None, :], z, -np.inf)
    # The shift cancels between numerator and denominator; including the sink keeps exp() bounded.
    m = np.maximum(z.max(axis=-1, keepdims=True), sink_h[None, :, None])
    e = np.exp(z - m)
    denom = e.sum(axis=-1, keepdims=True) + np.exp(sink_h[None, :, None] - m)
    return np.einsum("thk,tkd->thd", e / denom, rows)


# ---------------------------------------------------------------------------------------------------------
# MoE (§2.5)
# ---------------------------------------------------------------------------------------------------------


def softplus(x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.softplus semantics (linear above threshold 20)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def route(
    x_td: np.ndarray, gate_w: np.ndarray, gate_bias: np.ndarray, top_k: int, routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids int64 [T, k], routing weights [T, k]): sqrt-softplus scores; the bias only chooses."""
    scores = np.sqrt(softplus(x_td @ gate_w.T))
    idx = _top_indices(scores + gate_bias, top_k)
    w = np.take_along_axis(scores, idx, axis=-1)
    if norm_topk_prob and top_k > 1:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, w * routed_scaling_factor


def swiglu_expert(
    x_td: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: np.ndarray, limit: float,
    route_weight_t: np.ndarray | None = None, fake_quant: bool = False, bf16: bool = False,
) -> np.ndarray:
    """W2 (silu(min(W1 x, limit)) * clamp(W3 x, +-limit) [* routing weight]) -> [T, D].

    bf16: the official reference's roundings in a bf16 model: each GEMM's result written as bf16
    (kernel.py's fp4_gemm / fp8_gemm allocate the default dtype; Expert.forward's ``.float()`` widens g
    and u again) and h cast to bf16 before W2 (``x.to(dtype)``)."""
    rnd = round_bf16 if bf16 else (lambda a: a)
    xq = _act_quant(x_td, fake_quant)
    g = np.minimum(rnd(xq @ w1.T), limit)
    u = np.clip(rnd(xq @ w3.T), -limit, limit)
    h = g * sigmoid(g) * u
    if route_weight_t is not None:
        h = h * route_weight_t[:, None]  # before the down projection and its activation quantization
    return rnd(_act_quant(rnd(h), fake_quant) @ w2.T)


def round_bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to bf16 (to nearest even), as float64."""
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def moe(x_td: np.ndarray, weights: dict, prefix: str, cfg: RefConfig, fake_quant: bool = False):
    """(y [T, D], expert ids [T, k], routing weights [T, k]) of the layer whose ffn lives at ``prefix``."""
    f = f"{prefix}.ffn"
    idx, w = route(x_td, weights[f"{f}.gate.weight"], weights[f"{f}.gate.bias"], cfg.top_k,
                   cfg.routed_scaling_factor, cfg.norm_topk_prob)
    y = np.zeros_like(x_td)
    for e in np.unique(idx):
        tok, slot = np.nonzero(idx == e)
        e_pre = f"{f}.experts.{int(e)}"
        y[tok] += swiglu_expert(x_td[tok], weights[f"{e_pre}.w1.weight"], weights[f"{e_pre}.w2.weight"],
                                weights[f"{e_pre}.w3.weight"], cfg.swiglu_limit, w[tok, slot], fake_quant)
    if cfg.n_shared_experts:
        s_pre = f"{f}.shared_experts"
        y += swiglu_expert(x_td, weights[f"{s_pre}.w1.weight"], weights[f"{s_pre}.w2.weight"],
                           weights[f"{s_pre}.w3.weight"], cfg.swiglu_limit, None, fake_quant)
    return y, idx, w


# ---------------------------------------------------------------------------------------------------------
# Attention layer (§2.4) and the block (§2.3)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Published:
    """The hand-off slots: what sources publish for later layers of the same forward."""

    compressed_kv: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # [S, d] post-RoPE
    index_k: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # [S, dh] post-RoPE
    topk: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # [T, index_topk]
    candidate_mask: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # [T, S]


def attention(
    x_td: np.ndarray, weights: dict, plan: RefLayerPlan, cfg: RefConfig, published: _Published, fake_quant: bool
) -> np.ndarray:
    """One layer's CSA2 attention over the whole causal sequence (positions 0..T-1) -> [T, D]."""
    a = f"layers.{plan.layer_id}.attn"
    t_len, eps, d = x_td.shape[0], cfg.norm_eps, cfg.head_dim
    positions = np.arange(t_len)
    freqs = layer_rope_freqs(cfg, plan.ratio)
    xq = _act_quant(x_td, fake_quant)

    qr = rms_norm(xq @ weights[f"{a}.wq_a.weight"].T, weights[f"{a}.q_norm.weight"], eps)
    q = (_act_quant(qr, fake_quant) @ weights[f"{a}.wq_b.weight"].T).reshape(t_len, cfg.n_heads, d)
    q = apply_rope(q, positions, freqs)

    kv = rms_norm(xq @ weights[f"{a}.wkv.weight"].T, weights[f"{a}.kv_norm.weight"], eps)
    kv = apply_rope(kv, positions, freqs)
    if fake_quant:
        kv = fake_quant_fp8(kv)
    rows, indices = kv, window_indices(t_len, cfg.sliding_window)

    if plan.ratio > 0:
        r = plan.ratio
        if plan.mode == FULL:
            if r == 1:
                latent = compress_ratio1(x_td, weights[f"{a}.compressor.wkv.weight"],
                                         weights[f"{a}.compressor.norm.weight"], eps)
            else:
                if r != 2:
                    raise NotImplementedError(f"layer {plan.layer_id}: compress ratio {r} is not part of V4.1")
                latent = compress_pairs(x_td, weights[f"{a}.compressor.wkv.weight"],
                                        weights[f"{a}.compressor.wgate.weight"],
                                        weights[f"{a}.compressor.norm.weight"], eps)
            entry_pos = np.arange(latent.shape[0]) * r  # each entry sits at its group's first token
            ik = rms_norm(latent @ weights[f"{a}.indexer.wk.weight"].T, weights[f"{a}.indexer.k_norm.weight"], eps)
            ik = apply_rope(ik, entry_pos, freqs)
            ckv = apply_rope(latent, entry_pos, freqs)
            if fake_quant:
                ik, ckv = fake_quant_fp4_pow2(ik), fake_quant_fp4_e4m3(ckv)
            published.index_k[plan.layer_id], published.compressed_kv[plan.layer_id] = ik, ckv

        if plan.mode in (FULL, REINDEX):
            nh, dh = cfg.index_n_heads, cfg.index_head_dim
            iq = (_act_quant(qr, fake_quant) @ weights[f"{a}.indexer.wq_b.weight"].T).reshape(t_len, nh, dh)
            iq = apply_rope(iq, positions, freqs)
            if fake_quant:
                iq = fake_quant_fp4_pow2(iq)
            head_w = (x_td @ weights[f"{a}.indexer.weights_proj.weight"].T) * dh**-0.5 * nh**-0.5
            scores = index_scores(iq, head_w, published.index_k[plan.kv_source], positions, r)
            if plan.is_candidate_source:
                published.candidate_mask[plan.layer_id] = candidate_mask(
                    scores, positions, r, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            if plan.uses_candidate_pool:
                scores = np.where(published.candidate_mask[plan.kv_source], scores, -np.inf)
            published.topk[plan.layer_id] = select_topk(scores, cfg.index_topk)
        topk = published.topk[plan.index_source]
        rows = np.concatenate([kv, published.compressed_kv[plan.kv_source]], axis=0)
        indices = np.concatenate([indices, np.where(topk >= 0, topk + t_len, -1)], axis=1)

    o = sparse_sink_attention(q, rows, indices, weights[f"{a}.attn_sink"], d**-0.5)
    o = apply_rope(o, positions, freqs, inverse=True)
    g = cfg.o_groups
    o_grouped = o.reshape(t_len, g, (cfg.n_heads // g) * d)
    wo_a = weights[f"{a}.wo_a.weight"].reshape(g, cfg.o_lora_rank, (cfg.n_heads // g) * d)
    z = np.einsum("tgi,gri->tgr", o_grouped, wo_a).reshape(t_len, g * cfg.o_lora_rank)  # BF16 einsum: no act quant
    return _act_quant(z, fake_quant) @ weights[f"{a}.wo_b.weight"].T


def block(
    x_thd: np.ndarray, carried_pre: np.ndarray, weights: dict, plan: RefLayerPlan, cfg: RefConfig,
    published: _Published, fake_quant: bool,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """One V4.1 block with the delayed pre of §2.3: returns (stream [T, hc, D], next pre [T, hc], debug)."""
    pre = f"layers.{plan.layer_id}"
    mix = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    a_pre, a_post, a_c = mhc_mixes(x_thd, weights[f"{pre}.hc_attn_fn"], weights[f"{pre}.hc_attn_base"],
                                   weights[f"{pre}.hc_attn_scale"], **mix)
    x = rms_norm(pre_apply(x_thd, carried_pre), weights[f"{pre}.attn_norm.weight"], cfg.norm_eps)
    x_thd = post_apply(attention(x, weights, plan, cfg, published, fake_quant), x_thd, a_post, a_c)
    f_pre, f_post, f_c = mhc_mixes(x_thd, weights[f"{pre}.hc_ffn_fn"], weights[f"{pre}.hc_ffn_base"],
                                   weights[f"{pre}.hc_ffn_scale"], **mix)
    x = rms_norm(pre_apply(x_thd, a_pre), weights[f"{pre}.ffn_norm.weight"], cfg.norm_eps)
    y, expert_idx, expert_w = moe(x, weights, pre, cfg, fake_quant)
    x_thd = post_apply(y, x_thd, f_post, f_c)
    return x_thd, f_pre, {"expert_ids": expert_idx, "expert_weights": expert_w}


# ---------------------------------------------------------------------------------------------------------
# Whole forward (§2.1, 2.6)
# ---------------------------------------------------------------------------------------------------------


def engram_layouts(cfg: RefConfig) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """layer id -> (primes [max_ngram - 1, heads], multipliers [max_ngram])."""
    if not cfg.engram_layer_ids:
        return {}
    if cfg.engram_compressed_vocab_size is None:
        raise ValueError("config.json engram_compressed_vocab_size is unset (null) but Engram layers are listed")
    primes = engram_primes(cfg)
    return {layer: (primes[layer], engram_multipliers(layer, cfg.engram_max_ngram_size,
                                                      int(cfg.engram_compressed_vocab_size)))
            for layer in cfg.engram_layer_ids}


def reference_forward(
    config: dict, weights: dict[str, np.ndarray], token_ids: list[int], token_map: np.ndarray, *,
    fake_quant: bool = False, return_hidden: bool = True,
) -> dict:
    """Causal float64 forward of the whole sequence (positions 0..T-1); position t sees tokens <= t only.

    Returns ``logits`` [T, V]; ``hidden`` (list over layers of the stream after each block, [T, hc, D]) when
    return_hidden; ``topk`` {layer: int64 [T, index_topk]} for every compressed layer (REUSE layers hold
    their source's array); ``candidate_mask`` {layer: bool [T, S]}; ``engram_rows`` {layer: int64 [T, C]};
    ``expert_ids``/``expert_weights`` {layer: [T, k]}; ``final_hidden`` [T, D] (the normed head input).
    """
    cfg = parse_config(config)
    plans = layer_plans(config)
    ids = np.asarray(token_ids, np.int64)
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D list, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}); got [{ids.min()}, {ids.max()}]")
    token_map = np.asarray(token_map, np.int64)

    engram_rows = {}
    if cfg.engram_layer_ids:
        pad = int(token_map[cfg.engram_pad_token_id])
        for layer, (primes, mult) in engram_layouts(cfg).items():
            engram_rows[layer] = engram_hash_rows(token_map[ids], primes, mult, pad)

    hc = cfg.hc_mult
    x_thd = np.repeat(weights["embed.weight"][ids][:, None, :], hc, axis=1)
    carried_pre = np.zeros((len(ids), hc))
    carried_pre[:, 0] = 1.0
    published = _Published()
    hidden, expert_ids, expert_weights, topk = [], {}, {}, {}
    for plan in plans:
        if plan.engram_before:
            e = f"layers.{plan.layer_id}.engram"
            x_thd = engram_inject(x_thd, engram_rows[plan.layer_id], weights[f"{e}.embed.weight"],
                                  weights[f"{e}.wkv.weight"], weights[f"{e}.q_weight"], weights[f"{e}.k_weight"],
                                  cfg.norm_eps, fake_quant)
        x_thd, carried_pre, dbg = block(x_thd, carried_pre, weights, plan, cfg, published, fake_quant)
        expert_ids[plan.layer_id], expert_weights[plan.layer_id] = dbg["expert_ids"], dbg["expert_weights"]
        if plan.ratio > 0:
            topk[plan.layer_id] = published.topk[plan.index_source]
        if return_hidden:
            hidden.append(x_thd.copy())
    h = rms_norm(pre_apply(x_thd, carried_pre), weights["norm.weight"], cfg.norm_eps)
    out = {
        "logits": h @ weights["head.weight"].T,
        "topk": topk,
        "candidate_mask": dict(published.candidate_mask),
        "engram_rows": engram_rows,
        "expert_ids": expert_ids,
        "expert_weights": expert_weights,
        "final_hidden": h,
    }
    if return_hidden:
        out["hidden"] = hidden
    return out


# ---------------------------------------------------------------------------------------------------------
# Random weights (for tests that need no checkpoint)
# ---------------------------------------------------------------------------------------------------------


def reference_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Native name -> shape of every backbone tensor the reference reads (dequantized; no .scale tensors)."""
    cfg = parse_config(config)
    d, hd, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    mix = (2 + hc) * hc
    inter = int(text_config_of(config)["moe_intermediate_size"])
    heads_per_group = cfg.n_heads // cfg.o_groups
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, d), "head.weight": (cfg.vocab_size, d), "norm.weight": (d,)}
    layouts = engram_layouts(cfg)
    for plan in layer_plans(config):
        p = f"layers.{plan.layer_id}"
        for site in ("attn", "ffn"):
            shapes[f"{p}.{site}_norm.weight"] = (d,)
            shapes[f"{p}.hc_{site}_fn"] = (mix, hc * d)
            shapes[f"{p}.hc_{site}_base"] = (mix,)
            shapes[f"{p}.hc_{site}_scale"] = (3,)
        a = f"{p}.attn"
        shapes.update({
            f"{a}.attn_sink": (cfg.n_heads,), f"{a}.wq_a.weight": (cfg.q_lora_rank, d),
            f"{a}.q_norm.weight": (cfg.q_lora_rank,), f"{a}.wq_b.weight": (cfg.n_heads * hd, cfg.q_lora_rank),
            f"{a}.wkv.weight": (hd, d), f"{a}.kv_norm.weight": (hd,),
            f"{a}.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads_per_group * hd),
            f"{a}.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
        })
        if plan.mode == FULL:
            shapes[f"{a}.compressor.wkv.weight"] = (hd, d)
            if plan.ratio > 1:
                shapes[f"{a}.compressor.wgate.weight"] = (hd, d)
            shapes[f"{a}.compressor.norm.weight"] = (hd,)
            shapes[f"{a}.indexer.wk.weight"] = (cfg.index_head_dim, hd)
            shapes[f"{a}.indexer.k_norm.weight"] = (cfg.index_head_dim,)
        if plan.mode in (FULL, REINDEX):
            shapes[f"{a}.indexer.wq_b.weight"] = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            shapes[f"{a}.indexer.weights_proj.weight"] = (cfg.index_n_heads, d)
        f = f"{p}.ffn"
        shapes[f"{f}.gate.weight"] = (cfg.n_routed_experts, d)
        shapes[f"{f}.gate.bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            shapes[f"{f}.experts.{e}.w1.weight"] = (inter, d)
            shapes[f"{f}.experts.{e}.w3.weight"] = (inter, d)
            shapes[f"{f}.experts.{e}.w2.weight"] = (d, inter)
        if cfg.n_shared_experts:
            shared = inter * cfg.n_shared_experts
            shapes[f"{f}.shared_experts.w1.weight"] = (shared, d)
            shapes[f"{f}.shared_experts.w3.weight"] = (shared, d)
            shapes[f"{f}.shared_experts.w2.weight"] = (d, shared)
        if plan.engram_before:
            e = f"{p}.engram"
            n_rows = int(layouts[plan.layer_id][0].sum())
            n_cols = layouts[plan.layer_id][0].size
            shapes[f"{e}.embed.weight"] = (n_rows, cfg.engram_head_dim)
            shapes[f"{e}.wkv.weight"] = ((hc + 1) * d, n_cols * cfg.engram_head_dim)
            shapes[f"{e}.q_weight"] = (hc, d)
            shapes[f"{e}.k_weight"] = (hc, d)
    return shapes


def random_reference_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float64 weights of sensible scale: linears ~ N(0, 1/in), norm weights ~ 1, mHC mixes small."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in reference_weight_shapes(config).items():
        if name.endswith("norm.weight") or name.endswith("q_weight") or name.endswith("k_weight"):
            out[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("_fn"):
            out[name] = rng.standard_normal(shape) / math.sqrt(shape[1])
        elif name.endswith("_base") or name.endswith("_scale") or name.endswith("attn_sink"):
            out[name] = rng.standard_normal(shape)
        elif name.endswith("gate.bias"):
            out[name] = 0.1 * rng.standard_normal(shape)
        elif name in ("embed.weight",) or name.endswith("engram.embed.weight"):
            out[name] = rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) / math.sqrt(shape[-1])
    return out
