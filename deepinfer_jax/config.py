"""ModelConfig (read from the official ``config.json``) and the per-layer plan derived from it.

The plan is never hard-coded: every layer's role (SWA-only / KV source / re-index / reuse), its KV and
index sources, its RoPE table and whether Engram runs before it all follow from the config keys, so the
same code runs the real 40-layer V4.1-Flash and the tiny test checkpoints.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json key is missing, unknown, or inconsistent with the others."""


class AttnMode(enum.Enum):
    SWA = "swa"  # sliding window only (ratio 0)
    FULL = "full"  # own compressor + own indexer; publishes compressed KV and index-K
    REINDEX = "reindex"  # own indexer queries/weights over its KV source's index-K
    REUSE = "reuse"  # reuses the KV source's KV and the index source's top-k verbatim


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    theta: float
    yarn_factor: float  # 1.0 = no YaRN
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_original_len: int


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    layer_id: int
    ratio: int
    mode: AttnMode
    kv_source: int | None  # layer whose compressed KV this layer reads (None for SWA)
    index_source: int | None  # layer whose top-k this layer uses (REUSE) / whose index-K it scores
    is_candidate_source: bool
    uses_candidate_mask: bool  # REINDEX layers restricted to the candidate pool
    has_engram: bool
    rope: RopeSpec
    # V4-Flash only (defaults = V4.1): ratio-4 compressors pool overlapping windows (previous window's
    # first half + this window's second half) and own a Hadamard-rotated indexer; ratio-128 compressors
    # have no indexer (every visible entry is attended); the first num_hash_layers route by token id.
    overlap: bool = False
    has_indexer: bool = True
    hash_routed: bool = False

    @property
    def has_compressor(self) -> bool:
        return self.mode is AttnMode.FULL

    @property
    def has_index_query(self) -> bool:
        return self.mode in (AttnMode.FULL, AttnMode.REINDEX) and self.has_indexer


# Keys read from text_config (V4.1) or the root (V4). Values are the defaults used when a key is absent;
# ``_REQUIRED`` marks keys that must be present.
_REQUIRED = object()
_TEXT_KEYS: dict[str, Any] = {
    "vocab_size": _REQUIRED,
    "hidden_size": _REQUIRED,
    "num_hidden_layers": _REQUIRED,
    "moe_intermediate_size": _REQUIRED,
    "num_attention_heads": _REQUIRED,
    "num_key_value_heads": 1,
    "head_dim": _REQUIRED,
    "qk_rope_head_dim": _REQUIRED,
    "q_lora_rank": _REQUIRED,
    "o_lora_rank": _REQUIRED,
    "o_groups": _REQUIRED,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_cache": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": _REQUIRED,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "compress_rope_theta": 160000.0,
    "n_routed_experts": _REQUIRED,
    "n_shared_experts": 1,
    "num_experts_per_tok": _REQUIRED,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "sliding_window": _REQUIRED,
    "compress_ratios": _REQUIRED,
    "kv_source_layer_ids": None,
    "index_source_layer_ids": None,
    "index_n_heads": _REQUIRED,
    "index_head_dim": _REQUIRED,
    "index_topk": _REQUIRED,
    "candidate_source_layer_id": None,
    "candidate_topk_blocks": 0,
    "candidate_block_size": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": (),
    "engram_num_embeddings": (),
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 0,
    "engram_n_heads": 0,
    "engram_head_dim": 0,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 0,
    "num_nextn_predict_layers": 0,
    "dspark_block_size": 0,
    "dspark_noise_token_id": None,
    "dspark_target_layer_ids": (),
    "dspark_markov_rank": 0,
    "dspark_n_routed_experts": 0,
    "dspark_num_experts_per_tok": 0,
    "num_hash_layers": 0,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
}
# Keys accepted and ignored (bookkeeping of the HF files, or parts we do not run: vision).
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "image_token_id",
    "vision_config", "text_config", "quantization_config", "auto_map", "_name_or_path",
    "expert_dtype",  # V4-Flash's later revision puts it at the root; folded into QuantConfig below
}
_MODEL_TYPES = {"deepseek_v41": "v4.1", "deepseek_v41_text": "v4.1", "deepseek_v4": "v4"}
V4_REVISIONS = ("current", "initial")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    activation_scheme: str = "dynamic"

    @property
    def block(self) -> int:
        return self.weight_block_size[0]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every key of the official config, typed. Build with :meth:`from_json` / :meth:`from_dict`."""

    variant: str  # "v4.1" or "v4"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    moe_intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    hidden_act: str
    swiglu_limit: float
    rms_norm_eps: float
    attention_bias: bool
    attention_dropout: float
    use_cache: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None
    compress_rope_theta: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
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
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int | None
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    num_hash_layers: int
    initializer_range: float
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int | None
    quant: QuantConfig = QuantConfig()
    # Which revision of V4-Flash's reference to follow (spec §3.9 / §10.7; not a config.json key): "current"
    # (60d8d707, the official reading) clamps the shared expert and rounds the KV to FP8; "initial"
    # (efc85512, what most public copies of inference/ hold) does neither. Set with dataclasses.replace.
    v4_revision: str = "current"

    def __post_init__(self):
        if self.v4_revision not in V4_REVISIONS:  # checked here too: dataclasses.replace skips validate()
            raise ConfigError(f"v4_revision must be one of {V4_REVISIONS}, got {self.v4_revision!r}")

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        model_type = raw.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported (expected one of {sorted(_MODEL_TYPES)})"
            )
        text = raw.get("text_config", raw)
        where = f"{source}:text_config" if "text_config" in raw else source
        # Root-level keys that V4.1 keeps outside text_config (token ids) are merged in.
        merged = dict(text)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in raw and k not in merged:
                merged[k] = raw[k]
        unknown = sorted(set(merged) - set(_TEXT_KEYS) - _IGNORED_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; refusing to guess their meaning")
        values: dict[str, Any] = {}
        for key, default in _TEXT_KEYS.items():
            if key in merged:
                values[key] = merged[key]
            elif default is _REQUIRED:
                raise ConfigError(f"{where}: required key {key!r} is missing")
            else:
                values[key] = default
        for key in ("compress_ratios", "engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids"):
            values[key] = tuple(int(v) for v in values[key])
        for key in ("kv_source_layer_ids", "index_source_layer_ids"):
            if values[key] is not None:
                values[key] = tuple(int(v) for v in values[key])
        rs = values["rope_scaling"]
        values["rope_scaling"] = None if rs is None else tuple(sorted(rs.items()))
        variant = _MODEL_TYPES[model_type]
        if variant == "v4":
            # V4 has no cross-layer sharing: every compressed layer is its own source.
            n = values["num_hidden_layers"]
            own = tuple(i for i in range(n) if values["compress_ratios"][i] > 0)
            values["kv_source_layer_ids"] = values["kv_source_layer_ids"] or own
            values["index_source_layer_ids"] = values["index_source_layer_ids"] or tuple(
                i for i in own if values["compress_ratios"][i] == 4
            )
        values["kv_source_layer_ids"] = values["kv_source_layer_ids"] or ()
        values["index_source_layer_ids"] = values["index_source_layer_ids"] or ()
        q = raw.get("quantization_config") or {}
        quant = QuantConfig(
            quant_method=q.get("quant_method", "fp8"),
            weight_block_size=tuple(q.get("weight_block_size", (32, 32) if variant == "v4.1" else (128, 128))),
            scale_fmt=q.get("scale_fmt", "ue8m0"),
            expert_dtype=q.get("expert_dtype", raw.get("expert_dtype", "fp4")),
            activation_scheme=q.get("activation_scheme", "dynamic"),
        )
        cfg = cls(variant=variant, quant=quant, **values)
        cfg.validate(where)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The official root config.json layout (V4.1: nested text_config)."""
        text = {}
        for f in dataclasses.fields(self):
            if f.name in ("variant", "quant", "v4_revision"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, tuple) and f.name == "rope_scaling":
                v = dict(v)
            elif isinstance(v, tuple):
                v = list(v)
            text[f.name] = v
        quant = {
            "quant_method": self.quant.quant_method,
            "activation_scheme": self.quant.activation_scheme,
            "weight_block_size": list(self.quant.weight_block_size),
            "scale_fmt": self.quant.scale_fmt,
            "expert_dtype": self.quant.expert_dtype,
        }
        if self.variant == "v4":
            return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                    "torch_dtype": "bfloat16", "quantization_config": quant, **text}
        root = {k: text.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        text["model_type"] = "deepseek_v41_text"
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
                **root, "quantization_config": quant, "text_config": text}

    # ----------------------------------------------------------------------------------------------
    def validate(self, where: str = "config") -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{where}: {key} {why}")

        n = self.num_hidden_layers
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "moe_intermediate_size",
                    "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                    "n_routed_experts", "num_experts_per_tok", "sliding_window", "hc_mult"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                raise bad(key, f"must be a positive integer, got {getattr(self, key)!r}")
        if self.num_key_value_heads != 1:
            raise bad("num_key_value_heads", f"must be 1 (MQA with a shared K=V latent), got {self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise bad("hidden_act", f"must be 'silu', got {self.hidden_act!r}")
        if self.scoring_func != "sqrtsoftplus":
            raise bad("scoring_func", f"must be 'sqrtsoftplus', got {self.scoring_func!r}")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", f"must be even and in (0, head_dim={self.head_dim}]")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise bad("qk_rope_head_dim", f"exceeds index_head_dim={self.index_head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise bad("o_groups", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise bad("num_experts_per_tok", f"exceeds n_routed_experts={self.n_routed_experts}")
        expect_len = n + self.num_nextn_predict_layers
        if len(self.compress_ratios) != expect_len:
            raise bad("compress_ratios", f"has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
                      f"num_nextn_predict_layers = {expect_len}")
        allowed = {0, 1, 2} if self.variant == "v4.1" else {0, 4, 128}
        for i, r in enumerate(self.compress_ratios):
            if r not in allowed:
                raise bad("compress_ratios", f"entry {i} = {r} is not one of {sorted(allowed)} for {self.variant}")
        for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, key)
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                raise bad(key, f"must be strictly increasing layer ids in [0, {n}), got {list(ids)}")
        for s in self.kv_source_layer_ids:
            if self.compress_ratios[s] == 0:
                raise bad("kv_source_layer_ids", f"layer {s} has compress ratio 0 and cannot be a KV source")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids) and self.variant == "v4.1":
            raise bad("index_source_layer_ids", "must contain every KV source layer (they own the index-K)")
        if self.candidate_source_layer_id is not None:
            if self.candidate_source_layer_id not in self.kv_source_layer_ids:
                raise bad("candidate_source_layer_id", f"{self.candidate_source_layer_id} is not a KV source layer")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                raise bad("candidate_topk_blocks", "and candidate_block_size must be positive with a candidate source")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise bad("engram_num_embeddings", f"has {len(self.engram_num_embeddings)} entries for "
                      f"{len(self.engram_layer_ids)} engram layers")
        if self.engram_layer_ids:
            if self.engram_max_ngram_size < 2 or self.engram_n_heads <= 0 or self.engram_head_dim <= 0:
                raise bad("engram_max_ngram_size", "/ engram_n_heads / engram_head_dim must be >= 2 / > 0 / > 0")
            from deepinfer_jax.model.engram_hash import engram_primes  # local: avoids a cycle

            for lid, total in zip(self.engram_layer_ids, self.engram_num_embeddings):
                got = sum(sum(p) for p in engram_primes(self, lid))
                if got != total:
                    raise bad("engram_num_embeddings", f"entry for layer {lid} is {total}, but the prime layout "
                              f"derived from engram_vocab_size={self.engram_vocab_size} sums to {got}")
        if not 0 <= self.num_hash_layers <= n:
            raise bad("num_hash_layers", f"must be in [0, num_hidden_layers={n}], got {self.num_hash_layers}")
        if self.variant == "v4":
            if self.index_head_dim & (self.index_head_dim - 1):
                raise bad("index_head_dim", f"must be a power of two (Hadamard-rotated indexer), got {self.index_head_dim}")
            if self.sliding_window < 1:
                raise bad("sliding_window", "must be positive")
        for i in range(n):
            self.layer_plan(i)  # raises on an inconsistent plan
        if self.quant.block <= 0 or self.quant.weight_block_size[0] != self.quant.weight_block_size[1]:
            raise ConfigError(f"{where}: quantization_config.weight_block_size must be square, "
                              f"got {list(self.quant.weight_block_size)}")

    # ----------------------------------------------------------------------------------------------
    # Architecture switches that differ between the variants (spec §3); derived, never separate keys.
    @property
    def per_head_q_norm(self) -> bool:
        """V4: unweighted RMS norm of each query head before RoPE (V4.1 removed it)."""
        return self.variant == "v4"

    @property
    def delayed_pre_mhc(self) -> bool:
        """V4.1: each site collapses with the previous site's pre (§2.3); V4: with its own (§3.4)."""
        return self.variant == "v4.1"

    @property
    def has_hc_head(self) -> bool:
        """V4: the final stream collapse has its own learned mix (hc_head_*, §3.5)."""
        return self.variant == "v4"

    @property
    def shared_expert_clamp(self) -> bool:
        """The shared expert's SwiGLU clamps like the routed ones (V4.1; V4 from the current revision, §3.9)."""
        return self.variant == "v4.1" or self.v4_revision == "current"

    @property
    def kv_fp8_rounding(self) -> bool:
        """The reference rounds the window / compressed KV to FP8 (V4.1; V4 from the current revision: the
        initial one's simulated quantizer cast back without rounding, §3.9)."""
        return self.variant == "v4.1" or self.v4_revision == "current"

    @property
    def act_quant_block(self) -> int:
        """Values per FP8 scale of the activations quantized before every FP8/FP4 GEMM: the FP8 weight
        block along K (spec §2.9: 1x32 for V4.1; §3.1: 1x128 for V4, also in front of the FP4 experts,
        whose weights keep 1x32 scales), so it follows quantization_config.weight_block_size."""
        return self.quant.block

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def engram_columns(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def engram_embed_dim(self) -> int:
        return self.engram_columns * self.engram_head_dim

    def rope_spec(self, ratio: int) -> RopeSpec:
        if ratio == 0:
            return RopeSpec(float(self.rope_theta), 1.0, 32.0, 1.0, self.max_position_embeddings)
        rs = dict(self.rope_scaling or ())
        factor = float(rs.get("factor", 1.0))
        return RopeSpec(
            theta=float(self.compress_rope_theta),
            yarn_factor=factor,
            yarn_beta_fast=float(rs.get("beta_fast", 32)),
            yarn_beta_slow=float(rs.get("beta_slow", 1)),
            yarn_original_len=int(rs.get("original_max_position_embeddings", self.max_position_embeddings)),
        )

    def layer_plan(self, layer_id: int) -> LayerPlan:
        """The plan of backbone layer ``layer_id``, or of MTP / DSpark layer ``num_hidden_layers + s``
        (spec §1.2: compress_ratios has an entry for each; V4-Flash's MTP is layer 43, ratio 0)."""
        n_all = self.num_hidden_layers + self.num_nextn_predict_layers
        if not 0 <= layer_id < n_all:
            raise ConfigError(f"layer {layer_id} out of range [0, {n_all})")
        ratio = self.compress_ratios[layer_id]
        rope = self.rope_spec(ratio)
        has_engram = layer_id in self.engram_layer_ids
        if self.variant == "v4":
            return self._v4_layer_plan(layer_id, ratio, rope)
        if ratio == 0:
            return LayerPlan(layer_id, 0, AttnMode.SWA, None, None, False, False, has_engram, rope)
        kv_src = max((s for s in self.kv_source_layer_ids if s <= layer_id), default=None)
        idx_src = max((s for s in self.index_source_layer_ids if s <= layer_id), default=None)
        if kv_src is None or idx_src is None:
            raise ConfigError(f"layer {layer_id} has compress ratio {ratio} but no KV/index source layer at or "
                              f"below it (kv_source_layer_ids={list(self.kv_source_layer_ids)})")
        if self.compress_ratios[kv_src] != ratio:
            raise ConfigError(f"layer {layer_id} has compress ratio {ratio} but its KV source {kv_src} has "
                              f"ratio {self.compress_ratios[kv_src]}")
        if idx_src < kv_src:
            raise ConfigError(f"layer {layer_id}: index source {idx_src} is older than KV source {kv_src}")
        if layer_id == kv_src:
            mode = AttnMode.FULL
        elif layer_id == idx_src:
            mode = AttnMode.REINDEX
        else:
            mode = AttnMode.REUSE
        cand = self.candidate_source_layer_id
        return LayerPlan(
            layer_id=layer_id,
            ratio=ratio,
            mode=mode,
            kv_source=kv_src,
            index_source=idx_src,
            is_candidate_source=layer_id == cand,
            uses_candidate_mask=mode is AttnMode.REINDEX and cand is not None and kv_src == cand,
            has_engram=has_engram,
            rope=rope,
        )

    def _v4_layer_plan(self, layer_id: int, ratio: int, rope: RopeSpec) -> LayerPlan:
        """V4-Flash: no cross-layer sharing; every compressed layer is its own KV (and, at ratio 4, index) source."""
        hashed = layer_id < self.num_hash_layers
        if ratio == 0:
            return LayerPlan(layer_id, 0, AttnMode.SWA, None, None, False, False, False, rope, hash_routed=hashed)
        csa = ratio == 4
        return LayerPlan(layer_id, ratio, AttnMode.FULL, layer_id, layer_id if csa else None, False, False, False,
                         rope, overlap=csa, has_indexer=csa, hash_routed=hashed)

    @property
    def layer_plans(self) -> tuple[LayerPlan, ...]:
        return tuple(self.layer_plan(i) for i in range(self.num_hidden_layers))

    def compressed_len(self, max_len: int, ratio: int) -> int:
        return math.ceil(max_len / ratio)
