"""Write a tiny DeepSeek-V4.1 checkpoint in exactly the official on-disk format (random, seeded).

    python checkpoints/make_tiny.py [--out checkpoints/tiny-v41] [--seed 0]

Same tensor names, dtypes (FP8-E4M3 + E8M0 32x32 blocks, packed FP4 experts + 1x32 E8M0, BF16, F32),
sharding with model.safetensors.index.json, config.json, tokenizer.json and tokenizer_config.json as
the real release. The tensor list comes from ``deepinfer_jax.checkpoint.tensor_specs`` (the one that the
loader checks against). Embedding/head rows of ids the tiny tokenizer does not define are zero, which
keeps the files compressible in git.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from tiny_configs import TINY_V41_ROOT  # noqa: E402
from tiny_tokenizer import build_tiny_tokenizer  # noqa: E402

from deepinfer_jax.checkpoint.formats import _pow2_ceil, quantize_fp4, quantize_fp8_block  # noqa: E402
from deepinfer_jax.checkpoint.safetensors_io import write_checkpoint  # noqa: E402
from deepinfer_jax.checkpoint.tensor_specs import expected_tensors  # noqa: E402
from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.engine.token_map import compressed_token_map  # noqa: E402
from deepinfer_jax.model.engram_hash import engram_primes  # noqa: E402

VOCAB_ROW_TENSORS = ("embed.weight", "head.weight", "markov_head.embed.weight", "markov_head.head.weight")


def tiny_config(out_dir: Path) -> dict:
    root = copy.deepcopy(TINY_V41_ROOT)
    text = root["text_config"]
    probe = types.SimpleNamespace(**{k: tuple(v) if isinstance(v, list) else v for k, v in text.items()})
    text["engram_num_embeddings"] = [sum(map(sum, engram_primes(probe, lid))) for lid in text["engram_layer_ids"]]
    _, n_keys = compressed_token_map(out_dir / "tokenizer.json", text["vocab_size"])
    text["engram_compressed_vocab_size"] = n_keys
    return root


def _engram_table(rng, rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """FP8 rows with one E8M0 scale per 32 columns of a row."""
    w = rng.standard_normal((rows, dim)).astype(np.float32)
    blocks = w.reshape(rows, dim // 32, 32)
    s = _pow2_ceil(np.maximum(np.abs(blocks).max(-1), 1e-4) / 448.0)
    q = (blocks / s[..., None]).reshape(rows, dim).astype(ml_dtypes.float8_e4m3fn)
    return q, s.astype(ml_dtypes.float8_e8m0fnu)


def make_tensors(cfg: ModelConfig, defined_ids: np.ndarray, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    specs = expected_tensors(cfg)
    tensors, dtypes = {}, {}
    for name, sp in specs.items():
        if name.endswith(".scale"):
            continue  # produced with its weight
        dtypes[name] = sp.dtype
        shape = sp.shape
        if name.endswith("engram.embed.weight"):
            q, s = _engram_table(rng, shape[0], shape[1])
            tensors[name], tensors[name[:-6] + "scale"] = q, s
            dtypes[name[:-6] + "scale"] = "F8_E8M0"
            continue
        scale_name = name[:-6] + "scale"
        if sp.dtype == "F8_E4M3":
            q, s = quantize_fp8_block(rng.standard_normal(shape).astype(np.float32) / math.sqrt(shape[1]),
                                      cfg.quant.block)
            tensors[name], tensors[scale_name], dtypes[scale_name] = q, s, "F8_E8M0"
        elif sp.dtype == "I8":
            in_dim = shape[1] * 2
            q, s = quantize_fp4(rng.standard_normal((shape[0], in_dim)).astype(np.float32) / math.sqrt(in_dim))
            tensors[name], tensors[scale_name], dtypes[scale_name] = q, s, "F8_E8M0"
        elif sp.dtype == "F32":
            if name.endswith("_fn"):
                v = rng.standard_normal(shape) / math.sqrt(shape[1])
            elif name.endswith(("gate.bias", "gate.bias_vl")):
                v = 0.1 * rng.standard_normal(shape)
            else:  # hc bases/scales, attention sinks
                v = rng.standard_normal(shape)
            tensors[name] = v.astype(np.float32)
        elif sp.dtype == "BF16":
            if len(shape) == 1 or name.endswith(("q_weight", "k_weight")):
                v = 1.0 + 0.1 * rng.standard_normal(shape)
                if name.startswith("image_"):
                    v = rng.standard_normal(shape)
            elif name.endswith(VOCAB_ROW_TENSORS):
                v = np.zeros(shape)
                scale = 1.0 if name.endswith(("embed.weight",)) and not name.startswith("mtp") else 1 / math.sqrt(shape[1])
                v[defined_ids] = rng.standard_normal((len(defined_ids), shape[1])) * scale
            else:
                v = rng.standard_normal(shape) / math.sqrt(shape[1])
            tensors[name] = v.astype(ml_dtypes.bfloat16)
        else:
            raise AssertionError(f"no initialiser for {name} ({sp.dtype})")
    # keep the official order (weight then scale) for the writer
    ordered = {}
    for name in specs:
        ordered[name] = tensors[name]
    return ordered, {n: (dtypes[n] if n in dtypes else specs[n].dtype) for n in ordered}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "tiny-v41")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=4)
    args = ap.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    build_tiny_tokenizer(out)
    root = tiny_config(out)
    (out / "config.json").write_text(json.dumps(root, indent=2) + "\n")
    cfg = ModelConfig.from_dict(root)
    from tokenizers import Tokenizer

    defined = np.array(sorted(Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab().values()))
    tensors, dtypes = make_tensors(cfg, defined, args.seed)
    total = sum(a.nbytes for a in tensors.values())
    paths = write_checkpoint(out, tensors, dtypes, max_shard_bytes=math.ceil(total / args.shards))
    print(f"wrote {len(tensors)} tensors, {total / 1e6:.1f} MB in {len(paths)} shards to {out}")
    return out


if __name__ == "__main__":
    main()
