"""MoE: sqrt-softplus router (bias for selection only), dropless routed experts, shared expert.

Routing is row-local with a fixed tie-break, and each token's top-k expert outputs are summed in rank
order, so a token's result never depends on which other tokens share its experts.

Every expert GEMM's result is rounded as the reference's GEMM writes it (``Numerics.expert_out_dtype``:
bf16 under the reference's numerics, whose ``fp4_gemm`` / ``fp8_gemm`` allocate the default dtype): g and
u are then widened to float32 for the SwiGLU, and the layer sums the routed and shared outputs in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.hash_routing import hash_route
from deepinfer_jax.model.linear import (act_quant, act_quant_rows, dense, dequant_fp4, dot_f32, quant_linear,
                                         quant_linear_pair)
from deepinfer_jax.model.numerics import Numerics, fit_block, kernel_route
from pallas_kernels.topk.xla import topk_desc_rows


def torch_softplus(x: jax.Array) -> jax.Array:
    """softplus with torch's threshold 20 (identity above), the reference's definition."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def route(p_gate: dict, cfg: ModelConfig, x_md: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """-> (expert ids [M, k] in descending biased score, routing weights [M, k] fp32)."""
    logits = dot_f32(x_md, p_gate["weight"])   # fp32 logits (bf16 operands: exact products)
    scores = jnp.sqrt(torch_softplus(logits))
    _, ids = topk_desc_rows(scores + p_gate["bias"].astype(jnp.float32), top_k)
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


def expert_result(y: jax.Array, numerics: Numerics) -> jax.Array:
    """An expert GEMM's float32 accumulation as the reference's GEMM writes it (module docstring)."""
    return y.astype(numerics.expert_out_dtype)


def widened(y: jax.Array, numerics: Numerics) -> jax.Array:
    """g or u as ``Expert.forward``'s ``.float()`` hands them to the SwiGLU: the GEMM's written result,
    in float32."""
    return expert_result(y, numerics).astype(jnp.float32)


def swiglu(g: jax.Array, u: jax.Array, limit: float | None) -> jax.Array:
    """silu(min(g, limit)) * clamp(u, +-limit); limit None: no clamp (V4's initial-revision shared expert)."""
    if limit is not None:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u


def routed_experts_gather(p_exp: dict, x_md: jax.Array, ids_mk: jax.Array, w_mk: jax.Array, limit: float,
                          numerics: Numerics, act_block: int) -> jax.Array:
    """XLA path: gather each token's k experts and run them row by row -> [M, k, D] in
    ``numerics.expert_out_dtype``.

    act_block: the activation quantization block (``ModelConfig.act_quant_block``), for both GEMM inputs.

    Memory is M*k*(3*inter*D) dequantized weights: right for CPU tests and small batches; the GPU path
    is the grouped GEMM in ``pallas_kernels``.
    """
    wdt = jnp.float32 if numerics.dtype == jnp.float32 else jnp.bfloat16

    def deq(name):
        w, s = _expert_weights(p_exp[name])
        if s is None:  # unquantized experts (tests, converted checkpoints)
            return w[ids_mk].astype(wdt)
        return dequant_fp4(w[ids_mk], s[ids_mk]).astype(wdt)

    xq = act_quant(x_md, numerics, act_block).astype(wdt)
    g = jnp.einsum("md,mkid->mki", xq, deq("w1"), precision=numerics.precision, preferred_element_type=jnp.float32)
    u = jnp.einsum("md,mkid->mki", xq, deq("w3"), precision=numerics.precision, preferred_element_type=jnp.float32)
    hid = swiglu(widened(g, numerics), widened(u, numerics), limit) * w_mk[..., None]
    hid = act_quant(hid.astype(numerics.dtype), numerics, act_block)
    return expert_result(jnp.einsum("mki,mkdi->mkd", hid.astype(wdt), deq("w2"), precision=numerics.precision,
                                    preferred_element_type=jnp.float32), numerics)


def _stored_weight(p_lin: dict) -> jax.Array:
    """The linear's weights in the checkpoint's [G, N, Kw] layout: tile-major ones
    (``prepare_experts_tile_major``) are laid back, for the paths other than the kernel."""
    from pallas_kernels.grouped_gemm.config import row_major_weights

    return row_major_weights(p_lin["weight_tm"]) if "weight_tm" in p_lin else p_lin["weight"]


def _weight_shape(p_lin: dict) -> tuple[int, int, int]:
    """[G, N, Kw] of the linear's weights as the checkpoint lays them out, in either held layout."""
    from pallas_kernels.grouped_gemm.config import tile_major_stored_shape

    if "weight_tm" in p_lin:
        return tile_major_stored_shape(p_lin["weight_tm"])
    return tuple(p_lin["weight"].shape)


def _weight_struct(p_lin: dict) -> jax.ShapeDtypeStruct:
    w = p_lin.get("weight_tm", p_lin.get("weight"))
    return jax.ShapeDtypeStruct(_weight_shape(p_lin), w.dtype)


def _expert_weights(p_lin: dict) -> tuple[jax.Array, jax.Array | None]:
    """A stacked expert linear as the checkpoint lays it out (packed FP4 / FP8 + E8M0, or bf16); kernel-
    layout scales (``prepare_expert_scales``) and tile-major weights are converted back, for the paths
    other than the kernel."""
    w = _stored_weight(p_lin)
    if "scale_kn" in p_lin:
        from pallas_kernels.grouped_gemm.scales import check_prepared, checkpoint_scales

        return w, checkpoint_scales(p_lin["scale_kn"], check_prepared(w, p_lin["scale_kn"]))
    return w, p_lin.get("scale")


def _map_expert_linears(params, fn):
    """params with fn applied to every routed-expert linear dict (w1, w3, w2 of each MoE layer)."""
    if isinstance(params, dict):
        if "experts" in params and isinstance(params["experts"], dict):
            params = dict(params, experts={k: fn(v) if k in ("w1", "w2", "w3") else v
                                           for k, v in params["experts"].items()})
        return {k: (v if k == "experts" else _map_expert_linears(v, fn)) for k, v in params.items()}
    if isinstance(params, (list, tuple)):
        return type(params)(_map_expert_linears(v, fn) for v in params)
    return params


def prepare_expert_scales(params: dict) -> dict:
    """params with every routed-expert linear's E8M0 ``scale`` replaced by ``scale_kn``, the Pallas
    grouped GEMM's layout uint8 [G, K/32, N] (``pallas_kernels.grouped_gemm.scales``).

    For the engine on Hopper GPUs, once after loading: the kernel then reads the scales as stored
    instead of transposing them every step. Same bytes for FP4 (1/16 of the packed weights); FP8's
    32x32 block scales become per-row (32x more scale bytes, 1/32 of the FP8 weights). Other paths read
    ``scale_kn`` too (converted back per call), so prepared params still run anywhere. The input's
    expert scale buffers are not reused: call it on params you then drop."""
    from pallas_kernels.grouped_gemm.scales import kernel_scales
    from pallas_kernels.grouped_gemm.config import weight_format

    convert = jax.jit(kernel_scales, static_argnames=("fmt", "n"))

    def linear(p_lin: dict) -> dict:
        if "scale" not in p_lin:
            return p_lin
        fmt = weight_format(p_lin["weight"], p_lin["scale"])
        out = {k: v for k, v in p_lin.items() if k != "scale"}
        s_kn = convert(p_lin["scale"], fmt=fmt, n=p_lin["weight"].shape[1])
        sharding = getattr(p_lin["scale"], "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):    # keep the mesh layout, axes 1 and 2 swapped
            spec = tuple(sharding.spec) + (None,) * (3 - len(sharding.spec))
            s_kn = jax.device_put(s_kn, jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(spec[0], spec[2], spec[1])))
        out["scale_kn"] = s_kn
        return out

    return _map_expert_linears(params, linear)


def _expert_linears(params):
    """Every routed-expert linear dict (w1, w3, w2 of each MoE layer) in params."""
    if isinstance(params, dict):
        if "experts" in params and isinstance(params["experts"], dict):
            yield from (v for k, v in params["experts"].items() if k in ("w1", "w2", "w3"))
        for k, v in params.items():
            if k != "experts":
                yield from _expert_linears(v)
    elif isinstance(params, (list, tuple)):
        for v in params:
            yield from _expert_linears(v)


def fp4_expert_scale_max(params: dict) -> int | None:
    """The largest E8M0 byte over the routed experts' FP4 scales (either layout); None without FP4 experts.
    Reads the arrays (one reduction each): for load time."""
    from pallas_kernels.grouped_gemm.config import WeightFormat
    from pallas_kernels.grouped_gemm.fp4_packed import scale_byte_max

    tops = [scale_byte_max(s) for p_lin in _expert_linears(params)
            if (s := p_lin.get("scale_kn", p_lin.get("scale"))) is not None
            and _expert_format(p_lin) is WeightFormat.FP4]
    return max((t for t in tops if t is not None), default=None)


def prepare_experts_tile_major(params: dict, donate: bool = False) -> dict:
    """params with each routed-expert FP4 linear's ``weight`` [G, N, K/2] held as ``weight_tm``, the
    grouped GEMM's tile-major layout [G, N/256, K/128, 256, 64] (``tile_major_weights``), so each K
    step of the kernel reads one contiguous 16 KB run instead of 256 row pieces of 64 bytes. On an
    H100 (sweep round 9, 2026-12-05): decode 64 x 6 0.785 -> 0.598 ms, 512 x 6 1.261 -> 1.005, a 2048-
    token chunk 1.475 -> 1.267, prefill 32k unchanged; the same bits.

    Only where the kernel's layout applies: FP4 weights with kernel-layout scales, N a multiple of 256
    and K of 128, experts sharded (if at all) on the expert axis alone. Each linear is converted in its
    own jitted call. donate: that call consumes the input's weights (they are deleted), so the peak is
    one linear's copy, not all experts twice: for callers that drop the input params (the engine)."""
    from pallas_kernels.grouped_gemm.config import TILE_MAJOR_TILE, WeightFormat, tile_major_weights

    bn, bk = TILE_MAJOR_TILE
    convert = jax.jit(lambda w: tile_major_weights(w, bn, bk), donate_argnums=0 if donate else ())

    def linear(p_lin: dict) -> dict:
        if "scale_kn" not in p_lin or "weight" not in p_lin or _expert_format(p_lin) is not WeightFormat.FP4:
            return p_lin
        w = p_lin["weight"]
        _, n, kw = w.shape
        sharding = getattr(w, "sharding", None)
        spec = tuple(sharding.spec) if isinstance(sharding, jax.sharding.NamedSharding) else ()
        if n % bn or kw % (bk // 2) or any(a is not None for a in spec[1:]):
            return p_lin
        out = {k: v for k, v in p_lin.items() if k != "weight"}
        w_tm = convert(w)
        if spec:
            w_tm = jax.device_put(w_tm, jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(spec[0], None, None, None, None)))
        out["weight_tm"] = w_tm
        return out

    return _map_expert_linears(params, linear)


def prepare_experts_for_kernel(params: dict, numerics: Numerics, *, tile_major: bool = True,
                               donate: bool = False) -> tuple[dict, Numerics]:
    """What the engine does once after loading when ``experts_run_kernel``: kernel-layout expert scales
    (``prepare_expert_scales``), tile-major FP4 weights (``prepare_experts_tile_major``, unless
    ``tile_major=False``; ``donate`` consumes the input's expert weights), and ``numerics.fp4_scale_max``
    read off the scales, which lets the kernel use its cheaper FP4 decoder when every scale allows it."""
    import dataclasses

    params = prepare_expert_scales(params)
    if tile_major:
        params = prepare_experts_tile_major(params, donate=donate)
    return params, dataclasses.replace(numerics, fp4_scale_max=fp4_expert_scale_max(params))


def experts_run_kernel(numerics: Numerics) -> bool:
    """Whether the routed experts will run on the Pallas grouped GEMM here (the engine then calls
    ``prepare_expert_scales`` once). Platform and mode only; shapes the kernel cannot take fall back
    at trace time and read the prepared scales converted back."""
    from pallas_kernels import registry

    if numerics.dtype != jnp.bfloat16 or numerics.kernel_mode("experts") in ("xla", "interpret"):
        return False
    return registry.resolve("grouped_matmul").name == registry.PALLAS_MOSAIC_GPU


def _kernel_weights(p_lin: dict) -> tuple[jax.Array, jax.Array | None, bool]:
    """(w, scale, scale is in the kernel layout) for ``grouped_matmul``."""
    if "scale_kn" in p_lin:
        return p_lin.get("weight_tm", p_lin.get("weight")), p_lin["scale_kn"], True
    w, s = _expert_weights(p_lin)
    return w, s, False


def _expert_format(p_lin: dict):
    """The ``WeightFormat`` of a stacked expert linear (a ValueError naming what is wrong)."""
    from pallas_kernels.grouped_gemm.config import weight_format
    from pallas_kernels.grouped_gemm.scales import check_prepared

    if "scale_kn" in p_lin:
        return check_prepared(_weight_struct(p_lin), p_lin["scale_kn"])
    return weight_format(p_lin["weight"], p_lin.get("scale"))


def _fp4_operands(numerics: Numerics, act_block: int) -> str:
    """The kernel's ``fp4_operands`` for these numerics: "e4m3" only when ``numerics.expert_operands``
    says so (resolved for this program) and the activation quantizer's blocks are whole 32-column
    blocks, so that the E4M3 form re-expresses each activation exactly (``fp8_operands.e4m3_rows``)."""
    return "e4m3" if numerics.expert_operands == "e4m3" and act_block % 32 == 0 else "bf16"


def _tile_config(p_lin: dict, m_rows: int, numerics: Numerics, act_block: int = 32):
    """The kernel config for these weights at M rows (``tuned_config``: static in the shapes), with the
    "subnormal" FP4 decoder when ``numerics.fp4_scale_max`` says every scale allows it, and the
    operand form ``_fp4_operands`` picks."""
    import dataclasses

    from pallas_kernels.grouped_gemm.config import GroupedMatmulConfig, tile_major_tile, tuned_config
    from pallas_kernels.grouped_gemm.fp4_packed import SUBNORMAL_MAX_SCALE_BYTE

    g, n, kw = _weight_shape(p_lin)
    fmt = _expert_format(p_lin)
    k = kw * (2 if fmt.value == "fp4" else 1)
    fits = numerics.fp4_scale_max is not None and numerics.fp4_scale_max <= SUBNORMAL_MAX_SCALE_BYTE
    base = GroupedMatmulConfig(fp4_dequant="subnormal" if fits else "packed",
                               fp4_operands=_fp4_operands(numerics, act_block), pdl=numerics.kernel_pdl)
    if "weight_tm" in p_lin:      # the held layout fixes the tile's width and the K run a step may read
        bn, bk = tile_major_tile(p_lin["weight_tm"])
        base = dataclasses.replace(base, block_n=bn, block_k=bk, weights_tile_major=True)
    return tuned_config(m_rows, g, n, k, fmt, jnp.float32, base=base)


def _grouped_unsupported(p_exp: dict, numerics: Numerics, m_rows: int,
                         act_block: int = 32) -> tuple[str | None, str | None]:
    """(why the grouped_matmul op cannot take these inputs at all, why the Pallas kernel cannot run them)."""
    from pallas_kernels.grouped_gemm.config import kernel_unsupported_reason

    if numerics.dtype != jnp.bfloat16:
        return f"grouped_matmul takes bf16 activations, not {numerics.dtype}", None
    fmts = {}
    for name in ("w1", "w3", "w2"):
        try:
            fmts[name] = _expert_format(p_exp[name])
        except ValueError as e:
            return f"expert weights {name}: {e}", None
    for name in ("w1", "w3", "w2"):
        shape = _weight_shape(p_exp[name])
        k = shape[2] * (2 if fmts[name].value == "fp4" else 1)
        cfg = _tile_config(p_exp[name], m_rows, numerics, act_block)
        if (why := kernel_unsupported_reason(shape[1], k, fmts[name], cfg, jnp.float32)):
            return None, f"expert weights {name} {shape}: {why}"
    return None, None


INTERPRET_BLOCK_M = 16   # the interpreter's tile rows (tests of forms that need 64-row tiles raise it)


def routed_experts_grouped(p_exp: dict, x_md: jax.Array, ids_mk: jax.Array, w_mk: jax.Array, limit: float,
                           numerics: Numerics, act_block: int, impl: str | None = None,
                           tiled: bool = True) -> jax.Array:
    """``routed_experts_gather`` on ``pallas_kernels.grouped_gemm.grouped_matmul`` -> [M, k, D] in
    ``numerics.expert_out_dtype``.

    Rows are the (token, rank) pairs; the op sorts them by expert, runs fixed-size one-expert tiles and
    returns each row's result unchanged by its neighbours. Same quantizer sites as the gather path; the
    products are the same (bf16 x exactly-dequantized weights, fp32 accumulation), only the summation
    order differs. impl: ``grouped_matmul``'s impl (None = automatic), or "interpret" = the Pallas kernel
    in the Mosaic GPU interpreter (CPU tests). tiled: on the Pallas kernel, run the three GEMMs on one
    tile plan (``_routed_experts_tiled``; same row bits, less work around the kernel)."""
    import dataclasses

    from pallas_kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
    from pallas_kernels.grouped_gemm.config import tile_major_tile
    from pallas_kernels.registry import PALLAS_MOSAIC_GPU

    m, k = ids_mk.shape
    gid = ids_mk.reshape(m * k).astype(jnp.int32)
    interpret = impl == "interpret"
    if interpret:
        # The interpreter's wgmma reads shared memory only: stage the dequantized tile there; small
        # tiles keep the interpreter fast (same 16-wide K order, so the same row results).
        tiny = GroupedMatmulConfig(block_m=INTERPRET_BLOCK_M, block_n=128, block_k=64, stages=2,
                                   a_from_registers=False, fp4_operands=_fp4_operands(numerics, act_block))
        # (tile-major weights fix block_n; the 64-wide K steps read half of each layout tile)
        cfgs = {name: dataclasses.replace(tiny, block_n=tile_major_tile(p_exp[name]["weight_tm"])[0],
                                          weights_tile_major=True)
                if "weight_tm" in p_exp[name] else tiny for name in ("w1", "w3", "w2")}
    else:
        cfgs = {name: _tile_config(p_exp[name], m * k, numerics, act_block) for name in ("w1", "w3", "w2")}
    if impl in (PALLAS_MOSAIC_GPU, "interpret") and tiled:
        fmts = {name: _expert_format(p_exp[name]) for name in cfgs}
        if len({c.block_m for c in cfgs.values()}) == 1 and fmts["w1"] == fmts["w3"]:
            return _routed_experts_tiled(p_exp, x_md, gid, w_mk, limit, numerics, act_block, cfgs, fmts, interpret)
    xq = act_quant(x_md, numerics, act_block).astype(jnp.bfloat16)
    x_rows = jnp.repeat(xq, k, axis=0)           # row m*k + r = token m, rank r

    def mm(x, name):
        w, s, prepared = _kernel_weights(p_exp[name])
        if interpret:
            from pallas_kernels.grouped_gemm.kernel import grouped_matmul_pallas

            return _interpreted(lambda: grouped_matmul_pallas(x, w, gid, s, out_dtype=jnp.float32, config=cfgs[name],
                                                              scales_prepared=prepared), True)
        return grouped_matmul(x, w, gid, s, out_dtype=jnp.float32, impl=impl, selection=_auto_selection(),
                              config=cfgs[name], scales_prepared=prepared)

    g = widened(mm(x_rows, "w1"), numerics)
    u = widened(mm(x_rows, "w3"), numerics)
    hid = swiglu(g, u, limit) * w_mk.reshape(m * k)[:, None]
    hid = act_quant(hid.astype(numerics.dtype), numerics, act_block)
    return expert_result(mm(hid.astype(jnp.bfloat16), "w2"), numerics).reshape(m, k, -1)


def _interpreted(fn, interpret: bool):
    """fn(), traced inside the Mosaic GPU interpreter when ``interpret`` (CPU tests)."""
    if not interpret:
        return fn()
    from pallas_kernels.interpret import gpu_interpreter

    with gpu_interpreter():
        return fn()


ROUTED_SWIGLU_PADDING = 1.5   # padded rows / routed rows above which the swiglu runs on routed rows only


def _routed_experts_tiled(p_exp: dict, x_md: jax.Array, gid: jax.Array, w_mk: jax.Array, limit: float,
                          numerics: Numerics, act_block: int, cfgs: dict, fmts: dict, interpret: bool) -> jax.Array:
    """``routed_experts_grouped`` on the kernel with one tile plan for w1, w3 and w2 -> [M, k, D] in
    ``numerics.expert_out_dtype``.
    x_md [M, D]: the token rows, before the activation quantizer; gid [M*k]: routed row m*k + r is token
    m's rank r. Where the kernel takes E4M3 rows, the quantizer makes them in one pass
    (``linear.act_quant_rows``: bitwise its two-step form).

    The per-GEMM op sorts, gathers, transposes and scatters around every GEMM: on the H200 the eager op
    took 0.18 ms more than its kernel at decode 64 x 6 and 0.95 ms more at a 2048-token prefill chunk
    (kernel 0.62 / 1.20 ms; results/grouped_gemm_sweep{4,5}_2026-12-04.json). Here one sort and one
    gather feed w1 and w3, the swiglu runs on their tile-order result rows, w2 reads those rows, and
    only its result is gathered back. Every row meets the same kernel, tiles and elementwise ops as on
    the per-GEMM path, so the bits are the same (tests/test_kernel_wiring.py)."""
    from pallas_kernels.grouped_gemm.config import uses_e4m3_rows
    from pallas_kernels.grouped_gemm.kernel import (gather_kernel_rows, grouped_matmul_tiles, retile, swiglu_config,
                                                    swiglu_tiles, swiglu_unsupported_reason, tile_rows, untile_rows)

    m, k = w_mk.shape
    num_groups = _weight_shape(p_exp["w1"])[0]

    def run(x_pk, name):
        w, s, prepared = _kernel_weights(p_exp[name])
        return grouped_matmul_tiles(plan, x_pk, w, s, out_dtype=jnp.float32, config=cfgs[name],
                                    scales_prepared=prepared)

    w1, s1, prepared1 = _kernel_weights(p_exp["w1"])
    w3, s3, prepared3 = _kernel_weights(p_exp["w3"])
    alike = (numerics.expert_w13_launch and cfgs["w1"] == cfgs["w3"] and prepared1 == prepared3
             and w1.shape == w3.shape and w1.dtype == w3.dtype and (s1 is None) == (s3 is None))

    def gate_and_up(x_pk):
        """(w1's, w3's results) [T*block_m, inter]: one launch where both weights are held alike."""
        if not alike:
            return run(x_pk, "w1"), run(x_pk, "w3")
        inter = _weight_shape(p_exp["w1"])[1]
        y13 = grouped_matmul_tiles(plan, x_pk, w1, s1, out_dtype=jnp.float32, config=cfgs["w1"],
                                   scales_prepared=prepared1, more=((w3, s3),))
        return y13[:, :inter], y13[:, inter:]

    # (w1 and w3: the same format, shape and numerics, so the same row form; the caller checked the format)
    e4m3 = {name: uses_e4m3_rows(cfgs[name], fmts[name]) for name in cfgs}
    fp4 = {name: f.value == "fp4" for name, f in fmts.items()}

    def quantized_rows(h_md, as_e4m3: bool):
        """The activation quantizer's rows: E4M3 rows in one pass where the kernel takes them."""
        if as_e4m3 and numerics.fake_quant:
            return act_quant_rows(h_md, act_block)
        return act_quant(h_md, numerics, act_block).astype(jnp.bfloat16)

    plan, x_pk = tile_rows(quantized_rows(x_md, e4m3["w1"]), gid, num_groups=num_groups,
                           block_m=cfgs["w1"].block_m, fp4=fp4["w1"], e4m3=e4m3["w1"], rows_per_source=k)
    if plan.row_src.shape[0] > ROUTED_SWIGLU_PADDING * m * k:
        # Mostly padding (decode: 6,144 padded rows for 384 routed; a 2048-token chunk: 3x): the swiglu
        # and quantizer run on the routed rows only, which are then placed in tile order for w2. Per
        # element this moves 12 bytes per routed row plus 2 per padded row, instead of 10 per padded
        # row (so from 1.5x padding). Row-local work on the same rows, so the same bits.
        g_pn, u_pn = _interpreted(lambda: gate_and_up(x_pk), interpret)   # [T*block_m, inter] each
        hid_mi = swiglu(widened(untile_rows(g_pn, plan), numerics), widened(untile_rows(u_pn, plan), numerics),
                        limit) * w_mk.reshape(m * k, 1)
        x2_mi = quantized_rows(hid_mi.astype(numerics.dtype), e4m3["w2"])
        x2_pk = gather_kernel_rows(retile(x2_mi, fp4=fp4["w2"], e4m3=e4m3["w2"]), plan)
    else:
        w_p = jnp.take(w_mk.reshape(m * k), plan.row_src, mode="fill", fill_value=0)
        epilogue = (alike and numerics.expert_swiglu_epilogue
                    and swiglu_unsupported_reason(cfgs["w1"], fmts["w1"]) is None)
        # the quantizer in the epilogue too: h leaves the launch as w2's bf16 rows
        q_block = fit_block(_weight_shape(p_exp["w1"])[1], act_block) if numerics.fake_quant else None
        q_cfg = (swiglu_config(cfgs["w1"], fmts["w1"], jnp.bfloat16, q_block)
                 if epilogue and numerics.expert_swiglu_quant and numerics.dtype == jnp.bfloat16 else None)
        if q_cfg is not None:
            hid_pn = _interpreted(lambda: swiglu_tiles(plan, x_pk, w1, s1, w3, s3, w_p, limit=limit, config=q_cfg,
                                                       scales_prepared=prepared1, out_dtype=jnp.bfloat16,
                                                       act_block=q_block, gu_dtype=numerics.expert_out_dtype),
                                  interpret)
        else:
            if epilogue:
                # w1, w3 and the swiglu times w_p in one launch: g and u never leave the kernel
                hid_pn = _interpreted(lambda: swiglu_tiles(plan, x_pk, w1, s1, w3, s3, w_p, limit=limit,
                                                           config=cfgs["w1"], scales_prepared=prepared1,
                                                           gu_dtype=numerics.expert_out_dtype), interpret)
            else:
                g_pn, u_pn = _interpreted(lambda: gate_and_up(x_pk), interpret)
                hid_pn = swiglu(widened(g_pn, numerics), widened(u_pn, numerics), limit) * w_p[:, None]
            hid_pn = act_quant(hid_pn.astype(numerics.dtype), numerics, act_block)
        x2_pk = retile(hid_pn, fp4=fp4["w2"], e4m3=e4m3["w2"])
    y_pn = _interpreted(lambda: run(x2_pk, "w2"), interpret)
    return untile_rows(y_pn, plan, numerics.expert_out_dtype).reshape(m, k, -1)


def _auto_selection():
    # The model's choice is Numerics.kernels; an impl of None means the op's automatic choice, not the
    # DEEPINFER_KERNELS environment variable.
    from pallas_kernels.registry import AUTO

    return AUTO


def routed_experts(p_exp: dict, x_md: jax.Array, ids_mk: jax.Array, w_mk: jax.Array, limit: float,
                   numerics: Numerics, act_block: int) -> jax.Array:
    """The routed experts on the implementation ``numerics.kernels`` picks (numerics.py): the gather
    path, or the grouped GEMM (Pallas kernel on Hopper, its tiled XLA fallback elsewhere)."""
    op_why, kernel_why = _grouped_unsupported(p_exp, numerics, ids_mk.size, act_block)
    if op_why is not None:
        if numerics.kernel_mode("experts") in ("pallas", "interpret"):
            from pallas_kernels.registry import KernelUnavailableError

            raise KernelUnavailableError(f"experts: the Pallas kernel was requested but {op_why}")
        return routed_experts_gather(p_exp, x_md, ids_mk, w_mk, limit, numerics, act_block)
    route, impl = kernel_route(numerics, "experts", "grouped_matmul", kernel_why)
    if route == "model":
        return routed_experts_gather(p_exp, x_md, ids_mk, w_mk, limit, numerics, act_block)
    return routed_experts_grouped(p_exp, x_md, ids_mk, w_mk, limit, numerics, act_block, impl)


def shared_expert(p: dict, x_md: jax.Array, limit: float | None, numerics: Numerics, act_block: int) -> jax.Array:
    """-> [M, D] in ``numerics.expert_out_dtype``; its GEMMs' results rounded as the routed experts' are."""
    odt = numerics.expert_out_dtype
    if "w13" in p:    # w1 and w3 held as one linear for the dense kernel (dense_fp8.prepare_dense_fp8)
        g, u = quant_linear_pair(x_md, p["w13"], numerics, odt, act_block=act_block)
    else:
        g = quant_linear(x_md, p["w1"], numerics, odt, act_block=act_block)
        u = quant_linear(x_md, p["w3"], numerics, odt, act_block=act_block)
    hid = swiglu(g.astype(jnp.float32), u.astype(jnp.float32), limit).astype(numerics.dtype)
    return quant_linear(hid, p["w2"], numerics, odt, act_block=act_block)


def moe(p: dict, cfg: ModelConfig, x_btd: jax.Array, numerics: Numerics, top_k: int | None = None,
        experts_impl=None, token_ids: jax.Array | None = None) -> jax.Array:
    """experts_impl: a replacement for ``routed_experts_gather`` with its signature (e.g. the
    expert-parallel ``parallel.moe_ep``); None = ``routed_experts``, which picks the gather path or the
    grouped-GEMM kernel by ``numerics.kernels``. token_ids [B*T]: given on hash-routed layers (V4's
    first num_hash_layers), whose experts come from ``gate.tid2eid`` (hash_routing.py)."""
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)
    with jax.named_scope("router"):
        if token_ids is not None:
            ids, w = hash_route(p["gate"], cfg, x, token_ids)
        else:
            ids, w = route(p["gate"], cfg, x, top_k or cfg.num_experts_per_tok)
    ab = cfg.act_quant_block
    with jax.named_scope("routed"):
        routed = (experts_impl or routed_experts)(p["experts"], x, ids, w, cfg.swiglu_limit, numerics, ab)
    with jax.named_scope("shared"):
        shared = shared_expert(p["shared_experts"], x, cfg.swiglu_limit if cfg.shared_expert_clamp else None,
                               numerics, ab)
    # float32 sums in a fixed order (rank order, not a tree chosen by the compiler), the shared expert
    # last, as MoE.forward adds it (the reference walks the routed ones by expert id: the same terms)
    y = routed[:, 0].astype(jnp.float32)
    for k in range(1, routed.shape[1]):
        y = y + routed[:, k].astype(jnp.float32)
    y = y + shared.astype(jnp.float32)
    return y.astype(numerics.dtype).reshape(b, t, d)


__all__ = ["moe", "route", "swiglu", "dense"]
