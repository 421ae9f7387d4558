"""Numerics switches and the simulated-quantization sites of the reference (spec §2.9-2.10).

``Numerics.reference()`` follows the official reference: BF16 activations and caches, and the FP8/FP4
fake-quantization before every quantized GEMM and on the KV caches. ``Numerics.exact()`` keeps fp32
activations and no fake quantization: the mode the float64 numpy tests compare against, because a
quantizer that flips one rounding step makes any float64-vs-float32 comparison meaningless.
``Numerics.fast()`` keeps the reference's quantizers and caches but runs the attention core and the
routed-expert GEMMs with the kernels' numerics (``pallas_kernels``: bf16 probabilities for p.kv,
fixed-size expert tiles): the deployment path. On a Hopper GPU that is the Pallas kernels, elsewhere
their batch-invariant XLA fallbacks with the same roundings. Every mode with bf16 activations rounds
each expert GEMM's result to bf16, as the reference does (``expert_outputs_f32``).

``Numerics.kernels`` picks who computes the hot ops (a static string, so jit caches key on it):

* ``"auto"`` (default): the Pallas kernels on a Hopper CUDA device for the shapes they support, the
  model's own XLA code everywhere else -- so on CPU the numerics are exactly those of ``"xla"``;
* ``"xla"``: the model's own XLA code (float32 attention at HIGHEST precision, dequantize-and-einsum
  experts), on every platform;
* ``"ops"``: the ``pallas_kernels`` ops with their automatic choice (kernel on Hopper, their XLA
  fallback elsewhere): the kernels' numerics on any platform;
* ``"pallas"``: force the Pallas kernels (``KernelUnavailableError`` where they cannot run);
* ``"interpret"``: the Pallas kernels in the Mosaic GPU interpreter (CPU tests only; slow);
* per op: ``"attention=pallas,experts=xla"`` (ops ``attention``, ``experts``, ``indexer``, the
  indexer's scores at prefill, ``sinkhorn``, mHC's Sinkhorn rounds, and ``dense``, the dense FP8
  linears where ``dense_kernel`` asks for the kernel; unnamed ops: auto).

The indexer's top-k has no Pallas kernel: it is always the ``pallas_kernels.topk`` op, on the XLA path
under ``"xla"`` and on the registry's automatic choice otherwise (the XLA path on CPU and GPU, a kernel
registered for the platform such as a CANN operator on ``npu``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
KERNEL_MODES = ("auto", "xla", "ops", "pallas", "interpret")
KERNEL_OPS = ("attention", "experts", "indexer", "sinkhorn", "dense")
EXPERT_OPERAND_MODES = ("bf16", "e4m3", "e4m3-decode")
DENSE_KERNEL_MODES = ("off", "on", "decode")
ATTENTION_FP4_MODES = ("always", "decode", "never", "gather", "gather-decode")
ATTENTION_SCHEDULES = ("halves", "seesaw", "seesaw-prefill")


@dataclasses.dataclass(frozen=True)
class Numerics:
    act_dtype: str = "bfloat16"  # residual stream and activations
    fake_quant: bool = True  # simulate the deployment quantizers where the reference does
    kv_quant: bool = True  # store KV caches at deployment precision (FP8 window, FP4 compressed/index-K)
    kernels: str = "auto"  # who computes attention / routed experts (module docstring)
    # XLA's form of the mHC Sinkhorn rounds (on Hopper the Sinkhorn kernel runs them, ``kernels``
    # "sinkhorn"): unrolled instead of a while loop. On a GPU each while iteration costs a
    # device-to-host round trip for its predicate (418 per 12-layer decode step); unrolling measured
    # 48.4 -> 44.85 ms/step on the H200 slice at B=64 (benchmarks/NOTES.md). Elsewhere the loop stays:
    # unrolled rounds double the tiny model's compile time on CPU and may fuse differently (1 ulp).
    # None = unrolled exactly when JAX's default backend is a GPU.
    sinkhorn_unroll: bool | None = None
    # For the XLA form of the rounds (on a Hopper GPU the Sinkhorn kernel runs them, ``kernels``
    # "sinkhorn"): from this many rows (B * T) the unrolled rounds are cut into segments by barriers
    # (pallas_kernels/sinkhorn/xla.py says why: XLA's GPU fusion pass compiled one 19-round chain
    # slowly, 113 s for the slice's chunk-4096 prefill program against 41 s cut). None: one chain at
    # every size. Same arithmetic either way. 1 = every size, decode too: on the H200 (2026-12-05) the
    # slice's B=64 decode step with one chain per call did not finish compiling in 470 s.
    sinkhorn_segment_rows: int | None = 1
    # mHC's stream-mix dots on the bf16 stream with fn split into three bf16 parts (mhc.stream_dot):
    # exact products, fp32 accumulation, on the tensor cores instead of an fp32 GEMM at HIGHEST. None =
    # on a GPU backend only: XLA:CPU's bf16 dot gave a row other bits when the row count changed (the
    # 8-device data-parallel test, tests/test_sharding.py), and the CPU gains nothing from it.
    stream_dot_bf16: bool | None = None
    # The dense linears' bf16 results straight from the dot (f32 accumulation inside the GEMM, one
    # rounding at its end) instead of a float32 dot and a convert: at prefill on jax 0.11.2 cuBLAS wrote
    # wq_b's f32 [8192, 32768] (1.07 GB) and a separate kernel rounded it. On the H100 (2026-12-06,
    # benchmarks/bf16_out_dot_gpu.py) every linear's bf16-output dot gave the bits of the f32 dot +
    # convert at 64 and 8,192 rows, 1.12-1.74x faster at 8,192. None = on a GPU backend only (the CPU
    # keeps the f32 form it was tested with; XLA:CPU's bf16 dots are not batch-invariant, see above).
    dense_bf16_out: bool | None = None
    # The largest E8M0 byte of the routed experts' FP4 scales, when the engine has read the weights
    # (``moe.prepare_experts_for_kernel``); None = not known. At <= 128 the grouped GEMM may decode FP4
    # with its cheaper "subnormal" decoder (exact for those scales only): measured 0.752 -> 0.615 ms for
    # one [2304 x 5120] expert matrix at decode 64 x 6 on the H200 (benchmarks/NOTES.md). Same bits.
    fp4_scale_max: int | None = None
    # What the grouped GEMM kernel (Hopper only; no effect elsewhere) multiplies FP4 routed experts with
    # (``GroupedMatmulConfig.fp4_operands``): "bf16" (weights decoded to bf16, bf16 activations),
    # "e4m3" (bit-moved E4M3 weights and the activations' own FP8 values in FP8 wgmmas: fewer
    # instructions a weight, NOTES item -21; needs fake_quant, which makes those FP8 values), or
    # "e4m3-decode" (default): E4M3 in the engine's decode programs when fake_quant is on, bf16 in its
    # prefill programs (``for_program``), where the E4M3 form lost (H100, 2026-12-06: 2048-token chunk
    # 1.23 -> 1.51 ms, 32k prefill 7.8 -> 143 ms) while decode gained (64 x 6 0.573 -> 0.551 ms; the
    # 4-layer B=64 step 9.41 -> 9.17 ms). The products are the same, the partial sums round elsewhere
    # (3e-5 of the largest output apart): a token's bits depend on which program computed it, which the
    # request alone decides (its prompt is prefilled, each new token decoded), never the batch.
    expert_operands: str = "e4m3-decode"
    # The routed experts' w1 and w3 as one grouped GEMM launch on the Pallas kernel (``grouped_matmul_tiles``'s
    # ``more``: column blocks of either weight in one grid) instead of two launches on the same rows. Each
    # output is the one its own launch gives, bit for bit, so only time changes: one launch a layer fewer
    # and one ramp and tail instead of two (decode), twice the column blocks to spread over the SMs. On the
    # 4-layer H100 B=64 step (2026-12-07): 8.68 / 8.65 ms against 8.74 / 8.71 with two launches, the same
    # tokens. False: the two launches (the A/B, ``e2e_gpu.py --sections w13two`` or ``--w13-launch off``).
    expert_w13_launch: bool = True
    # Where the routed experts' SwiGLU runs on the tile-order rows (prefill: few padding rows), w1, w3 and
    # the SwiGLU times the routing weight as one kernel launch (``grouped_gemm.kernel.swiglu_tiles``): g
    # and u stay in the kernel's registers instead of going through HBM as float32 [rows, 2 x 2304]. The
    # same g and u bits, and on the H100 the same h bits as XLA's SwiGLU. Needs expert_w13_launch's
    # conditions and a config with 128 weight rows a consumer (the prefill tiles); elsewhere the w13 launch
    # and XLA's SwiGLU run. On the H100 (2026-12-07, session 32, with both pieces' wgmmas issued before one
    # wait) the gate/up half took 4.97 against 6.04 ms at 8192 x 6 and 16.17 against 17.88 at 32768 x 6,
    # about the w13 launch's own time (4.86 / 16.11; ``grouped_gemm_gpu.py --swiglu``). The 4-layer 32k
    # prefill at chunk 16384, in both orders on one machine (``e2e_gpu.py --sections pswiglu``): 87,065
    # against 86,804 tok/s with the epilogue first, 88,170 against 86,427 with it second (+1.2 % averaged
    # over the orders): less than the kernel alone saves, likely because XLA, off, fuses its SwiGLU into the
    # ops after it (untraced).
    # False: the w13 launch and XLA's SwiGLU everywhere.
    expert_swiglu_epilogue: bool = True
    # With expert_swiglu_epilogue: the launch also rounds h to bf16 and runs the activation quantizer
    # in front of w2 (``swiglu_tiles(..., out_dtype=bf16, act_block=)``, FP8 E4M3 per 32 columns), so h
    # leaves the kernel as the bf16 values w2 reads: 2 bytes a value written instead of 4, and no XLA
    # pass reading float32 h back (the 4-layer H100 32k prefill trace of session 32: 8.6 of 356 ms in
    # that pass, plus the float32 writes). The same bits as the XLA quantizer (CPU interpreter test;
    # its arithmetic is exact or correctly rounded on both sides, ``grouped_gemm/act_quant.py``). Needs
    # 64-row tiles or larger and 32-column blocks (V4.1), and one pipeline stage fewer where the staged
    # rows would not fit beside eight (``swiglu_config``). On the H100 (session 34, 8192 x 6,
    # ``grouped_gemm_gpu.py --swiglu``): the same bits as the float32 epilogue + XLA's quantizer, 5.50
    # against 5.65 ms for h as w2 reads it (0.973x; the extra epilogue work and the lost stage take back
    # most of the ~0.55 ms XLA pass); with the staged tile swizzled (session 35, another H100) 5.82 against
    # 5.86 ms at 8192 x 6 and 17.48 against 18.56 at 32768 x 6. End to end (session 35, 4-layer H100, 32k
    # prompt, chunk 16384, ``e2e_gpu.py --sections ceil,prefill,pswigluq``): 98,918 against 97,947 tok/s
    # (+1.0 %), so on (NOTES item -35(b)).
    expert_swiglu_quant: bool = True
    # A decode step's index scores on the Pallas op's decode kernel (``pallas_kernels/indexer/decode.py``:
    # keys on the wgmma M side, one query a batch row) instead of XLA's dot into float32 [B, H, S] and
    # the fusion that reads it back (2 x 33 MB at B = 64, 4k, an indexer layer). Other rounding than XLA's
    # head sum (still one fixed order a row: batch-invariant), so decode bits change with it on a GPU (the
    # CPU never runs it). Built in session 34; in session 35 on an H100 (``indexer_gpu.py --decode``) the
    # kernel's checks passed (reference within 2.6e-7, a row's bits alone and in the batch, -inf where
    # unseen), and the 4-layer B=64 4k step took 8.68 / 8.70 ms with it against 8.77 / 8.75 without, in
    # both orders (``e2e_gpu.py --sections ceil,decode,decidx [--decode-index-kernel on]``), so on
    # (NOTES item -35(c)). Alone, at 4,352 keys (a multiple of 256, as the model's caches are), 28.6
    # against XLA's 50.9 us (session 36; session 35's 84 us was at 4,160 keys, padded inside the timing).
    decode_index_kernel: bool = True
    # Key tiles a CTA of that kernel scores (``DecodeIndexConfig.tiles``): 1 = the form timed above; 2-4 =
    # session 35's streamed form (a producer warpgroup and two consumers, q loaded once a CTA), the same
    # bits. On an H100 (session 36, ``benchmarks/indexer_gpu.py --decode``) no faster: 28.6 / 29.1 us
    # (4x256x2 / 4x128x3) against 28.6 at 4,352 keys, so 1. The FP4 form below has the one-tile shape.
    decode_index_tiles: int = 1
    # With the decode kernel on and a quantized index cache: the kernel's FP4 form
    # (``pallas_kernels/indexer/decode_fp4.py``) reads the cache as stored (packed E2M1 + E8M0 scales,
    # 68 B a key) and decodes each tile in shared memory, instead of an XLA pass per indexer layer that
    # writes the bf16 keys (256 B a key) the bf16 kernel then reads. The same exact products summed in a
    # permuted column order (the H100 gave the bf16 kernel's bits on the benchmark's inputs); batch-
    # invariant. Session 36 on an H100 (``benchmarks/indexer_gpu.py --decode``, B = 64, 32 heads): 26.3
    # against 120.7 us for XLA's decode + the bf16 kernel at 4,352 entries (a ratio-1 layer at 4k), 17.3
    # against 63.7 at 2,304 (ratio 2); checks pass (reference, a row alone = in the batch, -inf where
    # unseen), so on. The step's A/B (``e2e_gpu.py --sections ceil,decode,decfp4``) did not fit that call.
    decode_index_fp4: bool = True
    # The Mosaic GPU kernels of a step (the grouped GEMM for the routed experts and the dense FP8 linears,
    # the attention kernel, the Sinkhorn kernel) under programmatic dependent launch (``pdl`` in their
    # configs, ``pallas_kernels.mosaic.wait_for_prior_grids``): the driver may start each while the kernel
    # before it drains. 8 of a decode layer's ~90 launches are these kernels.
    # XLA's own kernels already launch so (``xla_gpu_enable_pdl`` is on by default in jax 0.11.2's XLA,
    # checked in a deviceless compile's debug options); Mosaic GPU kernels do only when they wait on
    # ``griddepcontrol.wait``. Same bits. Off: on the 4-layer H100 B=64 step (2026-12-07) 8.64 / 8.79 ms
    # against 8.68 / 8.65 without, no gain beyond the noise (``e2e_gpu.py --sections pdl``).
    kernel_pdl: bool = False
    # Whether the dense FP8 linears (attention's projections, the indexer's query, the shared expert:
    # the 2-D FP8 weights outside the routed experts) run on the grouped GEMM kernel with a static
    # K split (``pallas_kernels.grouped_gemm.dense``), reading the stored FP8 bytes instead of XLA's
    # bf16 copies: "off" (XLA's dots everywhere), "on", or "decode" (the engine's decode programs only:
    # at decode these GEMMs are bound by their weight reads, at prefill by their FLOPs, where XLA's
    # dots stay). Needs weights held by ``linear.prepare_dense_fp8`` and the kernel where the program
    # runs (``kernels`` op "dense"); anything else keeps XLA's dots, with the same bits as "off". The
    # engine prepares the weights on a single device only: on a mesh the linears keep XLA's dots (as the
    # routed experts keep their local XLA path there).
    # The kernel sums in another order than XLA's dot (the products are the same), so a token's bits
    # depend on the program kind, as with ``expert_operands``, never on the batch.
    # Default "decode" with the three linears below: the 12-layer H200 B=64 4k step took 16.89 ms
    # against 17.08 with XLA's dots everywhere, in one run (2026-12-06, session 28), and holds 1.15 GB
    # less (no bf16 copies of those linears); every linear on the kernel had not paid (session 25).
    dense_kernel: str = "decode"
    # Which of them the engine holds for the kernel when ``dense_kernel`` is not "off": None = every one
    # the kernel can take, else a tuple of ``dense_fp8.DENSE_LINEARS`` names; the rest stay XLA's bf16
    # dots. A load-time choice (``dense_fp8.prepare_dense_fp8``). The default names the ones the kernel
    # beat XLA on in session 25's H100 benchmark of 64-row GEMMs.
    dense_kernel_linears: tuple[str, ...] | None = ("wo_a", "wo_b", "shared.w13")
    # Which form of V4.1's FP4 compressed cache the attention kernel reads (the Mosaic GPU kernel route
    # only: the XLA and model routes gather and decode the selected rows either way): "always" (the FP4
    # variant, ``sparse_sink_attention_fp4``: the selected rows as stored, dequantized by the kernel's
    # consumers), "decode" (the FP4 variant in the engine's decode programs; its prefill programs, by
    # ``for_program``, decode the whole compressed cache to bf16 once a layer-chunk, a few MB, and run the
    # bf16 kernel, whose consumers skip the dequant that an in-kernel profile put at ~30 % of a CTA's time,
    # benchmarks/NOTES.md item -26) or "never". The FP4 variant sums a row's columns in another order, so
    # a token's bits depend on the program kind, which the request alone decides, never on the batch.
    # Model calls outside the engine's programs read "decode" as "always". On the H100 (2026-12-06) a
    # 1,024-query prefill call took 403 us this way (with a 640-row split) against 991 us for the FP4
    # variant (pallas_kernels/attention/README.md), so "decode" is the default.
    # "gather": XLA gathers each query's selected rows and decodes them to bf16 ([B, T*K, D]), and the
    # bf16 kernel reads those: the same rows in the same order as "never", so the same bits, without
    # decoding the whole cache (a decode step's form: ~33 MB at B=64, against the FP4 variant's ~29 us of
    # XLA work a call around its kernel, session 26); "gather-decode": "gather" in decode programs and
    # "never" in prefill ones (outside the engine's programs it reads as "always", as "decode" does).
    # Timed on the 12-layer H200 B=64 step (session 28): "gather-decode" 18.03 ms against "decode" 17.09,
    # so "decode" stays the default (benchmarks/NOTES.md item -28).
    attention_fp4_rows: str = "decode"
    # The attention kernel's ``SparseAttentionConfig.split_rows`` (selected rows a CTA reduces; more rows
    # go to more CTAs, merged in a fixed order): a static choice, so rows stay batch-invariant. In the
    # engine's prefill programs ``attention_prefill_split_rows`` when it is set (0: the same). Decode
    # keeps 320 (two CTAs a query fill the GPU at B = 64); prefill has CTAs to spare and takes one split a
    # query of V4.1's 640 rows: half the CTAs' fixed work, no float32 partials to merge.
    attention_split_rows: int = 320
    attention_prefill_split_rows: int = 640
    # The bf16 attention kernel's ``SparseAttentionConfig.schedule`` (the FP4 variant has "halves" only):
    # "halves" (every block through both consumer warpgroups), "seesaw" (blocks in pairs, one consumer a
    # block for q.k; other roundings, still batch-invariant; needs the split a multiple of 128) or
    # "seesaw-prefill" ("seesaw" in the engine's prefill programs, "halves" in decode ones and outside
    # the engine's programs). On the H100 (session 34): a 1,024-query prefill call at split 640 428 us
    # against 605 (0.71x); the 4-layer 32k prefill at chunk 16384 94,260 against 91,592 tok/s (+2.9 %,
    # ``e2e_gpu.py --sections pattn --pattn seesaw``; NOTES item -34). Decode stays "halves": its split
    # 320 is 5 blocks, and its cache is read by the FP4 variant.
    attention_schedule: str = "seesaw-prefill"
    # Each expert GEMM's result (the routed experts' w1, w3 and w2, the shared expert's) rounded to the
    # activation dtype, as the reference writes it: its ``fp4_gemm`` / ``fp8_gemm`` (``kernel.py``) allocate
    # their output in the default dtype, bf16, from the float32 accumulator; ``Expert.forward`` widens
    # g and u again (``.float()``) for the SwiGLU, and ``MoE.forward`` sums the bf16 outputs into a float32
    # y. (The spec's "fp32 results" for g and u reads that ``.float()``; its precision map has the FP8
    # linears' "BF16 out".) True: keep the three results in float32, finer than the reference (the model
    # before session 37). float32 activations (``exact``) keep float32 either way.
    expert_outputs_f32: bool = False

    @classmethod
    def reference(cls, kv_quant: bool = True) -> "Numerics":
        return cls("bfloat16", True, kv_quant)

    @classmethod
    def exact(cls) -> "Numerics":
        return cls("float32", False, False)

    @classmethod
    def fast(cls, kv_quant: bool = True) -> "Numerics":
        return cls("bfloat16", True, kv_quant, "ops")

    @classmethod
    def named(cls, name: str) -> "Numerics":
        """``reference``, ``reference-bf16-kv``, ``fast``, ``fast-bf16-kv`` or ``exact``."""
        table = {"reference": cls.reference(), "reference-bf16-kv": cls.reference(kv_quant=False),
                 "fast": cls.fast(), "fast-bf16-kv": cls.fast(kv_quant=False), "exact": cls.exact()}
        if name not in table:
            raise ValueError(f"unknown numerics {name!r}; known: {sorted(table)}")
        return table[name]

    def __post_init__(self):
        if self.kv_quant and not self.fake_quant:
            # Storing quantized KV without the matching fake-quant would change results silently.
            raise ValueError("Numerics(kv_quant=True) needs fake_quant=True")
        self.kernel_mode("attention")  # validates the text
        if self.expert_operands not in EXPERT_OPERAND_MODES:
            raise ValueError(f"Numerics.expert_operands={self.expert_operands!r}; known: {EXPERT_OPERAND_MODES}")
        if self.expert_operands == "e4m3" and not self.fake_quant:
            raise ValueError("Numerics(expert_operands='e4m3') needs fake_quant=True: the E4M3 form takes the "
                             "activations' FP8 values, which only the quantizer makes")
        if self.dense_kernel not in DENSE_KERNEL_MODES:
            raise ValueError(f"Numerics.dense_kernel={self.dense_kernel!r}; known: {DENSE_KERNEL_MODES}")
        if self.dense_kernel_linears is not None:
            from deepinfer_jax.model.dense_fp8 import check_linear_names

            if not isinstance(self.dense_kernel_linears, tuple):
                raise ValueError(f"Numerics.dense_kernel_linears must be a tuple of names or None, got "
                                 f"{self.dense_kernel_linears!r}")
            check_linear_names(self.dense_kernel_linears)
        if self.attention_fp4_rows not in ATTENTION_FP4_MODES:
            raise ValueError(f"Numerics.attention_fp4_rows={self.attention_fp4_rows!r}; known: {ATTENTION_FP4_MODES}")
        if self.attention_schedule not in ATTENTION_SCHEDULES:
            raise ValueError(f"Numerics.attention_schedule={self.attention_schedule!r}; known: {ATTENTION_SCHEDULES}")
        seesaw_splits = {"halves": (), "seesaw": ("attention_split_rows", "attention_prefill_split_rows"),
                         "seesaw-prefill": ("attention_prefill_split_rows" if self.attention_prefill_split_rows
                                            else "attention_split_rows",)}[self.attention_schedule]
        for name in seesaw_splits:
            if getattr(self, name) % 128:
                raise ValueError(f"Numerics.attention_schedule={self.attention_schedule!r} takes 64-row blocks in "
                                 f"pairs: Numerics.{name}={getattr(self, name)} must be a multiple of 128")
        for name in ("attention_split_rows", "attention_prefill_split_rows"):
            rows = getattr(self, name)
            if rows < 0 or rows % 64 or (rows == 0 and name == "attention_split_rows"):
                raise ValueError(f"Numerics.{name}={rows} must be a positive multiple of 64 (the kernel's block)"
                                 + (" or 0 (the decode split)" if name == "attention_prefill_split_rows" else ""))

    def for_program(self, kind: str) -> "Numerics":
        """These numerics as a ``kind`` ("prefill" or "decode") program of the engine runs them:
        ``expert_operands="e4m3-decode"`` becomes "e4m3" in decode programs (with fake_quant on) and
        "bf16" otherwise; ``dense_kernel="decode"`` becomes "on" in decode programs, "off" otherwise;
        ``attention_fp4_rows="decode"`` becomes "always" in decode programs, "never" otherwise (and
        "gather-decode" "gather" and "never"); prefill
        programs take ``attention_prefill_split_rows`` as their split when it is set;
        ``attention_schedule="seesaw-prefill"`` becomes "seesaw" in prefill programs, "halves" otherwise."""
        if kind not in ("prefill", "decode"):
            raise ValueError(f"program kind {kind!r} must be 'prefill' or 'decode'")
        out = self
        if self.expert_operands == "e4m3-decode":
            e4m3 = kind == "decode" and self.fake_quant
            out = dataclasses.replace(out, expert_operands="e4m3" if e4m3 else "bf16")
        if self.dense_kernel == "decode":
            out = dataclasses.replace(out, dense_kernel="on" if kind == "decode" else "off")
        if self.attention_fp4_rows in ("decode", "gather-decode"):
            form = "always" if self.attention_fp4_rows == "decode" else "gather"
            out = dataclasses.replace(out, attention_fp4_rows=form if kind == "decode" else "never")
        if kind == "prefill" and self.attention_prefill_split_rows:
            out = dataclasses.replace(out, attention_split_rows=self.attention_prefill_split_rows)
        if self.attention_schedule == "seesaw-prefill":
            out = dataclasses.replace(out, attention_schedule="seesaw" if kind == "prefill" else "halves")
        return out

    def kernel_attention_schedule(self) -> str:
        """The bf16 attention kernel's schedule here ("seesaw-prefill" outside a prefill program: "halves")."""
        return "seesaw" if self.attention_schedule == "seesaw" else "halves"

    def unroll_sinkhorn(self) -> bool:
        """``sinkhorn_unroll`` resolved: None means unrolled on a GPU backend only."""
        if self.sinkhorn_unroll is None:
            return jax.default_backend() == "gpu"
        return self.sinkhorn_unroll

    def bf16_out_dense(self) -> bool:
        """``dense_bf16_out`` resolved: None means on a GPU backend only."""
        if self.dense_bf16_out is None:
            return jax.default_backend() == "gpu"
        return self.dense_bf16_out

    def bf16_stream_dot(self) -> bool:
        """``stream_dot_bf16`` resolved: None means on a GPU backend only."""
        if self.stream_dot_bf16 is None:
            return jax.default_backend() == "gpu"
        return self.stream_dot_bf16

    def kernel_mode(self, op: str) -> str:
        """The mode (``KERNEL_MODES``) that ``kernels`` names for op (``attention`` or ``experts``)."""
        if op not in KERNEL_OPS:
            raise ValueError(f"unknown kernel op {op!r}; known: {KERNEL_OPS}")
        default, per_op = "auto", {}
        for part in filter(None, (x.strip() for x in self.kernels.split(","))):
            name, eq, mode = (x.strip() for x in part.partition("="))
            if not eq:
                name, mode = None, name
            if mode not in KERNEL_MODES:
                raise ValueError(f"Numerics.kernels={self.kernels!r}: unknown mode {mode!r}; known: {KERNEL_MODES}")
            if name is None:
                default = mode
            elif name in KERNEL_OPS:
                per_op[name] = mode
            else:
                raise ValueError(f"Numerics.kernels={self.kernels!r}: unknown op {name!r}; known: {KERNEL_OPS}")
        return per_op.get(op, default)

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.act_dtype)

    @property
    def expert_out_dtype(self) -> jnp.dtype:
        """The dtype an expert GEMM's result is rounded to (``expert_outputs_f32``)."""
        return jnp.dtype(jnp.float32) if self.expert_outputs_f32 else self.dtype

    @property
    def precision(self) -> jax.lax.Precision:
        # fp32 tests need true fp32 products; bf16 inputs are exact in one pass anyway.
        return jax.lax.Precision.HIGHEST


def _pow2_ceil(x: jax.Array) -> jax.Array:
    """2^ceil(log2(x)) for positive normal fp32 x, from the exponent bits (exact, no log2 rounding)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    exp = exp + (mant != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(exp << 23, jnp.float32)


def fp8_scale(amax: jax.Array) -> jax.Array:
    """Power-of-two FP8 scale 2^ceil(log2(amax / 448)), amax floored at 1e-4 (the reference's rule)."""
    return _pow2_ceil(jnp.maximum(amax, 1e-4) * (1.0 / FP8_MAX))


def fp4_pow2_scale(amax: jax.Array) -> jax.Array:
    """Power-of-two (E8M0) FP4 scale 2^ceil(log2(amax / 6)), amax floored at 6 * 2^-126."""
    return _pow2_ceil(jnp.maximum(amax, FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))


def round_to_bf16(x: jax.Array) -> jax.Array:
    """float32 -> float32 on the bf16 grid (nearest, ties to even): a cast to bf16 and back, in the form
    XLA:GPU keeps (``round_to_e4m3`` says why). bf16 has fp32's exponent bits, so ``reduce_precision``
    with 8 of them is bitwise the cast pair, subnormals included."""
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def round_to_e4m3(x: jax.Array) -> jax.Array:
    """float32 -> float32 on the FP8-E4M3FN grid, nearest with ties to even: a cast to
    ``float8_e4m3fn`` and back, for |x| <= 448 (callers clip first).

    The codes pass through an identity XLA does not see through (0x7F, a NaN code, mapped to itself),
    because XLA:GPU, under its default ``--xla_allow_excess_precision``, deletes a bare float32 -> fp8 ->
    float32 pair as a no-op: the GPU program then skipped every activation rounding the reference does
    (found in the deviceless H200 compile, 2026-12-05). Until session 28 this was written as
    ``reduce_precision`` with 5 exponent bits and a ``round`` on x * 2^9 below 2^-6, with the same bits
    (tests/test_act_quant.py); that form's select and two roundings made XLA keep each decode-size
    act-quant as two kernels (block scales, then the rounding), where with the cast it fuses the block
    maxima into the rounding kernel (deviceless, a [64, 1280] act-quant + dot: 3 launches -> 2; at 8,192
    rows it still keeps two, to read x once a block)."""
    code = jax.lax.bitcast_convert_type(x.astype(jnp.float32).astype(jnp.float8_e4m3fn), jnp.uint8)
    code = jnp.where(code == 0x7F, jnp.uint8(0x7F), code)
    return jax.lax.bitcast_convert_type(code, jnp.float8_e4m3fn).astype(jnp.float32)


def round_to_e2m1(x: jax.Array) -> jax.Array:
    """float32 -> float32 on the FP4-E2M1 grid (0, 0.5, 1, 1.5, 2, 3, 4, 6), nearest with ties to even
    mantissa, for |x| <= 6: a cast to ``float4_e2m1fn`` and back, in the form XLA:GPU keeps
    (``round_to_e4m3`` says why): 1 mantissa bit from 1 up, steps of 0.5 below."""
    x = x.astype(jnp.float32)
    sub = jnp.round(x * 2.0) * 0.5
    return jnp.where(jnp.abs(x) < 1.0, sub, jax.lax.reduce_precision(x, exponent_bits=5, mantissa_bits=1))


def fp4_e4m3_scale(amax: jax.Array) -> jax.Array:
    """Ordinary E4M3 FP4 scale e4m3(max(amax, 6 * 2^-9) / 6): float32 values on the E4M3 grid. Saturates
    at 448 (amax beyond 6 * 448), where the bare cast gave NaN: the fake-quantizer and the KV codec, which
    stores this scale as E4M3, then agree there too."""
    return round_to_e4m3(jnp.minimum(jnp.maximum(amax, FP4_MAX * 2.0**-9) / FP4_MAX, FP8_MAX))


def _blocks(x: jax.Array, block: int) -> jax.Array:
    *lead, k = x.shape
    if k % block:
        raise ValueError(f"last dim {k} is not a multiple of the quantization block {block}")
    return x.reshape(*lead, k // block, block)


def block_amax(xb: jax.Array) -> jax.Array:
    """[..., n, block] -> [..., n, 1]: max |x| per block, as a halving tree of elementwise maxima over
    slices rather than a reduce. Max is exact and order-free, so the bits are a reduce's (NaN included).
    Why: XLA:GPU emits a reduce over a 32-wide minor dimension as a reduction kernel with one warp per
    block, fused with the elementwise producer and its full-size side output; the shared expert's
    swiglu + act_quant fusion of that form moved 47 MB in 0.3 ms on the H200 (0.16 TB/s; 2026-12-04
    trace). Elementwise, XLA folds the tree into a loop kernel reading each block's 32 values per
    thread (checked in the deviceless-compiled HLO)."""
    a = jnp.abs(xb)
    while a.shape[-1] > 1:
        if a.shape[-1] % 2:
            return jnp.max(a, axis=-1, keepdims=True)   # (blocks that are not powers of two: tiny configs)
        h = a.shape[-1] // 2
        a = jnp.maximum(a[..., :h], a[..., h:])
    return a


def fit_block(k: int, block: int) -> int:
    """The quantizer block used along a last axis of k values: ``block``, or one block of all k when
    k < block. The official kernels require k % block == 0 (true of every real V4.1 / V4 dimension);
    only tiny test configs have rows shorter than a block (V4's 128-wide activation blocks, its 64-wide
    KV blocks), and they quantize such a row as one block rather than refuse to run."""
    if k % block == 0:
        return block
    if k < block:
        return k
    raise ValueError(f"a last axis of {k} values is neither a multiple of the quantization block {block} "
                     "nor shorter than one block")


def fake_quant_fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """FP8-E4M3 with one power-of-two scale per ``block`` values along the last axis (amax floored at 1e-4)."""
    xb = _blocks(x.astype(jnp.float32), block)
    s = fp8_scale(block_amax(xb))
    q = round_to_e4m3(jnp.clip(xb / s, -FP8_MAX, FP8_MAX))
    return (q * s).reshape(x.shape).astype(x.dtype)


def fake_quant_fp4_pow2(x: jax.Array, block: int = 32) -> jax.Array:
    """FP4-E2M1 with a power-of-two (E8M0) scale per ``block`` values (index K and Q)."""
    xb = _blocks(x.astype(jnp.float32), block)
    s = fp4_pow2_scale(block_amax(xb))
    q = round_to_e2m1(jnp.clip(xb / s, -FP4_MAX, FP4_MAX))
    return (q * s).reshape(x.shape).astype(x.dtype)


def fake_quant_fp4_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """FP4-E2M1 with an ordinary E4M3 scale per ``block`` values (compressed main KV)."""
    xb = _blocks(x.astype(jnp.float32), block)
    s = fp4_e4m3_scale(block_amax(xb))
    q = round_to_e2m1(jnp.clip(xb / s, -FP4_MAX, FP4_MAX))
    return (q * s).reshape(x.shape).astype(x.dtype)


def kernel_route(numerics: Numerics, op: str, registry_op: str, unsupported: str | None) -> tuple[str, str | None]:
    """Where ``op`` runs under ``numerics.kernels``: ("model", None) = the model's own XLA code, or
    ("op", impl) = the ``pallas_kernels`` op with ``impl`` (None: its automatic choice;
    "pallas_mosaic_gpu"; "xla"; "interpret" = the Pallas kernel in the Mosaic GPU interpreter).

    unsupported: why the Pallas kernel cannot run this call's shape (None if it can). Decided at trace
    time from the platform, the mode and static shapes only, never from the batch contents."""
    from pallas_kernels import registry

    mode = numerics.kernel_mode(op)
    if mode == "xla":
        return "model", None
    if mode == "interpret":
        if unsupported is not None:
            raise registry.KernelUnavailableError(f"{op}: the Pallas kernel was requested but {unsupported}")
        return "op", "interpret"
    if mode == "pallas":
        registry.resolve(registry_op, impl=registry.PALLAS_MOSAIC_GPU)      # raises off Hopper CUDA
        if unsupported is not None:
            raise registry.KernelUnavailableError(f"{op}: the Pallas kernel was requested but {unsupported}")
        return "op", registry.PALLAS_MOSAIC_GPU
    kernel_here = registry.resolve(registry_op).name == registry.PALLAS_MOSAIC_GPU and unsupported is None
    if mode == "auto":
        return ("op", registry.PALLAS_MOSAIC_GPU) if kernel_here else ("model", None)
    return "op", registry.PALLAS_MOSAIC_GPU if kernel_here else registry.XLA    # "ops"


# The names the engine, the memory planner and the compare tool accept (``fast`` is a kernel-path
# experiment, reached through Numerics.named or a Numerics).
ENGINE_NUMERICS = ("exact", "reference", "reference-bf16-kv")


def as_numerics(name_or_numerics: "Numerics | str") -> Numerics:
    """A Numerics as given, or the one ENGINE_NUMERICS names; anything else is an error naming the choices."""
    if isinstance(name_or_numerics, Numerics):
        return name_or_numerics
    if name_or_numerics not in ENGINE_NUMERICS:
        raise ValueError(f"numerics must be one of {sorted(ENGINE_NUMERICS)} or a Numerics, got {name_or_numerics!r}")
    return Numerics.named(name_or_numerics)

