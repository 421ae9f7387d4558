"""The checkpoint's tensor list, derived from the config: native name -> (safetensors dtype, shape, group).

This is the one source of truth for what a checkpoint must contain. The loader checks every tensor of a
real checkpoint against it, and ``checkpoints/make_tiny.py`` writes exactly these tensors.
"""

from __future__ import annotations

import dataclasses
import math

from deepinfer_jax.config import AttnMode, ModelConfig

FP4_BLOCK = 32  # FP4 experts: one E8M0 scale per 1x32 along K, whatever the FP8 block size is.

BACKBONE = "backbone"  # what plain generation needs
IMAGE = "image"  # learned image-span vectors (loaded, unused by text-only generation)
DSPARK = "dspark"  # the draft head, mtp.*


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype string: BF16, F32, F8_E4M3, F8_E8M0, I8, I64
    shape: tuple[int, ...]
    group: str = BACKBONE


def _fp8_linear(prefix: str, out_dim: int, in_dim: int, block: int, group: str) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}.weight", "F8_E4M3", (out_dim, in_dim), group),
        TensorSpec(f"{prefix}.scale", "F8_E8M0", (math.ceil(out_dim / block), math.ceil(in_dim / block)), group),
    ]


def _fp4_linear(prefix: str, out_dim: int, in_dim: int, group: str) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}.weight", "I8", (out_dim, in_dim // 2), group),
        TensorSpec(f"{prefix}.scale", "F8_E8M0", (out_dim, math.ceil(in_dim / FP4_BLOCK)), group),
    ]


def _block_specs(cfg: ModelConfig, prefix: str, n_experts: int, group: str) -> list[TensorSpec]:
    """Tensors every V4.1 block has (backbone layers and DSpark stages alike)."""
    d, b = cfg.hidden_size, cfg.quant.block
    h, hd = cfg.num_attention_heads, cfg.head_dim
    hc = cfg.hc_mult
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + hc x hc combination
    inter = cfg.moe_intermediate_size
    s: list[TensorSpec] = []
    for site in ("attn", "ffn"):
        s.append(TensorSpec(f"{prefix}.{site}_norm.weight", "BF16", (d,), group))
        s.append(TensorSpec(f"{prefix}.hc_{site}_fn", "F32", (mix, hc * d), group))
        s.append(TensorSpec(f"{prefix}.hc_{site}_base", "F32", (mix,), group))
        s.append(TensorSpec(f"{prefix}.hc_{site}_scale", "F32", (3,), group))
    a = f"{prefix}.attn"
    s.append(TensorSpec(f"{a}.attn_sink", "F32", (h,), group))
    s += _fp8_linear(f"{a}.wq_a", cfg.q_lora_rank, d, b, group)
    s.append(TensorSpec(f"{a}.q_norm.weight", "BF16", (cfg.q_lora_rank,), group))
    s += _fp8_linear(f"{a}.wq_b", h * hd, cfg.q_lora_rank, b, group)
    s += _fp8_linear(f"{a}.wkv", hd, d, b, group)
    s.append(TensorSpec(f"{a}.kv_norm.weight", "BF16", (hd,), group))
    s += _fp8_linear(f"{a}.wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.heads_per_group * hd, b, group)
    s += _fp8_linear(f"{a}.wo_b", d, cfg.o_groups * cfg.o_lora_rank, b, group)
    f = f"{prefix}.ffn"
    s.append(TensorSpec(f"{f}.gate.weight", "BF16", (n_experts, d), group))
    s.append(TensorSpec(f"{f}.gate.bias", "F32", (n_experts,), group))
    s.append(TensorSpec(f"{f}.gate.bias_vl", "F32", (n_experts,), group))
    for e in range(n_experts):
        s += _fp4_linear(f"{f}.experts.{e}.w1", inter, d, group)
        s += _fp4_linear(f"{f}.experts.{e}.w3", inter, d, group)
        s += _fp4_linear(f"{f}.experts.{e}.w2", d, inter, group)
    shared = inter * cfg.n_shared_experts
    s += _fp8_linear(f"{f}.shared_experts.w1", shared, d, b, group)
    s += _fp8_linear(f"{f}.shared_experts.w3", shared, d, b, group)
    s += _fp8_linear(f"{f}.shared_experts.w2", d, shared, b, group)
    return s


def _layer_extras(cfg: ModelConfig, layer_id: int) -> list[TensorSpec]:
    plan = cfg.layer_plan(layer_id)
    d, b = cfg.hidden_size, cfg.quant.block
    a = f"layers.{layer_id}.attn"
    s: list[TensorSpec] = []
    if plan.mode is AttnMode.FULL:
        s.append(TensorSpec(f"{a}.compressor.wkv.weight", "BF16", (cfg.head_dim, d)))
        if plan.ratio > 1:
            s.append(TensorSpec(f"{a}.compressor.wgate.weight", "BF16", (cfg.head_dim, d)))
        s.append(TensorSpec(f"{a}.compressor.norm.weight", "BF16", (cfg.head_dim,)))
        s.append(TensorSpec(f"{a}.indexer.wk.weight", "BF16", (cfg.index_head_dim, cfg.head_dim)))
        s.append(TensorSpec(f"{a}.indexer.k_norm.weight", "BF16", (cfg.index_head_dim,)))
    if plan.has_index_query:
        s += _fp8_linear(f"{a}.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, b, BACKBONE)
        s.append(TensorSpec(f"{a}.indexer.weights_proj.weight", "BF16", (cfg.index_n_heads, d)))
    if plan.has_engram:
        e = f"layers.{layer_id}.engram"
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer_id)]
        s.append(TensorSpec(f"{e}.embed.weight", "F8_E4M3", (rows, cfg.engram_head_dim)))
        s.append(TensorSpec(f"{e}.embed.scale", "F8_E8M0", (rows, math.ceil(cfg.engram_head_dim / 32))))
        s += _fp8_linear(f"{e}.wkv", (cfg.hc_mult + 1) * d, cfg.engram_embed_dim, b, BACKBONE)
        s.append(TensorSpec(f"{e}.q_weight", "BF16", (cfg.hc_mult, d)))
        s.append(TensorSpec(f"{e}.k_weight", "BF16", (cfg.hc_mult, d)))
    return s


def _v4_block_specs(cfg: ModelConfig, prefix: str, layer_id: int, group: str) -> list[TensorSpec]:
    """A V4-Flash block (spec §5.3): the V4.1 block without ``gate.bias_vl``, hash layers holding
    ``gate.tid2eid`` instead of ``gate.bias``, plus the per-layer compressor / indexer of its ratio."""
    d, b = cfg.hidden_size, cfg.quant.block
    s = [sp for sp in _block_specs(cfg, prefix, cfg.n_routed_experts, group)
         if not sp.name.endswith(("gate.bias_vl", "gate.bias"))]
    hashed = layer_id < cfg.num_hash_layers
    f = f"{prefix}.ffn.gate"
    s.append(TensorSpec(f"{f}.tid2eid", "I64", (cfg.vocab_size, cfg.num_experts_per_tok), group) if hashed
             else TensorSpec(f"{f}.bias", "F32", (cfg.n_routed_experts,), group))
    ratio = cfg.compress_ratios[layer_id]
    a = f"{prefix}.attn"
    if ratio:
        width = 2 * cfg.head_dim if ratio == 4 else cfg.head_dim  # ratio 4: two halves (overlap)
        s += [TensorSpec(f"{a}.compressor.ape", "F32", (ratio, width), group),
              TensorSpec(f"{a}.compressor.wkv.weight", "BF16", (width, d), group),
              TensorSpec(f"{a}.compressor.wgate.weight", "BF16", (width, d), group),
              TensorSpec(f"{a}.compressor.norm.weight", "BF16", (cfg.head_dim,), group)]
    if ratio == 4:
        iw = 2 * cfg.index_head_dim
        s += _fp8_linear(f"{a}.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, b, group)
        s += [TensorSpec(f"{a}.indexer.weights_proj.weight", "BF16", (cfg.index_n_heads, d), group),
              TensorSpec(f"{a}.indexer.compressor.ape", "F32", (ratio, iw), group),
              TensorSpec(f"{a}.indexer.compressor.wkv.weight", "BF16", (iw, d), group),
              TensorSpec(f"{a}.indexer.compressor.wgate.weight", "BF16", (iw, d), group),
              TensorSpec(f"{a}.indexer.compressor.norm.weight", "BF16", (cfg.index_head_dim,), group)]
    return s


def _hc_head_specs(cfg: ModelConfig, prefix: str, group: str) -> list[TensorSpec]:
    hc, d = cfg.hc_mult, cfg.hidden_size
    return [TensorSpec(f"{prefix}hc_head_fn", "F32", (hc, hc * d), group),
            TensorSpec(f"{prefix}hc_head_base", "F32", (hc,), group),
            TensorSpec(f"{prefix}hc_head_scale", "F32", (1,), group)]


def _v4_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """V4-Flash (spec §5.3): backbone layers, the final hc_head, and the MTP layer(s) ``mtp.{s}``
    (group DSPARK: loaded on request; its layer id is num_hidden_layers + s, so it has that ratio)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("embed.weight", "BF16", (v, d)), TensorSpec("head.weight", "BF16", (v, d)),
             TensorSpec("norm.weight", "BF16", (d,))] + _hc_head_specs(cfg, "", BACKBONE)
    for layer_id in range(cfg.num_hidden_layers):
        specs += _v4_block_specs(cfg, f"layers.{layer_id}", layer_id, BACKBONE)
    for st in range(cfg.num_nextn_predict_layers):
        m = f"mtp.{st}"
        specs += _v4_block_specs(cfg, m, cfg.num_hidden_layers + st, DSPARK)
        specs += _fp8_linear(f"{m}.e_proj", d, d, cfg.quant.block, DSPARK)
        specs += _fp8_linear(f"{m}.h_proj", d, d, cfg.quant.block, DSPARK)
        specs += [TensorSpec(f"{m}.{k}.weight", "BF16", (d,), DSPARK) for k in ("enorm", "hnorm", "norm")]
        specs += _hc_head_specs(cfg, f"{m}.", DSPARK)
    return specs


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the official checkpoint except the vision tower (``vision.*``, ``aligner.*``)."""
    if cfg.variant == "v4":
        return _unique(_v4_specs(cfg))
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [
        TensorSpec("embed.weight", "BF16", (v, d)),
        TensorSpec("head.weight", "BF16", (v, d)),
        TensorSpec("norm.weight", "BF16", (d,)),
    ] + [TensorSpec(f"image_{k}", "BF16", (d,), IMAGE) for k in ("start", "end", "newline")]
    for layer_id in range(cfg.num_hidden_layers):
        specs += _block_specs(cfg, f"layers.{layer_id}", cfg.n_routed_experts, BACKBONE)
        specs += _layer_extras(cfg, layer_id)
    n_stages = cfg.num_nextn_predict_layers
    for st in range(n_stages):
        specs += _block_specs(cfg, f"mtp.{st}", cfg.dspark_n_routed_experts, DSPARK)
    if n_stages:
        taps = len(cfg.dspark_target_layer_ids)
        specs += _fp8_linear("mtp.0.main_proj", d, taps * d, cfg.quant.block, DSPARK)
        specs.append(TensorSpec("mtp.0.main_norm.weight", "BF16", (d,), DSPARK))
        last = f"mtp.{n_stages - 1}"
        r = cfg.dspark_markov_rank
        specs += [
            TensorSpec(f"{last}.norm.weight", "BF16", (d,), DSPARK),
            TensorSpec(f"{last}.markov_head.embed.weight", "BF16", (v, r), DSPARK),
            TensorSpec(f"{last}.markov_head.head.weight", "BF16", (v, r), DSPARK),
            TensorSpec(f"{last}.confidence_head.proj.weight", "BF16", (1, d + r), DSPARK),
        ]
    return _unique(specs)


def _unique(specs: list[TensorSpec]) -> dict[str, TensorSpec]:
    out = {}
    for sp in specs:
        if sp.name in out:
            raise AssertionError(f"duplicate tensor name {sp.name}")
        out[sp.name] = sp
    return out


IGNORED_PREFIXES = ("vision.", "aligner.")
