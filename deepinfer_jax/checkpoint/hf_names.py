"""Transformers-spelled V4-Flash tensor names <-> native names (spec §5.6-5.7).

Accepted spellings, all mapped onto the native names of ``tensor_specs``:
* transformers' module state dict (``DeepseekV4ForCausalLM.state_dict()``): ``model.layers.{L}.self_attn.q_a_proj``,
  ``attn_hc.fn``, ``compressor.indexer.q_b_proj``, ``mlp.gate.e_score_correction_bias``, ``model.hc_head.hc_fn``,
  stacked routed experts ``mlp.experts.gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I];
* the §5.7 spelling of HF re-uploads: per-expert ``experts.{e}.gate_proj/up_proj/down_proj``,
  ``self_attn.sinks``, ``model.hc_head_fn``, ``compressor.position_bias`` ..., ``weight_scale_inv`` scales;
* native names with an optional ``model.`` prefix (what transformers' save_pretrained writes back).
``to_native`` renames one tensor; stacked expert tensors are split by ``split_stacked_experts``.
``to_transformers`` is the inverse onto transformers' module spelling (tests write checkpoints with it).
"""

from __future__ import annotations

import re

import numpy as np

# (pattern, replacement) applied in order to a name without its "model." prefix. Component-anchored
# (every pattern starts at a "." or the name start) so a rule never fires inside another component.
_TO_NATIVE: tuple[tuple[str, str], ...] = (
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # transformers' save_pretrained writes attn.kv_norm back as this
    # the indexer lives under the compressor in transformers, beside it natively
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.gate\.e_score_correction_bias_vl$", ".gate.bias_vl"),
    (r"\.(shared_experts|experts\.\d+)\.gate_proj\.", r".\1.w1."),
    (r"\.(shared_experts|experts\.\d+)\.up_proj\.", r".\1.w3."),
    (r"\.(shared_experts|experts\.\d+)\.down_proj\.", r".\1.w2."),
    (r"\.weight_scale_inv$", ".scale"),
)
_TO_NATIVE_RE = tuple((re.compile(p), r) for p, r in _TO_NATIVE)

# native -> transformers' module spelling (the state dict of DeepseekV4ForCausalLM)
_TO_HF: tuple[tuple[str, str], ...] = (
    (r"^embed\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^norm\.", "model.norm."),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn\.attn_sink$", ".attn.sinks"),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.ape$", ".position_bias"),
    (r"\.(compressor|indexer)\.wkv\.", r".\1.kv_proj."),
    (r"\.(compressor|indexer)\.wgate\.", r".\1.gate_proj."),
    (r"\.(compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.attn\.wq_a\.", ".attn.q_a_proj."),
    (r"\.attn\.q_norm\.", ".attn.q_a_norm."),
    (r"\.attn\.wq_b\.", ".attn.q_b_proj."),
    (r"\.attn\.wkv\.", ".attn.kv_proj."),
    (r"\.attn\.wo_a\.", ".attn.o_a_proj."),
    (r"\.attn\.wo_b\.", ".attn.o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"^layers\.", "model.layers."),
)
_TO_HF_RE = tuple((re.compile(p), r) for p, r in _TO_HF)

_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)$")


def to_native(name: str) -> str:
    """One transformers-spelled (or native, optionally ``model.``-prefixed) name -> the native name."""
    n = name[len("model."):] if name.startswith("model.") else name
    for pat, rep in _TO_NATIVE_RE:
        n = pat.sub(rep, n)
    return n


def to_transformers(native: str) -> str:
    """A native name -> transformers' module spelling (routed experts: see ``stack_experts``)."""
    n = native
    for pat, rep in _TO_HF_RE:
        n = pat.sub(rep, n)
    return n


def split_stacked_experts(native_stacked: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """``layers.L.ffn.experts.gate_up_proj`` [E, 2I, D] (gate rows first) or ``...down_proj`` [E, D, I]
    -> per-expert native tensors ``layers.L.ffn.experts.{e}.w1/w3/w2.weight``."""
    m = _STACKED.match(native_stacked)
    if m is None:
        raise ValueError(f"{native_stacked!r} is not a stacked expert tensor")
    base, kind = m.groups()
    out = {}
    for e in range(arr.shape[0]):
        if kind == "gate_up_proj":
            inter = arr.shape[1] // 2
            out[f"{base}.{e}.w1.weight"] = arr[e, :inter]
            out[f"{base}.{e}.w3.weight"] = arr[e, inter:]
        else:
            out[f"{base}.{e}.w2.weight"] = arr[e]
    return out


def is_stacked_experts(native: str) -> bool:
    return _STACKED.match(native) is not None


def stack_experts(native: dict[str, np.ndarray], block_prefix: str, n_experts: int) -> dict[str, np.ndarray]:
    """Per-expert native tensors of one block -> transformers' stacked ``gate_up_proj`` / ``down_proj``."""
    p = f"{block_prefix}.ffn.experts"
    gate_up = np.stack([np.concatenate([native[f"{p}.{e}.w1.weight"], native[f"{p}.{e}.w3.weight"]], axis=0)
                        for e in range(n_experts)])
    down = np.stack([native[f"{p}.{e}.w2.weight"] for e in range(n_experts)])
    hf = to_transformers(p)
    return {f"{hf}.gate_up_proj": gate_up, f"{hf}.down_proj": down}
