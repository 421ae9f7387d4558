"""Shared fixtures: the committed tiny checkpoint, loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_CKPT = ROOT / "checkpoints" / "tiny-v41"


@pytest.fixture(scope="session")
def tiny_ckpt() -> Path:
    if not (TINY_CKPT / "config.json").exists():
        pytest.fail(f"the committed tiny checkpoint is missing at {TINY_CKPT}; run python checkpoints/make_tiny.py")
    return TINY_CKPT


@pytest.fixture(scope="session")
def tiny_cfg(tiny_ckpt):
    from deepinfer_jax.config import ModelConfig

    return ModelConfig.from_json(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny_params(tiny_ckpt, tiny_cfg):
    from deepinfer_jax.checkpoint.loader import load_params

    return load_params(tiny_ckpt, tiny_cfg, progress=False)


@pytest.fixture(scope="session")
def tiny_token_map(tiny_ckpt, tiny_cfg):
    from deepinfer_jax.engine.token_map import compressed_token_map

    table, _ = compressed_token_map(tiny_ckpt / "tokenizer.json", tiny_cfg.vocab_size)
    return table


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory):
    """(cfg, params with the MTP layer, native float32 tensors) of the random tiny V4-Flash checkpoint
    (tests/v4flash_tiny.py, transformers' spelling)."""
    from deepinfer_jax.checkpoint.tensor_specs import BACKBONE, DSPARK
    from deepinfer_jax.checkpoint.transformers_format import load_transformers_params
    from v4flash_tiny import write_tiny_v4flash

    ckpt = tmp_path_factory.mktemp("v4flash") / "ckpt"
    cfg, native = write_tiny_v4flash(ckpt, seed=0)
    return cfg, load_transformers_params(ckpt, cfg, groups=(BACKBONE, DSPARK)), native


os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    # Every test process compiles the same tiny-model steps; a shared on-disk cache makes the second
    # compile of an identical step (another test, another xdist worker) a cache hit.
    import jax

    cache_dir = ROOT / ".pytest_cache" / "jax_compilation_cache"
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
