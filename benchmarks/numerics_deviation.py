"""How far one numerics mode is from another on the tiny checkpoint, over greedy decode steps (CPU-able).

    python benchmarks/numerics_deviation.py [--steps 1000] [--mode fast] [--against reference] [--baseline exact]

Teacher-forced: the ``--against`` mode (default reference) decodes greedily from a fixed prompt and
the ``--mode`` run (default fast) is fed the same tokens, so every step compares the two modes' logits
for the same context (a free-running comparison stops meaning anything after the first divergent
token). Both run the same decode step (T = 1, the prompt fed token by token), so each mode compiles one
shape. Printed per mode: max and mean |logit difference| over all steps and the vocabulary, the largest
logit for scale, top-1 agreement (the fraction of steps whose argmax is the same), and the first step
whose argmax differs. ``--baseline`` adds another mode against the same reference as a yardstick
(``exact`` = fp32 without fake quantization, which the spec calls a legitimate, slightly more precise
mode); ``--baseline none`` skips it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from deepinfer_jax.model.cache import init_cache  # noqa: E402
from deepinfer_jax.model.engram_hash import engram_rows  # noqa: E402
from deepinfer_jax.model.numerics import Numerics  # noqa: E402
from deepinfer_jax.model.transformer import forward  # noqa: E402

TINY = ROOT / "checkpoints" / "tiny-v41"


def _rows(cfg, token_map, ids: list[int], s: int) -> np.ndarray:
    """Engram rows [1, 1, NE, C] for the token at position s, with the tokens before it as history."""
    comp = token_map[np.asarray(ids[:s + 1], np.int64)]
    hist = comp[max(0, s - (cfg.engram_max_ngram_size - 1)):s]
    return engram_rows(cfg, comp[s:s + 1], hist, int(token_map[cfg.engram_pad_token_id]))[None]


def greedy_logits(params, cfg, token_map, prompt: list[int], steps: int, numerics: Numerics,
                  forced: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """Decode ``steps`` tokens after ``prompt`` one step at a time -> (logits [steps, V] float32 at the
    positions that pick each new token, the tokens). ``forced``: feed these tokens instead of the greedy
    picks (teacher forcing); the logits are still those of this mode."""
    step = jax.jit(forward, static_argnums=(1, 6))
    cache = init_cache(cfg, 1, len(prompt) + steps, numerics)
    ids = list(prompt)
    out = np.zeros((steps, cfg.vocab_size), np.float32)
    for s in range(len(prompt) + steps - 1):
        tok = jnp.asarray([[ids[s]]], jnp.int32)
        logits, cache = step(params, cfg, cache, tok, jnp.asarray([[s]], jnp.int32),
                             jnp.asarray(_rows(cfg, token_map, ids, s)), numerics)
        j = s - (len(prompt) - 1)
        if j >= 0:
            out[j] = np.asarray(logits[0, 0])
            if len(ids) == s + 1:
                ids.append(int(forced[j]) if forced is not None else int(np.argmax(out[j])))
    return out, ids[len(prompt):]


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    diff = np.abs(b - a)
    agree = np.argmax(a, axis=-1) == np.argmax(b, axis=-1)
    return {"steps": int(a.shape[0]), "max_abs_logit_err": float(diff.max()), "mean_abs_logit_err": float(diff.mean()),
            "max_abs_logit": float(np.abs(a).max()), "top1_agreement": float(agree.mean()),
            "first_disagreement": int(np.argmin(agree)) if not agree.all() else None}


def deviation(params, cfg, token_map, prompt: list[int], steps: int, mode: Numerics, against: Numerics,
              baseline: Numerics | None = None) -> dict:
    """{"mode": compare(against, mode), "baseline": compare(against, baseline) or absent, "tokens": ...}."""
    ref, tokens = greedy_logits(params, cfg, token_map, prompt, steps, against)
    out = {"tokens": tokens}
    for name, num in (("mode", mode), ("baseline", baseline)):
        if num is not None:
            got, _ = greedy_logits(params, cfg, token_map, prompt, steps, num, forced=tokens)
            out[name] = compare(ref, got)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(TINY))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--mode", default="fast")
    ap.add_argument("--against", default="reference")
    ap.add_argument("--baseline", default="exact")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from deepinfer_jax.checkpoint.loader import load_params
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.token_map import compressed_token_map

    cfg = ModelConfig.from_json(args.model)
    params = load_params(args.model, cfg, progress=False)
    token_map, _ = compressed_token_map(Path(args.model) / "tokenizer.json", cfg.vocab_size)
    prompt = [int(t) for t in np.random.default_rng(args.seed).integers(3, 800, args.prompt_len)]
    t0 = time.time()
    res = deviation(params, cfg, token_map, prompt, args.steps, Numerics.named(args.mode), Numerics.named(args.against),
                    None if args.baseline == "none" else Numerics.named(args.baseline))
    print(f"{args.steps} greedy decode steps on {args.model} (teacher-forced by {args.against!r}; "
          f"{time.time() - t0:.0f} s, jax {jax.__version__} on {jax.devices()[0].platform})")
    for name, label in (("mode", args.mode), ("baseline", args.baseline)):
        if name in res:
            r = res[name]
            print(f"  {label:>10} vs {args.against}: max |dlogit| {r['max_abs_logit_err']:.4g} "
                  f"(mean {r['mean_abs_logit_err']:.3g}, max |logit| {r['max_abs_logit']:.3g}), "
                  f"top-1 agreement {r['top1_agreement']:.4f}, first disagreement at step {r['first_disagreement']}")
    print(json.dumps({k: v for k, v in res.items() if k != "tokens"}))
    return res


if __name__ == "__main__":
    main()
