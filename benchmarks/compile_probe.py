"""Compile the engine's programs for the H200 on a machine without a GPU (XLA's deviceless AOT compile).

    # once: a venv of its own, since a CUDA plugin changes what jax finds at start-up
    python3.12 -m venv ../aotenv && ../aotenv/bin/pip install "jax[cuda12]==$(.venv/bin/python -c \
        'import jax; print(jax.__version__)')" && ../aotenv/bin/pip install -e .
    ../aotenv/bin/python benchmarks/compile_probe.py --layers 12 --prefill 2048,4096 --decode 64

For each program (the slice's two prefill programs at each chunk; its decode step at each batch) it prints
the trace + lowering time, XLA's compile time, the compiled program's temporary and argument bytes
(XLA's own memory analysis), and its number of fusion kernels. Nothing runs and no weights are made:
params, caches and inputs are abstract values placed on a compile-only H200 described by
``h200_target_config.txtpb``. So device time goes to timing programs, not to finding out that one takes
four minutes to compile or does not fit.

What it does not show: autotuning (needs the GPU; its results can be carried, see ``e2e_gpu.py``'s
``--compile-cache``) and anything about run time. Compile times here are for comparisons on the same
machine: a 2-core machine compiles several times slower than the H200 host's 16 cores (the 12-layer
prefill program at chunk 2048: 33 s here without autotuning, ~110 s there with it; the B=64 decode step
with one Sinkhorn chain per mHC call: 548 s here, cut into segments 55 s; with the Sinkhorn kernel, the
GPU default since 2026-12-05, 42 s).

The kernel registry picks implementations by the platform of jax's first device, which is the CPU here,
so this script resolves them as on "cuda" (the Pallas kernels are lowered for Mosaic GPU as on the H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import jax  # noqa: E402
import numpy as np  # noqa: E402

TARGET_CONFIG = HERE / "h200_target_config.txtpb"


def compile_only_sharding(target_config: Path):
    """A replicated sharding on a compile-only CUDA device described by target_config."""
    from jax.experimental import topologies

    jax.config.update("jax_platforms", "cpu")   # no GPU backend to start: the topology brings its compiler
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config.read_text(), topology="1x1x1")
    mesh = topologies.make_mesh(topo=topo, mesh_shape=(1,), axis_names=("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def resolve_as_cuda() -> None:
    """Make the kernel registry and the sampler choose as on a CUDA device (they look at jax's first
    device or backend, the CPU here; the model's GPU choices are set in its Numerics below)."""
    from pallas_kernels import registry

    resolve = registry.resolve

    def as_cuda(op, *, impl=None, selection=registry.AUTO, platform=None, device=None):
        return resolve(op, impl=impl, selection=selection, platform=platform or "cuda", device=None)

    registry.resolve = as_cuda
    # the engine's programs take the GPU's compile options (decided by jax's first device, the CPU here)
    from deepinfer_jax import platform

    options = platform.step_compiler_options
    platform.step_compiler_options = lambda platform=None, **kw: options("cuda", **kw)


def abstract_params(cfg, dense_kernel: bool = False, dense_linears=None):
    """The slice's params as the GPU engine holds them (kernel-layout expert scales, dense FP8 as bf16 or,
    with dense_kernel, split for the kernel; mHC's split stream-mix weights), as ShapeDtypeStructs."""
    from deepinfer_jax.model.dense_fp8 import prepare_dense_fp8
    from deepinfer_jax.checkpoint.names import JNP_DTYPES
    from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, expected_tensors
    from deepinfer_jax.model.linear import dequantize_dense_fp8
    from deepinfer_jax.model.mhc import prepare_stream_dots
    from deepinfer_jax.model.moe import prepare_expert_scales
    from slice_model import _leaf_table

    specs = {n: s for n, s in expected_tensors(cfg).items() if s.group == BACKBONE}
    leaves, counts = _leaf_table(specs)
    tree: dict = {}
    for path, (_, dtype, shape) in leaves.items():
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = jax.ShapeDtypeStruct((counts[path], *shape) if path in counts else shape, JNP_DTYPES[dtype])
    tree["layers"] = tuple(tree["layers"][i] for i in range(cfg.num_hidden_layers))
    dense = (lambda p: prepare_dense_fp8(p, cfg, linears=dense_linears)) if dense_kernel else (lambda p: p)
    return jax.eval_shape(lambda p: prepare_stream_dots(dequantize_dense_fp8(dense(prepare_expert_scales(p)))), tree)


def place_on(tree, sharding):
    """Arrays, numpy inputs or ShapeDtypeStructs -> ShapeDtypeStructs placed on the compile-only device."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree)


def probe(fn, args, sharding, label: str, hlo_dir: Path | None = None) -> dict:
    t0 = time.time()
    with jax.threefry_partitionable(True):
        lowered = fn.trace(*(place_on(a, sharding) for a in args)).lower()
        t1 = time.time()
        compiled = lowered.compile()
    t2 = time.time()
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    rec = dict(program=label, lower_s=t1 - t0, compile_s=t2 - t1, temp_bytes=mem.temp_size_in_bytes,
               argument_bytes=mem.argument_size_in_bytes, fusions=text.count(" fusion("))
    if hlo_dir is not None:   # the optimized HLO, for counting kernels by site (``hlo_sites.py``)
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / (re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".hlo.txt")).write_text(text)
    print(f"{label}: trace+lower {rec['lower_s']:.1f} s, compile {rec['compile_s']:.1f} s, temp "
          f"{rec['temp_bytes'] / 2**30:.2f} GiB, arguments {rec['argument_bytes'] / 2**30:.1f} GiB, "
          f"{rec['fusions']} fusion kernels", flush=True)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--prefill", default="2048", help="prefill chunks to compile (lower part), e.g. 2048,4096")
    ap.add_argument("--prompt", type=int, default=32768, help="the prefill engine's context (max_len - 16)")
    ap.add_argument("--decode", default="", help="decode batches to compile, e.g. 64")
    ap.add_argument("--context", type=int, default=4096, help="the decode engine's context (max_len - 64)")
    ap.add_argument("--sinkhorn-segment-rows", default="default",
                    help="Numerics.sinkhorn_segment_rows: an int, 'none', or 'default' (the engine's)")
    ap.add_argument("--target-config", type=Path, default=TARGET_CONFIG)
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--hlo-dir", type=Path, default=None, help="write each compiled program's HLO text here")
    ap.add_argument("--expert-operands", default="e4m3-decode", choices=("bf16", "e4m3", "e4m3-decode"),
                    help="Numerics.expert_operands (the FP4 experts' kernel operands)")
    ap.add_argument("--dense-kernel", default=None, choices=("off", "on", "decode"),
                    help="Numerics.dense_kernel (the dense FP8 linears on the grouped GEMM kernel; default: the "
                    "Numerics default)")
    ap.add_argument("--attention-fp4-rows", default="decode",
                    help="Numerics.attention_fp4_rows (the attention kernel's form for the FP4 compressed cache)")
    ap.add_argument("--w13-launch", default="on", choices=("on", "off"),
                    help="off: the routed experts' w1 and w3 as two kernel launches (Numerics.expert_w13_launch)")
    ap.add_argument("--swiglu-epilogue", default="on", choices=("on", "off"),
                    help="off: the routed experts' SwiGLU in XLA after the w1/w3 launch, not in its epilogue "
                    "(Numerics.expert_swiglu_epilogue)")
    ap.add_argument("--attention-schedule", default="seesaw-prefill", choices=("halves", "seesaw", "seesaw-prefill"),
                    help="Numerics.attention_schedule (the bf16 attention kernel's schedule)")
    ap.add_argument("--decode-index-kernel", default="on", choices=("on", "off"),
                    help="on: decode steps' index scores on the Pallas decode kernel (Numerics.decode_index_kernel)")
    ap.add_argument("--decode-index-fp4", default=None, choices=("on", "off"),
                    help="on: the decode index kernel's FP4 form over the cache as stored (Numerics.decode_index_fp4; "
                    "default: the Numerics default)")
    ap.add_argument("--swiglu-quant", default="on", choices=("on", "off"),
                    help="on: h's activation quantizer in the SwiGLU epilogue (Numerics.expert_swiglu_quant)")
    ap.add_argument("--pdl", action="store_true",
                    help="Numerics.kernel_pdl: the Mosaic GPU kernels under programmatic dependent launch")
    ap.add_argument("--topk-prefilter", default="on", choices=("on", "off"),
                    help="off: the indexer's top-k on whole rows (e2e_gpu.without_topk_prefilter; the A/B)")
    ap.add_argument("--prefill-chunk-tiles", action="store_true",
                    help="prefill-phase expert GEMMs on the chunk phase's 64-row tiles (e2e_gpu.py's A/B switch)")
    ap.add_argument("--dense-kernel-linears", default=None,
                    help="Numerics.dense_kernel_linears: comma-separated dense_fp8.DENSE_LINEARS names, or 'all' "
                    "(default: the Numerics default)")
    args = ap.parse_args(argv)

    sharding = compile_only_sharding(args.target_config)
    resolve_as_cuda()
    from deepinfer_jax.engine.scheduler import EngineConfig, Scheduler
    from deepinfer_jax.engine.token_map import compressed_token_map
    from deepinfer_jax.engine.tokenizer import Tokenizer
    from deepinfer_jax.model.dense_fp8 import parse_linear_names
    from deepinfer_jax.model.numerics import Numerics
    from e2e_gpu import decode_inputs, with_prefill_chunk_tiles, with_segment_rows, without_topk_prefilter
    from slice_model import TOKENIZER_DIR, slice_config

    cfg = slice_config(args.layers)
    if args.prefill_chunk_tiles:
        with_prefill_chunk_tiles()
    if args.topk_prefilter == "off":
        without_topk_prefilter()
    # as the GPU engine runs: unrolled Sinkhorn, the bf16 stream dot and dense outputs, the cheaper FP4
    # decoder the slice allows; the dense-kernel options are the Numerics defaults unless given
    numerics = dataclasses.replace(Numerics.reference(), sinkhorn_unroll=True, stream_dot_bf16=True,
                                   dense_bf16_out=True, fp4_scale_max=127, expert_operands=args.expert_operands,
                                   attention_fp4_rows=args.attention_fp4_rows,
                                   expert_w13_launch=args.w13_launch == "on", kernel_pdl=args.pdl,
                                   expert_swiglu_epilogue=args.swiglu_epilogue == "on",
                                   attention_schedule=args.attention_schedule,
                                   expert_swiglu_quant=args.swiglu_quant == "on",
                                   decode_index_kernel=args.decode_index_kernel == "on")
    if args.dense_kernel is not None:
        numerics = dataclasses.replace(numerics, dense_kernel=args.dense_kernel)
    if args.decode_index_fp4 is not None:
        numerics = dataclasses.replace(numerics, decode_index_fp4=args.decode_index_fp4 == "on")
    if args.dense_kernel_linears is not None:
        numerics = dataclasses.replace(numerics, dense_kernel_linears=parse_linear_names(args.dense_kernel_linears))
    numerics = with_segment_rows(numerics, args.sinkhorn_segment_rows)
    params = abstract_params(cfg, dense_kernel=numerics.dense_kernel != "off",
                             dense_linears=numerics.dense_kernel_linears)
    tok = Tokenizer.from_dir(TOKENIZER_DIR)
    token_map, _ = compressed_token_map(TOKENIZER_DIR / "tokenizer.json", cfg.vocab_size)
    records = []
    for chunk in (int(c) for c in args.prefill.split(",") if c):
        sch = Scheduler(params, cfg, tok, token_map, numerics,
                        EngineConfig(max_slots=1, max_len=args.prompt + 16, chunk_size=chunk))
        inp = sch._common_inputs(chunk)
        inp.update(tokens=np.ones((1, chunk), np.int32), replay_mask=np.ones((1, chunk), bool),
                   last_index=np.full(1, chunk - 1, np.int32), admit=np.ones(1, bool))
        inp["positions"][0] = np.arange(chunk)
        step_args = (params, sch.state, inp, sch.consts)
        records.append(probe(sch._prefill, step_args, sharding,
                             f"prefill chunk {chunk} (layers to the last KV source)", args.hlo_dir))
        if sch._prefill_upper is not None:      # bounded replay's second program, fed by the first's carry
            carry = jax.eval_shape(sch._prefill, *(place_on(a, sharding) for a in step_args))[1]
            records.append(probe(sch._prefill_upper, (params, sch.state, carry, inp, sch.consts), sharding,
                                 f"prefill chunk {chunk} (layers above it, the head and the sampler)", args.hlo_dir))
    for b in (int(v) for v in args.decode.split(",") if v):
        sch = Scheduler(params, cfg, tok, token_map, numerics,
                        EngineConfig(max_slots=b, max_len=args.context + 64, chunk_size=256))
        records.append(probe(sch._decode, (params, sch.state, decode_inputs(sch, args.context), sch.consts),
                             sharding, f"decode B={b} context {args.context}", args.hlo_dir))
    if args.out:
        args.out.write_text(json.dumps(dict(jax=jax.__version__, layers=args.layers, records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
