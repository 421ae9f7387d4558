"""Mosaic GPU (Hopper) kernel for a decode step's index scores over the index cache as stored: packed
FP4-E2M1 keys with one E8M0 scale per 32 values (``kv_codec.INDEX_K``, 68 B a 128-dim key).

Why: the bf16-key decode kernel (``decode.py``) needs the keys decoded first, an XLA pass per indexer
layer and step that reads the cache (68 B a key) and writes bf16 keys (256 B) that the kernel reads
back: at B = 64 and 4,352 entries (a ratio-1 layer at context 4k) 19 MB read, 71 MB written and 71 MB
read again, where this kernel reads the 19 MB once and launches nothing before it but q's permutation.

Layout: one CTA per (batch row, 256 keys), one warpgroup, as ``decode._build``. It copies q [H, D], the
tile's packed values [256, D/2] and its scales to shared memory, then for each 64-key chunk decodes the
values into a bf16 wgmma tile and scores it through ``decode._score_keys``. A key's D/32 = 4 scale
bytes are read as one uint32 (the wrapper's bitcast of the cache's [B, S, 4] bytes, no copy), so a
chunk's scales are one row-layout load of 64 words, and group g's byte is a shift away. (A transposed
[B, 4, S] operand made XLA keep the cache's scales transposed inside the step, with a transpose of
each index cache at the program's entry and another at its exit: deviceless H200 compile.) A packed
byte holds elements 2j and 2j+1, so the decoded tile's columns are each 32-value group's even elements
then its odd ones; the wrapper permutes q's columns the same way (``to_fp4_k_order``), which leaves
every product of the dot unchanged.

Decode: the grouped GEMM's "bits" decoder (an E2M1 nibble's bits placed in a float16, exactly the
value times 2^-14), times 2^14, times 2^(e - 127) built from the scale byte e's bits: every product
exact, so the tile holds exactly ``kv_codec.decode``'s bf16 keys (e = 0 is 2^-127 as in E8M0; e = 255,
E8M0's NaN, gives NaN).

Numerics: the same products as the bf16-key kernel, summed by the wgmma in the permuted column order,
so a score may differ from that kernel's in its last bits (both are within fp32 summation order of the
reference; on an H100 in session 36 it gave that kernel's bits). Batch-invariant: a score depends on
its query, its key and the head weights only. Timed (H100, B = 64, 32 heads): 26.3 us at 4,352 entries
against 120.7 for XLA's decode + the bf16 kernel (``benchmarks/indexer_gpu.py --decode``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.grouped_gemm.kernel import _f16_bits_to_f32, _fp4_bytes_to_f16_bits, to_fp4_k_order
from pallas_kernels.indexer.config import decode_unsupported_reason
from pallas_kernels.indexer.decode import BLOCK_KEYS, KEY_ROWS, _score_keys, write_tile
from pallas_kernels.mosaic import tiled

#: Values per E8M0 scale in the index cache (``kv_codec.INDEX_K.block``).
SCALE_GROUP = 32
#: Where float32's exponent field starts (its bias, 127, is E8M0's too, so a byte is the field as is).
_F32_EXP_SHIFT = 23


def _e8m0_to_f32(e_u8):
    """E8M0 bytes -> 2^(e - 127) as float32, exactly for every byte: e = 0 is the subnormal 2^-127,
    e = 255 (E8M0's NaN) NaN."""
    e = e_u8.astype(jnp.int32)
    bits = jnp.where(e == 0, 1 << (_F32_EXP_SHIFT - 1), jnp.where(e == 255, 0x7FC00000, e << _F32_EXP_SHIFT))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _decode_chunk(v_smem, s_smem, rows, d: int):
    """The keys ``rows`` (64) of the landed tile decoded to bf16, one [64, 32] piece a scale group, each
    in the kernel's column order (the group's even elements, then its odd ones)."""
    gb = SCALE_GROUP // 2
    words = plgpu.load(s_smem.at[rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)   # [64] uint32
    pieces = []
    for g in range(d // SCALE_GROUP):
        sc = _e8m0_to_f32((words >> (8 * g)) & 0xFF)    # byte g of the little-endian word
        q8 = plgpu.load(v_smem.at[rows, pl.ds(g * gb, gb)], layout=plgpu.Layout.WGMMA,
                        optimized=False).astype(jnp.int32)     # Mosaic does no arithmetic on 8-bit lanes
        # value * 2^-14 from the bits, * 2^14, * the scale: each product exact (a scale folded with 2^14
        # would overflow float32 for bytes above 240)
        vals = _f16_bits_to_f32(jnp.concatenate(_fp4_bytes_to_f16_bits(q8), axis=1)) * 16384.0
        pieces.append((vals * lax.broadcast_in_dim(sc, (KEY_ROWS, SCALE_GROUP), [0])).astype(jnp.bfloat16))
    return pieces


def _build(b: int, h: int, s_pad: int, d: int):
    groups = d // SCALE_GROUP
    per_tile = 64 // SCALE_GROUP       # scale groups a 64-column (128-byte swizzle) tile of the wgmma operand holds

    def body(q_ref, v_ref, s_ref, w_ref, nvis_ref, o_ref, scratch):
        (q_smem, v_smem, s_smem, k_tile, o_smem), (bar,) = scratch
        bi, si = lax.axis_index("b"), lax.axis_index("s")
        s0 = si * BLOCK_KEYS
        n_vis = nvis_ref[bi]
        active = s0 < n_vis

        @pl.when(active)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[bi], q_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, pl.ds(s0, BLOCK_KEYS)], v_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(s_ref.at[bi, pl.ds(s0, BLOCK_KEYS)], s_smem, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            w = plgpu.load(w_ref.at[bi], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)   # [H]
            for c in range(BLOCK_KEYS // KEY_ROWS):
                rows = pl.ds(c * KEY_ROWS, KEY_ROWS)
                pieces = _decode_chunk(v_smem, s_smem, rows, d)
                for t in range(groups // per_tile):
                    k_tile.at[:, pl.ds(t * 64, 64)][...] = jnp.concatenate(
                        pieces[t * per_tile:(t + 1) * per_tile], axis=1)
                plgpu.commit_smem()
                o_smem.at[rows][...] = _score_keys(k_tile, q_smem, w, s0 + c * KEY_ROWS, n_vis, h)

        write_tile(active, o_smem, o_ref.at[bi, pl.ds(s0, BLOCK_KEYS)])

    scratch = (
        (plgpu.SMEM((h, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((BLOCK_KEYS, d // 2), jnp.uint8),
         plgpu.SMEM((BLOCK_KEYS,), jnp.uint32),
         plgpu.SMEM((KEY_ROWS, d), jnp.bfloat16, transforms=tiled(128, 2)),
         plgpu.SMEM((BLOCK_KEYS,), jnp.float32)),
        (plgpu.Barrier(num_arrivals=3, num_barriers=1),),
    )

    def entry(q_ref, v_ref, s_ref, w_ref, nvis_ref, o_ref):
        pl.run_scoped(lambda *s: body(q_ref, v_ref, s_ref, w_ref, nvis_ref, o_ref, s), *scratch)

    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((b, s_pad), jnp.float32),
                        grid=(b, s_pad // BLOCK_KEYS), grid_names=("b", "s"))


@jax.jit
def index_scores_decode_fp4_pallas(q_bhd: jax.Array, values_bsc: jax.Array, scale_bsg: jax.Array, w_bh: jax.Array,
                                   n_visible_b: jax.Array | None = None) -> jax.Array:
    """q [B, H, D], the index cache's packed values uint8 [B, S, D/2] and E8M0 scales [B, S, D/32]
    (float8_e8m0fnu or their bytes), head weights [B, H] -> scores [B, S] float32:
    sum_h w[b, h] relu(q[b, h] . k[b, s]) with k the decoded keys (``kv_codec.decode``), -inf for keys
    at or past a row's n_visible. No copy of the cache when S is a multiple of 256 (the model's index
    caches are: ``cache.INDEX_ENTRY_ALIGN``)."""
    b, h, d = q_bhd.shape
    s = values_bsc.shape[1]
    if (why := decode_unsupported_reason(h, d)) is not None:
        raise ValueError(f"index_scores_decode_fp4_pallas cannot run this problem: {why}")
    if values_bsc.shape != (b, s, d // 2) or scale_bsg.shape != (b, s, d // SCALE_GROUP):
        raise ValueError(f"index_scores_decode_fp4_pallas: values {values_bsc.shape} and scales {scale_bsg.shape} "
                         f"must be [{b}, S, {d // 2}] and [{b}, S, {d // SCALE_GROUP}] for q {q_bhd.shape}")
    if values_bsc.dtype != jnp.uint8:
        raise ValueError(f"index_scores_decode_fp4_pallas: values must be packed uint8, got {values_bsc.dtype}")
    sp = -(-s // BLOCK_KEYS) * BLOCK_KEYS
    scale_u8 = scale_bsg if scale_bsg.dtype == jnp.uint8 else lax.bitcast_convert_type(scale_bsg, jnp.uint8)
    v = jnp.pad(values_bsc, ((0, 0), (0, sp - s), (0, 0)))
    words = lax.bitcast_convert_type(scale_u8, jnp.uint32)          # [B, S]: a key's 4 scale bytes
    sc = jnp.pad(words, ((0, 0), (0, sp - s)))
    nvis = jnp.full((b,), s, jnp.int32) if n_visible_b is None else jnp.minimum(n_visible_b.astype(jnp.int32), s)
    q = to_fp4_k_order(q_bhd.astype(jnp.bfloat16), SCALE_GROUP)
    out = _build(b, h, sp, d)(q, v, sc, w_bh.astype(jnp.float32), nvis)
    return out if sp == s else out[:, :s]
