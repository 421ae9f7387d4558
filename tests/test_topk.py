"""topk_indices: reference vs a numpy lexsort oracle, lax.top_k path == reference bit for bit on
tie-heavy rows, -inf / NaN / signed-zero handling, k > S, and batch invariance."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.topk import topk_indices, topk_indices_reference, topk_indices_xla


def _oracle(scores, k):
    """numpy: order by (score desc, index asc), keep k, -inf -> -1 last, the rest ascending."""
    s = np.asarray(scores, np.float64).copy()
    s[np.isnan(s)] = -np.inf
    s[s == 0] = 0.0                     # -0.0 ties with +0.0
    lead = s.shape[:-1]
    flat = s.reshape(-1, s.shape[-1])
    out = np.full((flat.shape[0], k), -1, np.int32)
    for r, row in enumerate(flat):
        order = np.lexsort((np.arange(row.size), -row))[:k]    # last key is the primary one
        keep = np.sort(order[row[order] > -np.inf])
        out[r, :keep.size] = keep
    return out.reshape(*lead, k)


def _tie_heavy(rng, shape):
    """Few distinct values, signed zeros, -inf and NaN: every tie rule gets exercised."""
    s = rng.integers(-3, 4, shape).astype(np.float32)
    s[rng.random(shape) < 0.1] = -0.0
    s[rng.random(shape) < 0.1] = -np.inf
    s[rng.random(shape) < 0.02] = np.nan
    return s


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 3), (64, 8), (300, 80), (257, 1), (33, 33), (20, 40), (1000, 512)])
def test_reference_and_xla_match_oracle(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    s = _tie_heavy(rng, (2, 3, n))
    want = _oracle(s, k)
    ref = topk_indices_reference(jnp.asarray(s), k)
    assert ref.dtype == jnp.int32 and ref.shape == (2, 3, k)
    np.testing.assert_array_equal(np.asarray(ref), want)
    np.testing.assert_array_equal(np.asarray(topk_indices_xla(jnp.asarray(s), k)), want)
    np.testing.assert_array_equal(np.asarray(topk_indices_xla(jnp.asarray(s), k, method="sort")), want)


def test_lower_index_wins_ties_and_result_is_ascending():
    s = jnp.asarray([[[1.0, 3.0, 3.0, -0.0, 0.0, -jnp.inf, 3.0, jnp.nan, 3.0]]])
    assert topk_indices(s, 3).tolist() == [[[1, 2, 6]]]            # the 3.0 at index 8 loses
    assert topk_indices(s, 6).tolist() == [[[0, 1, 2, 3, 6, 8]]]   # -0.0 (3) beats +0.0 (4): lower index
    assert topk_indices(s, 9).tolist() == [[[0, 1, 2, 3, 4, 6, 8, -1, -1]]]   # -inf and NaN picks -> -1
    assert topk_indices(s, 12).tolist() == [[[0, 1, 2, 3, 4, 6, 8, -1, -1, -1, -1, -1]]]


def test_all_unreachable_row_gives_all_minus_one():
    s = jnp.full((1, 2, 50), -jnp.inf)
    assert np.all(np.asarray(topk_indices(s, 16)) == -1)


def test_wide_range_and_tiny_scores():
    rng = np.random.default_rng(7)
    r = rng.standard_normal((4, 500)).astype(np.float32)
    # Magnitudes from ~1e-30 to ~1e30. (Subnormal scores are not tested: XLA flushes them to zero,
    # after which they tie with 0 and go to the lower index -- documented in pallas_kernels.topk.)
    for s in (r * np.exp(rng.standard_normal(r.shape) * 15).astype(np.float32), r * np.float32(1e-30)):
        np.testing.assert_array_equal(np.asarray(topk_indices(jnp.asarray(s), 64)), _oracle(s, 64))


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_batch_invariant(batch):
    rng = np.random.default_rng(8)
    probe = _tie_heavy(rng, (1, 2, 700))
    alone = np.asarray(topk_indices(jnp.asarray(probe), 128))
    for slot in sorted({0, batch // 2, batch - 1}):
        s = _tie_heavy(rng, (batch, 2, 700))
        s[slot] = probe[0]
        np.testing.assert_array_equal(np.asarray(topk_indices(jnp.asarray(s), 128))[slot], alone[0])


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="'heap'"):
        topk_indices_xla(jnp.zeros((1, 1, 4)), 2, method="heap")


def test_dispatcher_uses_the_registry():
    s = jnp.asarray(_tie_heavy(np.random.default_rng(10), (2, 1, 90)))
    np.testing.assert_array_equal(np.asarray(topk_indices(s, 16, impl="reference")),
                                  np.asarray(topk_indices(s, 16)))
    with pytest.raises(ValueError, match="no implementation 'pallas_mosaic_gpu'"):
        topk_indices(s, 16, impl="pallas_mosaic_gpu")
