"""A real-width slice of DeepSeek-V4.1-Flash for benchmarks: config, random weights made on the device in
the official stored formats, a synthetic KV cache at a given context, and the step's byte / FLOP counts.

Real V4.1-Flash does not fit one H200, so ``slice_config`` keeps every width of the official config
(hidden 5120, 64 heads of 512, 384 experts of 2304, top-6, index top-512, window 128, vocabulary 129,280)
and cuts the depth to the layer plan of the tiny checkpoint (12 layers, every V4.1 layer role) or to a
shorter plan. Engram tables are shrunk (their rows are gathered, one per head and n-gram order, so their
size changes memory, not step time).

``random_params`` builds the params pytree (docs/CONTRACTS.md) from ``expected_tensors(cfg)``, the same
tensor list the loader checks real checkpoints against: FP8-E4M3 weights with E8M0 32x32 block scales
(quantized on the device from N(0, 1/in)), packed FP4 experts (uniform E2M1 codes with an E8M0 scale
chosen for std 1/sqrt(in)), BF16 / F32 tensors initialised like ``checkpoints/make_tiny.py``.
"""

from __future__ import annotations

import copy
import json
import math
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.checkpoint.names import JNP_DTYPES, param_path
from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, expected_tensors
from deepinfer_jax.config import AttnMode, ModelConfig
from deepinfer_jax.engine.token_map import compressed_token_map
from deepinfer_jax.model import kv_codec
from deepinfer_jax.model.cache import init_cache
from deepinfer_jax.model.engram_hash import engram_primes
from deepinfer_jax.model.numerics import Numerics, fp8_scale

ROOT = Path(__file__).resolve().parents[1]
OFFICIAL_CONFIG = ROOT / "tests" / "fixtures" / "v41_flash_config.json"
TOKENIZER_DIR = ROOT / "checkpoints" / "tiny-v41"  # the official vocabulary size and special ids

# Layer plans (text_config overrides) that keep every V4.1 role: SWA, ratio-2 FULL / REUSE, ratio-1
# FULL + candidate source, REINDEX, REUSE, and Engram before a SWA and a compressed layer.
PLANS = {
    12: dict(compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4, 6],
             index_source_layer_ids=[2, 4, 6, 8, 10], candidate_source_layer_id=6, engram_layer_ids=[1, 4],
             dspark_target_layer_ids=[9, 10, 11]),
    8: dict(compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4],
            index_source_layer_ids=[2, 4, 6], candidate_source_layer_id=4, engram_layer_ids=[1],
            dspark_target_layer_ids=[5, 6, 7]),
    4: dict(compress_ratios=[0, 2, 1, 1, 0, 0, 0], kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2, 3],
            candidate_source_layer_id=2, engram_layer_ids=[0], dspark_target_layer_ids=[1, 2, 3]),
}
FP4_CODE_STD = math.sqrt(68.5 / 8)  # std of a uniformly drawn E2M1 code: mean of v^2 over the 8 magnitudes


def official_root() -> dict:
    return json.loads(OFFICIAL_CONFIG.read_text())


def slice_root(n_layers: int, *, engram_vocab_size: int = 100_000, tiny_widths: bool = False) -> dict:
    """Root config.json of the slice. tiny_widths: the tiny checkpoint's widths instead (CPU smoke runs)."""
    if n_layers not in PLANS:
        raise ValueError(f"no slice plan for {n_layers} layers; known: {sorted(PLANS)}")
    root = copy.deepcopy(official_root())
    text = root["text_config"]
    text.update(copy.deepcopy(PLANS[n_layers]), num_hidden_layers=n_layers, engram_vocab_size=engram_vocab_size)
    if tiny_widths:
        import sys

        sys.path.insert(0, str(ROOT / "checkpoints"))
        from tiny_configs import TINY_V41_TEXT

        keep = {k: text[k] for k in PLANS[n_layers]} | {"num_hidden_layers": n_layers}
        text.clear()
        text.update(copy.deepcopy(TINY_V41_TEXT), **keep, engram_vocab_size=1000)
    probe = types.SimpleNamespace(**{k: tuple(v) if isinstance(v, list) else v for k, v in text.items()})
    text["engram_num_embeddings"] = [sum(map(sum, engram_primes(probe, lid))) for lid in text["engram_layer_ids"]]
    _, n_keys = compressed_token_map(TOKENIZER_DIR / "tokenizer.json", text["vocab_size"])
    text["engram_compressed_vocab_size"] = n_keys
    return root


def slice_config(n_layers: int, **kw) -> ModelConfig:
    return ModelConfig.from_dict(slice_root(n_layers, **kw), source=f"slice-{n_layers}")


# ---- random weights in the stored formats, made on the device ----------------------------------------

def _pow2_round(x: float) -> float:
    return 2.0 ** round(math.log2(x))


def _fp8_weight(key, shape: tuple[int, int], scale_shape: tuple[int, int]):
    """N(0, 1/in) quantized to E4M3 with one power-of-two scale per block (the block covers the dims with
    the scale grid given: 32x32 weights, 1x32 Engram rows)."""
    out_dim, in_dim = shape
    rb, cb = -(-out_dim // scale_shape[0]), -(-in_dim // scale_shape[1])
    w = jax.random.normal(key, shape, jnp.float32) * (1.0 / math.sqrt(in_dim))
    pr, pc = scale_shape[0] * rb - out_dim, scale_shape[1] * cb - in_dim
    wb = jnp.pad(w, ((0, pr), (0, pc))).reshape(scale_shape[0], rb, scale_shape[1], cb)
    s = fp8_scale(jnp.max(jnp.abs(wb), axis=(1, 3)))
    q = (wb / s[:, None, :, None]).astype(jnp.float8_e4m3fn)
    q = q.reshape(scale_shape[0] * rb, scale_shape[1] * cb)[:out_dim, :in_dim]
    return q, s.astype(jnp.float8_e8m0fnu)


def _fp4_weight(key, shape: tuple[int, ...], scale_shape: tuple[int, ...]):
    """Uniform packed E2M1 codes [..., out, in/2] and a constant E8M0 scale giving std ~ 1/sqrt(in)."""
    in_dim = shape[-1] * 2
    s = _pow2_round(1.0 / (FP4_CODE_STD * math.sqrt(in_dim)))
    return jax.random.bits(key, shape, jnp.uint8), jnp.full(scale_shape, s, jnp.float32).astype(jnp.float8_e8m0fnu)


def _plain_kind(name: str, dtype: str, shape: tuple[int, ...]) -> str:
    """How ``_plain`` initialises a BF16 / F32 tensor, as checkpoints/make_tiny.py does (see its
    _f32_init / _bf16_init)."""
    if dtype == "F32":
        if name.endswith("_fn"):
            return "normal/50"
        if name.endswith(("gate.bias", "gate.bias_vl")):
            return "normal/10"
        return "normal"
    if len(shape) == 1 or name.endswith(("engram.q_weight", "engram.k_weight")):
        return "1+normal/10"
    if name == "embed.weight":
        return "normal"
    return "fan_in"


def _plain(key, kind: str, dtype: str, shape: tuple[int, ...]):
    """A BF16 / F32 tensor initialised by ``_plain_kind``'s rule. Jitted on (kind, dtype, shape) rather
    than the tensor's name: the 12-layer slice has 194 such tensors but 15 shapes, and a compile per
    name made most of the slice's 81-135 s build on the H200 (2026-12-04)."""
    v = jax.random.normal(key, shape, jnp.float32)
    v = {"normal/50": lambda: 0.02 * v, "normal/10": lambda: 0.1 * v, "normal": lambda: v,
         "1+normal/10": lambda: 1.0 + 0.1 * v, "fan_in": lambda: v * (1.0 / math.sqrt(shape[-1]))}[kind]()
    return v if dtype == "F32" else v.astype(jnp.bfloat16)


def _leaf_table(specs: dict) -> tuple[dict[tuple, tuple[str, str, tuple]], dict[tuple, int]]:
    """The params leaves the checkpoint tensors ``specs`` make: path -> (a tensor name, stored dtype,
    per-expert shape), and path -> expert count for the stacked routed experts (one leaf per layer and
    w1/w2/w3, [E, ...])."""
    leaves: dict[tuple, tuple[str, str, tuple]] = {}
    counts: dict[tuple, int] = {}
    for name, sp in specs.items():
        path, expert = param_path(name)
        if expert is not None:
            counts[path] = max(counts.get(path, 0), expert + 1)
        leaves.setdefault(path, (name, sp.dtype, tuple(sp.shape)))
    return leaves, counts


def random_params(cfg: ModelConfig, seed: int = 0, progress=None) -> dict:
    """The backbone params pytree of ``cfg`` with random weights in the stored dtypes, on the default device."""
    specs = {n: s for n, s in expected_tensors(cfg).items() if s.group == BACKBONE}
    leaves, counts = _leaf_table(specs)
    made: dict[tuple, jax.Array] = {}
    key = jax.random.key(seed)
    jit_fp8 = jax.jit(_fp8_weight, static_argnums=(1, 2))
    jit_fp4 = jax.jit(_fp4_weight, static_argnums=(1, 2))
    jit_plain = jax.jit(_plain, static_argnums=(1, 2, 3))
    for i, (path, (name, dtype, shape)) in enumerate(sorted(leaves.items(), key=lambda kv: str(kv[0]))):
        if path[-1] == "scale":
            continue  # made with its weight
        k = jax.random.fold_in(key, i)
        full_shape = (counts[path], *shape) if path in counts else shape
        scale_path = path[:-1] + ("scale",)
        if dtype == "F8_E4M3":
            sname = name.removesuffix(".weight") + ".scale"
            sshape = tuple(specs[sname].shape)
            if path in counts:
                raise NotImplementedError("FP8 routed experts (V4.1 stores them as FP4)")
            made[path], made[scale_path] = jit_fp8(k, shape, sshape)
        elif dtype == "I8":
            sname = name.removesuffix(".weight") + ".scale"
            sshape = tuple(specs[sname].shape)
            sfull = (counts[path], *sshape) if path in counts else sshape
            made[path], made[scale_path] = jit_fp4(k, full_shape, sfull)
        elif dtype in ("BF16", "F32"):
            made[path] = jit_plain(k, _plain_kind(".".join(map(str, path)), dtype, full_shape), dtype, full_shape)
        else:
            raise NotImplementedError(f"no random initialiser for {name} ({dtype})")
        for leaf in (made[path], made.get(scale_path)):
            if leaf is not None:
                jax.block_until_ready(leaf)  # one leaf at a time: keeps the temporaries small
        if progress:
            progress(path)
    for path, arr in made.items():  # the stored dtypes, exactly what the loader would place
        name = leaves[path][0]
        want = JNP_DTYPES[leaves[path][1]]
        if arr.dtype != want:
            raise AssertionError(f"{name}: made {arr.dtype}, the checkpoint stores {want}")
    tree: dict = {}
    for path, arr in made.items():
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = arr
    tree["layers"] = tuple(tree["layers"][i] for i in range(cfg.num_hidden_layers))
    return tree


def tree_bytes(tree) -> int:
    """Bytes of a tree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# ---- a cache as it stands after `context` tokens --------------------------------------------------------

def synthetic_cache(cfg: ModelConfig, batch: int, max_len: int, context: int, numerics: Numerics, seed: int = 1):
    """The cache of ``batch`` slots that have each seen ``context`` tokens: random stored KV / index-K values
    (every code valid), window rings holding positions [context - W, context). The next token is at
    position ``context``. Values are random, so attention and selection do their full work."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, batch, max_len, numerics))
    key = jax.random.key(seed)
    leaves, tree = jax.tree.flatten_with_path(shapes)
    out = []
    w = cfg.sliding_window
    ring_pos = np.arange(context - w, context)
    ring = np.full((w,), -1, np.int32)
    ring[ring_pos[ring_pos >= 0] % w] = ring_pos[ring_pos >= 0]

    def fill(k, path, sd):
        name = jax.tree_util.keystr(path)
        if name.endswith("['pos']"):
            return jnp.broadcast_to(jnp.asarray(ring), sd.shape)
        if sd.dtype == jnp.uint8:
            return jax.random.bits(k, sd.shape, jnp.uint8)
        if sd.dtype == jnp.float8_e8m0fnu:
            return jnp.full(sd.shape, 2.0 ** -4, jnp.float32).astype(sd.dtype)
        if sd.dtype == jnp.float8_e4m3fn:
            return (jax.random.normal(k, sd.shape, jnp.float32) * (0.1 if "scale" in name else 4.0)).astype(sd.dtype)
        if sd.dtype == jnp.float32:
            return jnp.zeros(sd.shape, sd.dtype)  # the ratio-2 pending half-pair
        return (jax.random.normal(k, sd.shape, jnp.float32) * 0.5).astype(sd.dtype)

    for i, (path, sd) in enumerate(leaves):
        out.append(jax.jit(fill, static_argnums=(1, 2))(jax.random.fold_in(key, i), path, sd))
    return jax.tree.unflatten(tree, out)


# ---- what one step must move and compute ----------------------------------------------------------------

def _entry_bytes(layout, dim: int, kv_quant: bool) -> int:
    """Bytes of one cache entry as the codec stores it (kv_codec: 528 / 288 / 68 B for V4.1 quantized)."""
    shapes = kv_codec.stored_shapes(layout, (), dim, kv_quant, jnp.bfloat16)
    return sum(math.prod(sd.shape) * sd.dtype.itemsize for sd in shapes.values())


def expected_active_experts(n_experts: int, picks: int) -> float:
    """Expected distinct experts after ``picks`` independent uniform choices (random routing)."""
    return n_experts * (1.0 - (1.0 - 1.0 / n_experts) ** picks)


def decode_bytes(cfg: ModelConfig, params, batch: int, context: int, kv_quant: bool = True,
                 active_experts=None) -> dict:
    """The fewest bytes one decode step must read: each layer's non-expert weights, the experts the step
    routes to (``active_experts[i]`` distinct ones in layer i when given, else the expected number under
    uniform routing), the head, and per slot the KV rows attention
    reads (window ring + top-k compressed rows) and the index-K rows the indexers score. Writes are small
    and left out. params: arrays or ShapeDtypeStructs in the checkpoint's formats (the engine's load-time
    bf16 copies of dense FP8 weights are a speed choice, not bytes the step must read)."""
    weights = 0
    experts = 0.0
    uniform = expected_active_experts(cfg.n_routed_experts, batch * cfg.num_experts_per_tok)
    for i, layer in enumerate(params["layers"]):
        ex = layer["ffn"]["experts"]
        per_expert = tree_bytes(ex) / cfg.n_routed_experts
        weights += tree_bytes(layer) - tree_bytes(ex)
        if "engram" in layer:
            weights -= tree_bytes(layer["engram"]["embed"])  # rows gathered, counted below
        experts += per_expert * (uniform if active_experts is None else active_experts[i])
    weights += tree_bytes((params["head"]["weight"], params["norm"]["weight"]))
    lay = kv_codec.layouts(cfg)
    row_win = _entry_bytes(lay.window, cfg.head_dim, kv_quant)
    row_kv = _entry_bytes(lay.compressed, cfg.head_dim, kv_quant)
    row_ik = _entry_bytes(lay.index_k, cfg.index_head_dim, kv_quant)
    kv = 0
    for lid in range(cfg.num_hidden_layers):
        plan = cfg.layer_plan(lid)
        kv += min(context, cfg.sliding_window) * row_win
        if plan.mode is AttnMode.SWA:
            continue
        r = cfg.compress_ratios[plan.kv_source]
        visible = context // r
        kv += min(cfg.index_topk, visible) * row_kv
        if plan.mode is AttnMode.FULL:
            kv += visible * row_ik
        elif plan.mode is AttnMode.REINDEX:
            kv += min(visible, cfg.candidate_topk_blocks * cfg.candidate_block_size) * row_ik
    engram = len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * (cfg.engram_head_dim + 1)
    return {"weights": weights, "experts": experts, "kv": batch * kv, "engram": batch * engram,
            "total": weights + experts + batch * (kv + engram)}


def matmul_macs_per_token(cfg: ModelConfig, params) -> float:
    """Multiply-accumulates per token in the linears: every 2-D weight once (projections, compressors,
    indexers, router, shared expert, Engram projections, the head), the routed experts top-k / E times.
    2x this is a step's matmul FLOPs per token; attention scores and the indexer's dots come on top.
    params: the stored layout (arrays or ShapeDtypeStructs); load-time forms that rename leaves (the dense
    kernel's "kernel_fp8") are refused, since their linears would go uncounted."""
    renamed = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(params)[0]
               if "kernel_fp8" in jax.tree_util.keystr(p)]
    if renamed:
        raise ValueError(f"matmul_macs_per_token counts the stored layout; {renamed[0]} (and "
                         f"{len(renamed) - 1} more) is a load-time form: pass the stored ShapeDtypeStructs")
    def weights_2d(tree):
        return sum(math.prod(x.shape[-2:]) * (2 if x.dtype == jnp.uint8 else 1)
                   for path, x in jax.tree.flatten_with_path(tree)[0]
                   if x.ndim == 2 and jax.tree_util.keystr(path).endswith("['weight']"))
    macs = float(params["head"]["weight"].size)
    for layer in params["layers"]:
        rest = {k: v for k, v in layer.items() if k not in ("ffn", "engram")}
        macs += weights_2d(rest) + weights_2d({k: v for k, v in layer["ffn"].items() if k != "experts"})
        if "engram" in layer:
            macs += weights_2d({k: v for k, v in layer["engram"].items() if k != "embed"})
        w = layer["ffn"]["experts"]
        held = [w[n].get("weight", w[n].get("weight_tm")) for n in ("w1", "w2", "w3")]   # either layout
        per_expert = sum(math.prod(a.shape[1:]) * (2 if a.dtype == jnp.uint8 else 1)
                         for a in held)  # packed FP4: two values a byte
        macs += cfg.num_experts_per_tok * per_expert
    return macs


# ---- a V4-Flash slice with unquantized weights: the transformers peer (peer_transformers.py) ----------

V4FLASH_CONFIG = ROOT / "tests" / "fixtures" / "v4_flash_config.json"


def v4flash_slice_root(n_layers: int, *, num_hash_layers: int = 0, tiny_widths: bool = False) -> dict:
    """config.json of a V4-Flash slice in the official flat layout (transformers' ``DeepseekV4Config``
    reads it too). Every width of V4-Flash (hidden 4096, 64 heads of 512, 256 experts of 2048, top-6,
    index top-512, window 128, vocabulary 129,280); ``n_layers`` alternate ratio 4 (CSA: compressor and
    lightning indexer) and ratio 128 (HCA), the pair that layers 2-41 of the real model repeat. The two
    window-only bottom layers (2 of 43) are left out, and routing is learned unless ``num_hash_layers``
    says otherwise (40 of the 43 real layers). tiny_widths: the tests' tiny V4-Flash widths (CPU runs)."""
    if tiny_widths:
        import sys

        sys.path.insert(0, str(ROOT / "checkpoints"))
        from tiny_configs import TINY_V4FLASH

        root = copy.deepcopy(TINY_V4FLASH)
    else:
        root = json.loads(V4FLASH_CONFIG.read_text())
    ratios = [(4, 128)[i % 2] for i in range(n_layers)]
    root.update(num_hidden_layers=n_layers, num_hash_layers=num_hash_layers,
                compress_ratios=ratios + [0] * root["num_nextn_predict_layers"])
    return root


def _float_linear(key, shape: tuple[int, ...]):
    """N(0, 1/in) in bf16 for a linear [..., out, in] the checkpoint stores as FP8 or packed FP4."""
    return (jax.random.normal(key, shape, jnp.float32) * (1.0 / math.sqrt(shape[-1]))).astype(jnp.bfloat16)


def _hash_table(key, shape: tuple[int, int], n_experts: int):
    """tid2eid [vocab, k]: k distinct experts per token id (the first k of a random order)."""
    return jnp.argsort(jax.random.uniform(key, (shape[0], n_experts)), axis=-1)[:, :shape[1]].astype(jnp.int32)


def v4flash_float_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """The backbone params pytree of a V4-Flash ``cfg`` with unquantized weights, on the default device.

    The checkpoint's FP8 linears and packed FP4 experts are bf16 [out, in] with no scales (what
    ``transformers_format`` loads from a bf16 re-upload, run by ``linear.weight_of`` as stored), drawn
    N(0, 1/in); BF16 / F32 tensors are drawn as ``random_params`` draws them, and the F32 ones are rounded
    to bf16 values, so that a peer keeping any tensor in bf16 or fp32 holds exactly the same numbers."""
    from deepinfer_jax.checkpoint.loader import _set, _tuples

    if cfg.variant != "v4":
        raise ValueError(f"v4flash_float_params builds V4-Flash params, not {cfg.variant}")
    specs = {n: s for n, s in expected_tensors(cfg).items() if s.group == BACKBONE and s.dtype != "F8_E8M0"}
    leaves, counts = _leaf_table(specs)
    key = jax.random.key(seed)
    jit_linear = jax.jit(_float_linear, static_argnums=1)
    # _plain is run eagerly here (its ops are cached per shape)
    jit_hash = jax.jit(_hash_table, static_argnums=(1, 2))
    tree: dict = {}
    for i, (path, (_, dtype, shape)) in enumerate(sorted(leaves.items(), key=lambda kv: str(kv[0]))):
        k = jax.random.fold_in(key, i)
        if dtype == "I8":  # packed FP4 holds two values a byte; unpacked it is [out, in]
            shape = (*shape[:-1], 2 * shape[-1])
        full_shape = (counts[path], *shape) if path in counts else shape
        if dtype in ("F8_E4M3", "I8"):
            leaf = jit_linear(k, full_shape)
        elif dtype == "BF16":
            leaf = _plain(k, _plain_kind(".".join(map(str, path)), dtype, full_shape), dtype, full_shape)
        elif dtype == "F32":
            leaf = _plain(k, _plain_kind(".".join(map(str, path)), dtype, full_shape), dtype, full_shape)
            leaf = leaf.astype(jnp.bfloat16).astype(jnp.float32)
        elif dtype == "I64":
            leaf = jit_hash(k, full_shape, cfg.n_routed_experts)
        else:
            raise NotImplementedError(f"no float initialiser for {path} ({dtype})")
        jax.block_until_ready(leaf)  # one leaf at a time: keeps the temporaries small
        _set(tree, path, leaf)
    return _tuples(tree)  # the loader's nesting: layers as a tuple
