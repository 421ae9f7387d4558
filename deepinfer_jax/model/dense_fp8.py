"""Dense FP8 linears held for the grouped GEMM kernel, and their kernel route (``Numerics.dense_kernel``).

The GPU engine holds the dense FP8 linears (``linear.held_as_bf16``: 2-D FP8 weights outside the routed
experts and lookup tables) either as bf16 copies (``linear.dequantize_dense_fp8``, XLA's dots) or, with
``dense_kernel`` on, split along K for the kernel (``prepare_dense_fp8``: one byte a weight plus kernel-
layout scales). A linear held this way is {"kernel_fp8": ``DenseFp8Weights``}. Where the kernel does not
run (prefill programs under "decode", other platforms) its exact bf16 weight is rebuilt inside the step
(``held_weight``), so XLA computes the same bits as from the checkpoint's tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.numerics import Numerics, kernel_route
from pallas_kernels.grouped_gemm import dense
from pallas_kernels.registry import PALLAS_MOSAIC_GPU

KERNEL_FP8 = "kernel_fp8"
# The kernel's operand form for the FP8-quantized dense linears. "bf16" (weights dequantized in
# registers): on an H100 (session 25, ``dense_fp8_gpu.py --engine-only``, 64 rows) faster than the E4M3
# form at every V4.1 dense shape, e.g. wo_b 0.0358 vs 0.0411 ms, the shared w13 0.0244 vs 0.0286, wq_b
# 0.0300 vs 0.0350: the E4M3 form's 64-row tiles spill registers (benchmarks/NOTES.md item -22).
# "e4m3" (the quantizer's codes straight into FP8 wgmmas, ``linear.act_quant_rows``) stays selectable.
DENSE_OPERANDS = "bf16"


def is_prepared(p: dict) -> bool:
    return isinstance(p, dict) and KERNEL_FP8 in p


# The names ``prepare_dense_fp8(linears=...)`` (``Numerics.dense_kernel_linears``) selects by: the linear's
# own key, prefixed by "indexer." or "shared." inside those modules ("shared.w13": w1 and w3 as one
# launch; "shared.w1" / "shared.w3": each its own, when w13 is not selected).
DENSE_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer.wq_b", "shared.w13", "shared.w1", "shared.w3",
                 "shared.w2")


def linear_name(path: tuple) -> str:
    """A dense linear's name in ``DENSE_LINEARS`` from its params path (keys; the last is the linear's)."""
    for module, prefix in (("indexer", "indexer."), ("shared_experts", "shared.")):
        if module in path[:-1]:
            return prefix + str(path[-1])
    return str(path[-1])


def check_linear_names(names) -> None:
    unknown = sorted(set(names) - set(DENSE_LINEARS))
    if unknown:
        raise ValueError(f"dense kernel linears {unknown} unknown; known: {list(DENSE_LINEARS)}")


def parse_linear_names(text: str) -> tuple[str, ...] | None:
    """A command line's ``Numerics.dense_kernel_linears``: "all" -> None (every linear the kernel can
    take), else comma-separated ``DENSE_LINEARS`` names, checked."""
    if text == "all":
        return None
    names = tuple(n for n in text.split(",") if n)
    check_linear_names(names)
    return names


def _groups_of(path: tuple, cfg) -> int:
    """attention's wo_a is o_groups linears stacked along its rows (the grouped einsum); others one."""
    return cfg.o_groups if path and path[-1] == "wo_a" else 1


def prepare_dense_fp8(params: dict, cfg, *, block_n: int | None = None, block_k: int | None = None,
                      linears=None) -> dict:
    """params with each dense FP8 linear that the kernel can take held as {"kernel_fp8": DenseFp8Weights}
    (K split by ``dense.split_for``); a shared expert's w1 and w3 as one such linear "w13" (w1's rows,
    then w3's: ``linear.quant_linear_pair``); the others, and everything else, unchanged. Single-device params
    (no mesh layouts). Call ``linear.dequantize_dense_fp8`` after it for the ones left.
    block_n / block_k: the tile the linears must fit (default the dense form's; smaller only for tests of
    the held layout on tiny models, whose linears the kernel then does not take).
    linears: the names (``DENSE_LINEARS``) to hold for the kernel; None: every one it can take. On an H100
    the kernel beat XLA's bf16 dots on wo_a, wo_b and the shared w13 only (session 25), so a subset is the
    form worth timing (``Numerics.dense_kernel_linears``)."""
    from deepinfer_jax.model.linear import is_dense_fp8_linear, rewrite_nodes   # (linear imports this module)

    if linears is not None:
        check_linear_names(linears)
    wanted = (lambda name: True) if linears is None else (lambda name: name in linears)

    split = jax.jit(dense.split_weights, static_argnums=2)
    tile = dict(block_n=block_n or dense.DENSE_BLOCK_N, block_k=block_k or dense.DENSE_BLOCK_K)

    def splits_for(node, path, g=1):
        """The K split of a dense FP8 linear of g stacked linears, or None where the tiles do not fit."""
        if not isinstance(node, dict) or not is_dense_fp8_linear(node, path):
            return None
        rows, k = node["weight"].shape
        if rows % (g * 32) or node["scale"].shape[0] % g:
            return None
        splits = dense.split_for(rows // g, k, groups=g, **tile)
        return None if dense.unsupported_reason_for(rows // g, k, splits, **tile) else splits

    def held(node, path):
        if path and path[-1] == "shared_experts" and wanted("shared.w13") \
                and all(splits_for(node.get(name), path + (name,))
                                                         for name in ("w1", "w3")) \
                and node["w1"]["weight"].shape == node["w3"]["weight"].shape:
            # w1 and w3 read the same rows: one launch over both ("w13", w1's rows then w3's)
            w = jnp.concatenate([node["w1"]["weight"], node["w3"]["weight"]])
            s = jnp.concatenate([node["w1"]["scale"], node["w3"]["scale"]])
            splits = splits_for({"weight": w, "scale": s}, path + ("w1",))
            out = {kk: rewrite_nodes(v, held, path + (kk,)) for kk, v in node.items() if kk not in ("w1", "w3")}
            out["w13"] = {KERNEL_FP8: split(w[None], s[None], splits)}
            return out
        if not path or not wanted(linear_name(path)):
            return None
        g = _groups_of(path, cfg)
        splits = splits_for(node, path, g)
        if splits is None:
            return None
        w, s = node["weight"], node["scale"]
        rows, k = w.shape
        out = {kk: v for kk, v in node.items() if kk not in ("weight", "scale")}
        out[KERNEL_FP8] = split(w.reshape(g, rows // g, k), s.reshape(g, s.shape[0] // g, s.shape[1]), splits)
        return out

    return rewrite_nodes(params, held)


def held_weight(p: dict, dtype) -> jax.Array:
    """The exact dequantized 2-D weight [G*N, K] of a prepared linear (the checkpoint's shape)."""
    g, n, k = p[KERNEL_FP8].shape
    return dense.dequantized(p[KERNEL_FP8], dtype).reshape(g * n, k)


def kernel_impl(p: dict, numerics: Numerics, m_rows: int, fp8_operands: str) -> str | None:
    """The kernel route for this prepared linear at m_rows rows: "pallas_mosaic_gpu", "interpret", or
    None (XLA's dot on ``held_weight``). Static: platform, numerics and shapes only."""
    if not is_prepared(p) or numerics.dense_kernel != "on" or numerics.dtype != jnp.bfloat16:
        return None
    cfg = config_for(m_rows, fp8_operands, interpret=numerics.kernel_mode("dense") == "interpret")
    route, impl = kernel_route(numerics, "dense", "grouped_matmul", dense.unsupported_reason(p[KERNEL_FP8], cfg))
    return impl if route == "op" and impl in (PALLAS_MOSAIC_GPU, "interpret") else None


def config_for(m_rows: int, fp8_operands: str, *, interpret: bool, pdl: bool = False):
    """The kernel config of a prepared linear at m_rows rows (the interpreter: 64-wide K steps and the
    dequantized tile staged in shared memory, the form it can run; the same K order and so the same
    bits). pdl: ``Numerics.kernel_pdl``."""
    if interpret:
        return dense.dense_config(m_rows, fp8_operands, block_k=64, a_from_registers=False, pdl=pdl)
    return dense.dense_config(m_rows, fp8_operands, pdl=pdl)


def kernel_matmul(x_mgk, p: dict, impl: str, fp8_operands: str, pdl: bool = False) -> jax.Array:
    """x [M, G, K] (or ``E4m3Rows`` of such, for the "e4m3" form) -> float32 [M, G, N] on the kernel
    (``kernel_impl``'s route). pdl: ``Numerics.kernel_pdl``."""
    cfg = config_for(x_mgk.shape[0], fp8_operands, interpret=impl == "interpret", pdl=pdl)
    if impl != "interpret":
        return dense.dense_fp8_matmul(x_mgk, p[KERNEL_FP8], config=cfg)
    from pallas_kernels.interpret import gpu_interpreter

    with gpu_interpreter():
        return dense.dense_fp8_matmul(x_mgk, p[KERNEL_FP8], config=cfg)
