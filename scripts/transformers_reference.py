"""Reference logits from transformers' ``DeepseekV4ForCausalLM`` (CPU torch, float32) for the parity test.

Runs in its own interpreter (a Python 3.11 venv with torch + transformers; see tests/test_transformers_parity.py),
never imported by deepinfer_jax. Input: a checkpoint directory holding ``config.json`` (the official V4-Flash
layout; transformers folds its legacy keys ``compress_ratios`` / ``num_hash_layers`` / ``qk_rope_head_dim`` /
``rope_scaling`` in itself) and safetensors shards (``model.safetensors`` or an index) in transformers' own state-dict spelling, plus a JSON
list of prompts (token id lists). For each prompt it runs one prefill, then ``--decode`` greedy steps with the
model's own cache, one token at a time, and writes to an .npz:

* ``prefill_logits_{i}`` float32 [T, V]: logits of every prompt position;
* ``decode_logits_{i}`` float32 [N, V]: logits after feeding greedy token k (k = 0..N-1);
* ``tokens_{i}`` int64 [N]: the greedy tokens (token 0 = argmax of the last prefill position);
* ``versions``: torch / transformers versions, for the test's failure messages.

Usage: python scripts/transformers_reference.py CKPT_DIR PROMPTS_JSON OUT_NPZ [--decode 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache


def build_model(ckpt: Path) -> DeepseekV4ForCausalLM:
    raw = json.loads((ckpt / "config.json").read_text())
    # Weights here are plain float32: no FP8 quantizer, and the attention is eager (V4 ships eager only).
    for k in ("quantization_config", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype"):
        raw.pop(k, None)
    cfg = DeepseekV4Config(**raw)
    cfg._attn_implementation = "eager"
    with torch.device("cpu"):
        model = DeepseekV4ForCausalLM(cfg)
    index = ckpt / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state = {k: v for f in files for k, v in load_file(str(ckpt / f)).items()}
    # transformers does not instantiate the MTP layer (it ignores mtp.* on load); everything else must match.
    state = {k: v for k, v in state.items() if not k.startswith(("mtp.", "model.mtp."))}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Non-persistent buffers (RoPE tables) are rebuilt by the module; every parameter must come from the file.
    missing = [k for k in missing if "inv_freq" not in k]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model.float().eval()


@torch.no_grad()
def run(model: DeepseekV4ForCausalLM, prompt: list[int], n_decode: int) -> dict[str, np.ndarray]:
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    prefill = out.logits[0].float().numpy()
    cache = out.cache
    tok = int(prefill[-1].argmax())
    tokens, steps = [], []
    for _ in range(n_decode):
        tokens.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0, -1].float().numpy()
        steps.append(logits)
        tok = int(logits.argmax())
    return {"prefill_logits": prefill, "decode_logits": np.stack(steps), "tokens": np.asarray(tokens, np.int64)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    model = build_model(args.ckpt)
    prompts = json.loads(args.prompts.read_text())
    arrays: dict[str, np.ndarray] = {"versions": np.asarray([torch.__version__, transformers.__version__])}
    for i, prompt in enumerate(prompts):
        for k, v in run(model, prompt, args.decode).items():
            arrays[f"{k}_{i}"] = v
    np.savez(args.out, **arrays)


if __name__ == "__main__":
    main()
