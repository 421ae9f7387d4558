"""Write a tiny DeepSeek-V4.1 checkpoint in exactly the official on-disk format (random, seeded).

    python checkpoints/make_tiny.py [--out checkpoints/tiny-v41] [--seed 0] [--shards 4]

Same tensor names, dtypes (FP8-E4M3 + E8M0 32x32 blocks, packed FP4 experts + 1x32 E8M0, BF16, F32),
shards with model.safetensors.index.json, config.json, tokenizer.json and tokenizer_config.json as the
real release. The tensor list is ``deepinfer_jax.checkpoint.tensor_specs.expected_tensors`` (the one the
loader checks against), all groups. The same seed gives the same bytes. ``make_tensors`` writes
V4-Flash configs too (tests/test_v4flash_fp8_checkpoint.py: FP8 128x128 blocks, tid2eid).

Initialisation aims at a sane forward pass, not at a trained model: linear weights ~ N(0, 1/in_dim)
then quantized to the stored format, norms ~1, hc_*_fn ~ N(0, 0.02^2), gate biases small. Embedding and
head rows of ids the tiny tokenizer does not define are zero (the vocabulary keeps all 129,280 ids so
that special tokens sit at their official ids); that keeps the committed files compressible in git.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
for _p in (str(HERE), str(HERE.parent)):  # the sibling helpers, and the package when run as a script
    if _p not in sys.path:
        sys.path.insert(0, _p)

from tiny_configs import TINY_V41_ROOT  # noqa: E402
from tiny_tokenizer import build_tiny_tokenizer  # noqa: E402

from deepinfer_jax.checkpoint.formats import (E8M0, FP8_AMAX_FLOOR, FP8_MAX, f32_to_e4m3, pow2_ceil,  # noqa: E402
                                              quantize_fp4, quantize_fp8_block)
from deepinfer_jax.checkpoint.names import DTYPES  # noqa: E402
from deepinfer_jax.checkpoint.safetensors_io import INDEX_NAME, write_checkpoint  # noqa: E402
from deepinfer_jax.checkpoint.tensor_specs import expected_tensors  # noqa: E402
from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.engine.token_map import compressed_token_map  # noqa: E402
from deepinfer_jax.model.engram_hash import engram_primes  # noqa: E402

# [vocab, ...] tables whose rows of undefined token ids stay zero
VOCAB_ROW_TENSORS = ("embed.weight", "head.weight", "markov_head.embed.weight", "markov_head.head.weight")
ENGRAM_SCALE_COLS = 32  # Engram tables: one E8M0 scale per 32 consecutive columns of a row (spec §2.2)
HC_FN_STD = 0.02
NORM_NOISE_STD = 0.1
GATE_BIAS_STD = 0.1


def tiny_config(tokenizer_json: Path) -> dict:
    """The root config.json, with the Engram sizes filled in from the prime layout and the tokenizer."""
    root = copy.deepcopy(TINY_V41_ROOT)
    text = root["text_config"]
    # engram_primes reads only the engram_* fields, so a namespace of the raw values is enough here
    probe = types.SimpleNamespace(**{k: tuple(v) if isinstance(v, list) else v for k, v in text.items()})
    text["engram_num_embeddings"] = [sum(map(sum, engram_primes(probe, lid))) for lid in text["engram_layer_ids"]]
    _, n_keys = compressed_token_map(tokenizer_json, text["vocab_size"])
    text["engram_compressed_vocab_size"] = n_keys
    return root


def defined_token_ids(tokenizer_json: Path) -> np.ndarray:
    """Sorted ids the tokenizer defines (regular and added tokens)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True)
    return np.array(sorted(set(vocab.values())), np.int64)


def _quantize_engram_table(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [rows, dim] -> (e4m3 [rows, dim], E8M0 [rows, dim/32]); the FP8 scale rule per 1x32 block."""
    rows, dim = w.shape
    blocks = w.reshape(rows, dim // ENGRAM_SCALE_COLS, ENGRAM_SCALE_COLS)
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(FP8_AMAX_FLOOR))
    s = pow2_ceil(amax * np.float32(1.0 / FP8_MAX))
    return f32_to_e4m3(blocks / s[..., None]).reshape(rows, dim), s.astype(E8M0)


def _f32_init(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("_fn"):  # mHC mixing projections: small, so the mixes start near their bases
        return HC_FN_STD * rng.standard_normal(shape)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return GATE_BIAS_STD * rng.standard_normal(shape)
    return rng.standard_normal(shape)  # hc bases and scales, attention sinks


def _bf16_init(rng: np.random.Generator, name: str, shape: tuple[int, ...], defined_ids: np.ndarray) -> np.ndarray:
    if name.startswith("image_"):  # learned vectors that stand in for embedding rows
        return rng.standard_normal(shape)
    if len(shape) == 1 or name.endswith(("engram.q_weight", "engram.k_weight")):  # norm-like gains
        return 1.0 + NORM_NOISE_STD * rng.standard_normal(shape)
    if name.endswith(VOCAB_ROW_TENSORS):
        v = np.zeros(shape)
        std = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(shape[1])  # embedding rows feed RMS norms
        v[defined_ids] = std * rng.standard_normal((len(defined_ids), shape[1]))
        return v
    return rng.standard_normal(shape) / math.sqrt(shape[1])


def make_tensors(cfg: ModelConfig, defined_ids: np.ndarray, seed: int,
                 sources: dict[str, np.ndarray] | None = None) -> tuple[dict, dict]:
    """-> ({name: array as stored}, {name: safetensors dtype}) for every tensor of expected_tensors(cfg)
    (V4.1 or V4-Flash). ``sources``, if given, receives the fp32 weight [out, in] each FP8 / FP4 weight was
    quantized from, by weight name (for tests of the stored formats)."""
    rng = np.random.default_rng(seed)
    specs = expected_tensors(cfg)
    tensors: dict[str, np.ndarray] = {}
    for name, sp in specs.items():
        if name.endswith(".scale"):
            continue  # made with its weight
        shape = sp.shape
        scale_name = name.removesuffix(".weight") + ".scale"
        if name.endswith("engram.embed.weight"):
            tensors[name], tensors[scale_name] = _quantize_engram_table(
                rng.standard_normal(shape).astype(np.float32))
        elif sp.dtype == "F8_E4M3":
            w = rng.standard_normal(shape).astype(np.float32) / np.float32(math.sqrt(shape[1]))
            tensors[name], tensors[scale_name] = quantize_fp8_block(w, cfg.quant.block)
            if sources is not None:
                sources[name] = w
        elif sp.dtype == "I8":  # packed FP4: two values per byte along K
            in_dim = shape[1] * 2
            w = rng.standard_normal((shape[0], in_dim)).astype(np.float32) / np.float32(math.sqrt(in_dim))
            tensors[name], tensors[scale_name] = quantize_fp4(w)
            if sources is not None:
                sources[name] = w
        elif sp.dtype == "I64":  # V4's hash-routing table tid2eid [vocab, k]: k distinct experts per token
            tensors[name] = np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1)[:, :shape[1]]
        elif sp.dtype == "F32":
            tensors[name] = _f32_init(rng, name, shape).astype(np.float32)
        elif sp.dtype == "BF16":
            tensors[name] = _bf16_init(rng, name, shape, defined_ids).astype(DTYPES["BF16"])
        else:
            raise AssertionError(f"no initialiser for {name} ({sp.dtype})")
    for name, sp in specs.items():  # the generator and the tensor list must agree exactly
        if tensors[name].shape != sp.shape or tensors[name].dtype != DTYPES[sp.dtype]:
            raise AssertionError(f"{name}: made {tensors[name].dtype}{list(tensors[name].shape)}, "
                                 f"expected {sp.dtype}{list(sp.shape)}")
    ordered = {name: tensors[name] for name in specs}  # the tensor list's order: weight, then its scale
    return ordered, {name: sp.dtype for name, sp in specs.items()}


def write_tiny(out: Path, seed: int = 0, shards: int = 4) -> dict:
    """Write the whole checkpoint into ``out`` (an existing directory's files are replaced). -> a summary."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # build next to the target and swap it in at the end, so readers never see a half-written checkpoint
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary directory
    try:
        build_tiny_tokenizer(tmp)
        root = tiny_config(tmp / "tokenizer.json")
        (tmp / "config.json").write_text(json.dumps(root, indent=2) + "\n")
        cfg = ModelConfig.from_dict(root)
        tensors, dtypes = make_tensors(cfg, defined_token_ids(tmp / "tokenizer.json"), seed)
        total = sum(a.nbytes for a in tensors.values())
        paths = write_checkpoint(tmp, tensors, dtypes, max_shard_bytes=math.ceil(total / shards))
        if out.exists():
            old = out.with_name(f".{out.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    on_disk = sum(f.stat().st_size for f in out.iterdir())
    return {"out": out, "tensors": len(tensors), "tensor_bytes": total, "shards": len(paths), "disk_bytes": on_disk,
            "index": out / INDEX_NAME}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "tiny-v41")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=4, help="target shard count (tables larger than a shard "
                                                            "take one each, so it can come out lower)")
    args = ap.parse_args(argv)
    s = write_tiny(args.out, args.seed, args.shards)
    print(f"wrote {s['tensors']} tensors ({s['tensor_bytes'] / 1e6:.1f} MB) in {s['shards']} shards to {s['out']}; "
          f"{s['disk_bytes'] / 1e6:.1f} MB on disk")
    return s["out"]


if __name__ == "__main__":
    main()
