"""How long does loading take: official safetensors (``load_params``) vs the orbax layout (``load_orbax``)?

    python benchmarks/load_time.py [--sizes tiny,mid] [--mesh data=1] [--repeats 3] [--workdir DIR]

Both loads place every array on its NamedSharding of ``--mesh`` (so the mesh's devices must exist;
on CPU add XLA_FLAGS=--xla_force_host_platform_device_count=N). ``tiny`` is the committed checkpoint;
``mid`` is a synthetic ~1.2 GB V4.1-shaped checkpoint (hidden 1024, 64 experts, the full vocabulary),
generated once into ``--workdir`` with make_tiny's generator. Times are wall seconds with a warm page
cache (first run and best of ``--repeats``), and the ratio orbax / safetensors measured in this run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "checkpoints"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from deepinfer_jax.checkpoint.loader import load_params  # noqa: E402
from deepinfer_jax.checkpoint.orbax_io import convert_to_orbax, load_orbax  # noqa: E402
from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.sharding import MeshSpec, make_mesh, make_place  # noqa: E402

MID_OVERRIDES = dict(hidden_size=1024, num_attention_heads=16, head_dim=128, qk_rope_head_dim=32, q_lora_rank=384,
                     o_lora_rank=256, o_groups=4, moe_intermediate_size=512, n_routed_experts=64,
                     num_experts_per_tok=4, index_n_heads=4, index_head_dim=64, engram_n_heads=4,
                     engram_head_dim=64, engram_vocab_size=20000, num_nextn_predict_layers=0,
                     compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1], dspark_target_layer_ids=[],
                     dspark_n_routed_experts=0, dspark_num_experts_per_tok=0, dspark_block_size=0,
                     dspark_markov_rank=0, dspark_noise_token_id=None)


def mid_config() -> ModelConfig:
    from tiny_configs import TINY_V41_ROOT
    from deepinfer_jax.model.engram_hash import engram_primes

    root = copy.deepcopy(TINY_V41_ROOT)
    text = root["text_config"]
    text.update(MID_OVERRIDES, engram_compressed_vocab_size=4000)
    probe = types.SimpleNamespace(**{k: tuple(v) if isinstance(v, list) else v for k, v in text.items()})
    text["engram_num_embeddings"] = [sum(map(sum, engram_primes(probe, lid))) for lid in text["engram_layer_ids"]]
    return ModelConfig.from_dict(root)


def make_mid(out: Path) -> Path:
    """Write the synthetic mid-size checkpoint once (reused when its config matches)."""
    from make_tiny import make_tensors
    from deepinfer_jax.checkpoint.safetensors_io import write_checkpoint

    cfg = mid_config()
    want = json.dumps(cfg.to_dict(), sort_keys=True)
    if (out / "config.json").exists() and json.dumps(json.loads((out / "config.json").read_text()), sort_keys=True) == want:
        return out
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    tensors, dtypes = make_tensors(cfg, np.arange(cfg.vocab_size), seed=0)
    total = sum(a.nbytes for a in tensors.values())
    write_checkpoint(out, tensors, dtypes, max_shard_bytes=math.ceil(total / 4))
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    print(f"generated {out} ({total / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def _timed(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tree = fn()
        jax.block_until_ready(tree)
        times.append(time.perf_counter() - t0)
        del tree
    return times[0], min(times)


def bench(name: str, src: Path, mesh_spec: MeshSpec, workdir: Path, repeats: int) -> dict:
    cfg = ModelConfig.from_json(src)
    mesh = make_mesh(mesh_spec)
    place = make_place(cfg, mesh)
    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    st_first, st_best = _timed(lambda: load_params(src, cfg, place=place, progress=False), repeats)
    dst = workdir / f"{name}-orbax-{str(mesh_spec).replace(',', '_').replace('=', '')}"
    t0 = time.perf_counter()
    convert_to_orbax(src, dst, mesh_spec, overwrite=True, progress=False)
    convert_s = time.perf_counter() - t0
    ob_first, ob_best = _timed(lambda: load_orbax(dst, mesh), repeats)
    return dict(name=name, gib=nbytes / 2**30, safetensors_first=st_first, safetensors_best=st_best,
                convert=convert_s, orbax_first=ob_first, orbax_best=ob_best)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--mesh", default="data=1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/deepinfer_load_bench")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh_spec = MeshSpec.parse(args.mesh)
    sources = {"tiny": ROOT / "checkpoints" / "tiny-v41"}
    rows = []
    for name in args.sizes.split(","):
        src = sources.get(name) or (make_mid(workdir / "mid-src") if name == "mid" else None)
        if src is None:
            raise SystemExit(f"unknown size {name!r} (tiny, mid)")
        rows.append(bench(name, src, mesh_spec, workdir, args.repeats))
    print(f"load time on {jax.device_count()} {jax.devices()[0].platform} device(s), mesh {mesh_spec}, warm page cache, "
          f"jax {jax.__version__}")
    print(f"{'checkpoint':<10} {'GiB':>6} {'safetensors s (first/best)':>28} {'orbax s (first/best)':>22} "
          f"{'orbax/safetensors':>18} {'convert s':>10}")
    for r in rows:
        print(f"{r['name']:<10} {r['gib']:>6.2f} {r['safetensors_first']:>14.2f} / {r['safetensors_best']:<11.2f} "
              f"{r['orbax_first']:>10.2f} / {r['orbax_best']:<9.2f} {r['orbax_best'] / r['safetensors_best']:>18.2f} "
              f"{r['convert']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
