"""Reference dumps from the independent float64 numpy implementation (tests/reference/numpy_v41.py).

    python scripts/dump_numpy_reference.py --model checkpoints/tiny-v41 --prompts prompts.jsonl \
        --out ref.safetensors [--fake-quant]

Writes the dump format of ``deepinfer_jax/compare.py`` (``prompt{i}.tokens``, ``prompt{i}.logits``,
``prompt{i}.layer{L}.hidden``), so ``deepinfer-jax compare --ref`` reads it. The forward pass is the numpy
reference's own (float64, its own checkpoint reader and dequantization); only the prompt reading, the dump
writer and the Engram compressed token map (spec §2.2, a tokenizer-level table the reference takes as an
input) come from deepinfer_jax. Values are stored in fp32, as the format says. Tiny configs only: the
reference holds every weight in float64 host memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from reference import numpy_v41  # noqa: E402

from deepinfer_jax.compare import FORMAT, Dump, PromptDump, model_revision, read_prompts, save_dump  # noqa: E402
from deepinfer_jax.engine.token_map import compressed_token_map  # noqa: E402

# Tensors of the checkpoint that a text forward never reads (DSpark head, image markers): not loaded.
_SKIP_PREFIXES = ("mtp.", "image_", "vision.", "aligner.")


def dump_reference(model_dir: str | Path, prompts: list[list[int]], out_path: str | Path | None, *,
                   fake_quant: bool = False, layers: bool = True) -> Dump:
    """Run ``numpy_v41.reference_forward`` on each prompt (causal prefill from position 0) and dump it."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(numpy_v41.text_config_of(config)["vocab_size"])
    weights = numpy_v41.load_reference_weights(model_dir, keep=lambda n: not n.startswith(_SKIP_PREFIXES))
    token_map, _ = compressed_token_map(model_dir / "tokenizer.json", vocab)
    out = []
    for ids in prompts:
        r = numpy_v41.reference_forward(config, weights, list(ids), token_map, fake_quant=fake_quant,
                                        return_hidden=layers)
        hidden = tuple(h.astype(np.float32) for h in r["hidden"]) if layers else ()
        out.append(PromptDump(np.asarray(ids, np.int64), r["logits"].astype(np.float32), hidden))
    meta = {"format": FORMAT, "implementation": "tests/reference/numpy_v41.py (float64 numpy)",
            "config": model_dir.resolve().name, "model_revision": model_revision(model_dir),
            "numerics": {"act_dtype": "float64", "fake_quant": fake_quant, "kv_quant": fake_quant},
            "numpy_version": np.__version__}
    dump = Dump(tuple(out), meta, str(out_path) if out_path is not None else "<memory>")
    if out_path is not None:
        save_dump(dump, out_path)
    return dump


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (official format)")
    ap.add_argument("--prompts", required=True, help="JSONL: {\"token_ids\": [...]} or {\"prompt\": \"text\"} per line")
    ap.add_argument("--out", required=True, help="dump file (.safetensors or .npz)")
    ap.add_argument("--fake-quant", action="store_true",
                    help="apply the simulated FP8/FP4 quantizers of spec §2.9/2.10 (still float64: the BF16 "
                         "casts of the official reference are not simulated)")
    ap.add_argument("--no-layers", action="store_true", help="logits only")
    args = ap.parse_args(argv)
    try:
        prompts = read_prompts(args.prompts, args.model)
        dump_reference(args.model, prompts, args.out, fake_quant=args.fake_quant, layers=not args.no_layers)
    except (OSError, ValueError) as e:
        print(f"dump_numpy_reference: {e}", file=sys.stderr)
        return 2
    print(f"dump_numpy_reference: {len(prompts)} prompts -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
