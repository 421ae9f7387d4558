"""V4-Flash's MTP layer (spec §3.6) against the float64 numpy reference written from the spec
(tests/reference/numpy_v4_mtp.py; transformers' DeepseekV4ForCausalLM has no MTP layer: it drops mtp.*)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.tiny_configs import TINY_V4FLASH
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.cache import init_cache
from deepinfer_jax.model.mtp import init_mtp_cache, mtp_cache_shapes, mtp_forward
from deepinfer_jax.model.numerics import Numerics
from deepinfer_jax.model.transformer import forward_hidden
from reference.numpy_v4_mtp import mtp_logits

FIXTURES = Path(__file__).parent / "fixtures"
T, PREFILL = 40, 24  # > the 16-token window, so the MTP ring evicts; the last 16 rows are decode steps
# fp32 against float64 through one block and the head: per-op roundings of 6e-8 accumulate over ~30
# chained ops to ~1e-6 of the logit scale (measured 5e-7). 1e-5 keeps headroom and still fails on any
# semantic difference (a missing norm, a wrong window or position, the wrong hc_head: >= 1e-2).
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def mtp_case(tiny_v4):
    """(ours [T, V], reference [T, V]) for one sequence: X from our exact main forward, ids of token t+1."""
    cfg, params, native = tiny_v4
    numerics = Numerics.exact()
    rng = np.random.default_rng(7)
    tokens = rng.integers(3, cfg.vocab_size, size=T + 1).astype(np.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    main = jax.jit(lambda p, c: forward_hidden(p, cfg, c, jnp.asarray(tokens[None, :T]), pos, None, numerics,
                                               return_layer_states=True))
    _, _, states = main(params, init_cache(cfg, 1, 64, numerics))
    x = states[-1]  # the final stream, before hc_head
    nxt = tokens[1:]
    step = jax.jit(lambda p, c, x, tok, pos: mtp_forward(p, cfg, c, x, tok, pos, numerics))
    cache = init_mtp_cache(cfg, 1, numerics)
    ours = []
    for lo, hi in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, T)]:
        logits, cache = step(params, cache, x[:, lo:hi], jnp.asarray(nxt[None, lo:hi]), pos[:, lo:hi])
        ours.append(np.asarray(logits[0]))
    w64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in native.items()}
    want = mtp_logits(TINY_V4FLASH, w64, np.asarray(x[0], np.float64), nxt)
    return np.concatenate(ours), want


def test_mtp_matches_the_numpy_reference(mtp_case):
    ours, want = mtp_case
    assert ours.shape == want.shape == (T, 256)
    err = np.abs(ours - want).max(-1) / np.abs(want).max(-1)
    assert err.max() < REL_TOL, f"worst row {err.argmax()}: rel err {err.max():.2e}"
    assert np.std(want) > 0.3  # O(1) logits that vary: the comparison is not between two flat outputs


def test_mtp_params_load_on_request(tiny_v4, tmp_path):
    from deepinfer_jax.checkpoint.tensor_specs import BACKBONE
    from deepinfer_jax.checkpoint.transformers_format import load_transformers_params
    from v4flash_tiny import write_tiny_v4flash

    cfg, params, _ = tiny_v4  # loaded with groups=(BACKBONE, DSPARK)
    p = params["mtp"][0]
    assert {"e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head_fn", "attn", "ffn"} <= set(p)
    assert "bias" in p["ffn"]["gate"] and "tid2eid" not in p["ffn"]["gate"]  # layer 7 >= num_hash_layers
    write_tiny_v4flash(tmp_path, seed=0)
    assert "mtp" not in load_transformers_params(tmp_path, cfg, groups=(BACKBONE,))


def test_mtp_ring_bytes_full_config():
    """Spec §4.2 counts 44 SWA rings: the backbone's 43 (test_kv_cache_v4.py) and this one, 128 x 584 B."""
    cfg = ModelConfig.from_dict(json.loads((FIXTURES / "v4_flash_config.json").read_text()))
    (ring,) = mtp_cache_shapes(cfg, 1, Numerics.reference())
    assert sum(s.shape[-1] * s.dtype.itemsize for s in jax.tree.leaves(ring["kv"])) * 128 == 128 * 584
    (ring_bf16,) = mtp_cache_shapes(cfg, 1, Numerics.reference(kv_quant=False))
    assert ring_bf16["kv"]["values"].shape == (1, 128, 512) and ring_bf16["kv"]["values"].dtype == jnp.bfloat16


def test_v41_has_no_v4_mtp(tiny_cfg):
    with pytest.raises(NotImplementedError, match="DSpark"):
        mtp_cache_shapes(tiny_cfg, 1, Numerics.exact())
