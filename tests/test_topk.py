"""topk_indices: the reference and every method of the XLA path (bisection, stable sort, lax.top_k) vs a
numpy lexsort oracle on tie-heavy and adversarial rows, -inf / NaN / signed-zero / subnormal handling,
k > S, "auto"'s choice by size, and batch invariance."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.topk import topk_indices, topk_indices_reference, topk_indices_xla, xla as topk_xla

METHODS = ("auto", "select", "sort", "top_k")


@functools.cache
def _backend_flushes_subnormals() -> bool:
    """Whether jitted float32 compares on the default backend see a subnormal as zero: XLA:CPU flushes
    them, XLA:GPU keeps them (``xla_gpu_ftz`` is off), so 1e-40 ranks above 0 there (the GPU run of
    2026-12-07, session 30). Operands are arguments, so nothing is folded at compile time."""
    return not bool(jax.jit(lambda a, b: a > b)(jnp.float32(1e-40), jnp.float32(0.0)))


def _oracle(scores, k):
    """numpy: order by (score desc, index asc), keep k, -inf -> -1 last, the rest ascending; -0.0 ties
    with +0.0, and so do subnormals where the backend flushes them."""
    s = np.asarray(scores, np.float64).copy()
    s[np.isnan(s)] = -np.inf
    tiny = np.finfo(np.float32).tiny if _backend_flushes_subnormals() else np.finfo(np.float32).smallest_subnormal
    s[np.abs(s) < tiny] = 0.0
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
    for method in METHODS:
        np.testing.assert_array_equal(np.asarray(topk_indices_xla(jnp.asarray(s), k, method=method)), want,
                                      err_msg=method)


@pytest.mark.parametrize("method", METHODS[1:] + ("reference",))
def test_every_method_matches_a_lexsort_on_adversarial_rows(method):
    """Heavy ties, +-0, subnormals (where XLA flushes them, the CPU: they tie with zero), +-inf, NaN (unreachable),
    fewer reachable entries than k, and k above the row length; jitted, as the model runs it."""
    r = np.random.default_rng(11)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-40, -1e-40, 3.4e38], np.float32)
    rows = np.concatenate([r.standard_normal((8, 48)), r.integers(-2, 3, (8, 48)), r.choice(specials, (16, 48)),
                           np.full((2, 48), -np.inf), np.full((2, 48), 7.0)]).astype(np.float32)
    fn = topk_indices_reference if method == "reference" else functools.partial(topk_indices_xla, method=method)
    for k in (1, 5, 30, 48, 60):
        got = jax.jit(lambda x: fn(x, k))(jnp.asarray(rows.reshape(4, 9, 48)))
        np.testing.assert_array_equal(np.asarray(got).reshape(rows.shape[0], k), _oracle(rows, k), err_msg=str(k))


@pytest.mark.parametrize("bits_per_pass", [1, 2, 4])
def test_bisection_finds_the_same_picks_at_every_pass_width(bits_per_pass):
    """select_topk narrows each row's k-th largest key bits_per_pass bits a pass (one variadic count of
    2**bits - 1 thresholds); every width must give the oracle's picks. Values spread over the whole float
    range (and near-equal neighbours that differ only in their low bits), so every pass decides."""
    from pallas_kernels.topk.select import select_topk

    r = np.random.default_rng(bits_per_pass)
    wide = (r.standard_normal((6, 64)) * 10.0 ** r.integers(-30, 30, (6, 64))).astype(np.float32)
    near = np.array([np.float32(1.5) + np.float32(2.0 ** -23) * (i % 5) for i in range(64)], np.float32)[None]
    rows = np.concatenate([wide, np.repeat(near, 2, 0), _tie_heavy(r, (4, 64))])
    for k in (1, 7, 32, 64):
        got = jax.jit(lambda x: select_topk(x, k, bits_per_pass=bits_per_pass))(jnp.asarray(rows))
        np.testing.assert_array_equal(np.asarray(got), _oracle(rows, k), err_msg=str(k))
    with pytest.raises(ValueError, match="must divide the keys' (16|32) bits"):
        select_topk(jnp.asarray(rows), 3, bits_per_pass=3)


@pytest.mark.parametrize("bits_per_pass", [1, 2, 4])
def test_least_key_below_with_masses_is_the_least_threshold(bits_per_pass):
    """least_key_below with per-key masses (the sampler's top-p) and per-row budgets: the least t whose
    mass above it is below the budget, found by a numpy scan over every candidate t (0 and each key).
    Masses are small integers, so every sum is exact in float32 whatever its order; keys repeat (ties)
    and spread over the whole uint32 range."""
    from pallas_kernels.topk.select import least_key_below

    r = np.random.default_rng(10 + bits_per_pass)
    keys = r.integers(0, 2**32, (5, 40), dtype=np.uint64).astype(np.uint32)
    keys[:, 20:30] = keys[:, :10]                                  # ties
    keys[4] = r.integers(0, 4, 40)                                 # near zero, many ties
    mass = r.integers(0, 4, keys.shape).astype(np.float32)          # zeros too: dead / filtered keys
    budget = np.array([1.0, 7.0, 30.0, 200.0, 0.5], np.float32)     # 200: every t qualifies
    got = np.asarray(jax.jit(lambda k, m, b: least_key_below(k, b, bits_per_pass, m))(keys, mass, budget))
    for row in range(keys.shape[0]):
        cands = np.unique(np.concatenate([[0], keys[row]]).astype(np.uint64))
        ok = [t for t in cands if mass[row][keys[row] > t].sum() < budget[row]]
        assert got[row] == min(ok), row
    # counts (no masses) with a per-row budget: the k-th largest key
    counts_t = np.asarray(least_key_below(jnp.asarray(keys), jnp.array([1, 3, 10, 40, 2]), bits_per_pass))
    for row, k in enumerate((1, 3, 10, 40, 2)):
        assert counts_t[row] == np.sort(keys[row])[::-1][k - 1], row


def _candidate_overflow(scores, k, block, capacity):
    """Does select_on_candidates's list overflow for these float32 rows (its fallback runs)? From numpy's
    candidate blocks (keys ranked as the scores, NaN lowest), which must be ``candidate_blocks``'s."""
    from pallas_kernels.topk.select import candidate_blocks, order_key

    keys = np.where(np.isnan(scores), 0, np.asarray(order_key(jnp.asarray(scores)))).astype(np.uint32)
    nb = -(-keys.shape[1] // block)
    bmax = np.pad(keys, ((0, 0), (0, nb * block - keys.shape[1]))).reshape(len(keys), nb, block).max(-1)
    m = np.sort(bmax, axis=1)[:, ::-1][:, k - 1] if nb >= k else np.zeros(len(keys), np.uint32)
    m16 = m & np.uint32(0xFFFF0000)                                    # the bound the list uses
    cand = bmax >= np.maximum(m16, 0x007FFFFF + 1)[:, None]           # 0x007FFFFF: order_key(-inf)
    np.testing.assert_array_equal(np.asarray(candidate_blocks(jnp.asarray(scores), k, block)), cand)
    return bool(np.any(cand.sum(1) > capacity))


@pytest.mark.parametrize("block", [4, 8])
def test_select_on_candidates_is_select_rows_on_both_paths(block):
    """select_on_candidates picks from the blocks whose maximum reaches the k-th largest block maximum:
    the same columns as select_rows on the whole row and as numpy's lexsort, whether the list holds
    every row's candidates or a tie-heavy row sends the call to the whole rows (both cases checked to
    occur). Rows with spread scores, exact ties across the k-th score, few reachable entries (the rest
    -inf or NaN, some packed into a few blocks), and lengths that are not a multiple of the block."""
    from pallas_kernels.topk.select import order_key, score_key, select_on_candidates, select_rows

    assert int(np.asarray(order_key(jnp.float32(-jnp.inf)))) == 0x007FFFFF
    r = np.random.default_rng(block)
    k, capacity = 24, 30
    for s in (997, 1000):
        spread = r.standard_normal((5, s)).astype(np.float32)
        spread[4, 300:310] = np.sort(spread[4])[::-1][k - 3]                   # ties across the k-th score
        sparse = np.full((3, s), -np.inf, np.float32)
        sparse[0, r.choice(s, 10, replace=False)] = spread[0, :10]            # fewer reachable than k
        sparse[1, 100:100 + 3 * k] = spread[1, :3 * k]                          # > k reachable in < k blocks
        sparse[2, ::2] = np.nan                                                  # NaN among -inf
        sparse[2, 5:5 + k] = spread[2, :k]
        ties = r.integers(-3, 4, (2, s)).astype(np.float32)
        for rows, overflows in ((np.concatenate([spread, sparse]), False), (np.concatenate([spread, ties]), True)):
            assert _candidate_overflow(rows, k, block, capacity) == overflows
            got = np.asarray(jax.jit(lambda x: select_on_candidates(x, k, block, capacity))(jnp.asarray(rows)))
            np.testing.assert_array_equal(got, np.asarray(select_rows(score_key(jnp.asarray(rows)), k)),
                                          err_msg=f"S={s} overflow={overflows}")
            np.testing.assert_array_equal(got, _oracle(rows, k), err_msg=f"S={s} overflow={overflows}")


def test_select_topk_with_the_prefilter_matches_the_oracle(monkeypatch):
    """Rows long enough for the prefilter (S >= 2 x the candidate list's keys): the picks are the
    oracle's, with the list used (gaussian rows, -inf tails, NaN, signed zeros) and with its fallback
    (tie-heavy rows), and bitwise the picks with the prefilter off."""
    from pallas_kernels.topk import select as select_mod

    r = np.random.default_rng(21)
    k, s = 32, 1500
    assert select_mod.prefilter_capacity(k, s) == 40
    gauss = r.standard_normal((6, s)).astype(np.float32)
    gauss[0, 300:] = -np.inf                                   # a short visible prefix
    gauss[1, ::7] = np.nan
    gauss[2, :50] = -0.0
    gauss[2, 50:100] = 0.0
    gauss[3, :] = -np.inf
    gauss[3, 900:920] = 1.0                                    # 20 reachable, tied
    assert not _candidate_overflow(gauss, k, select_mod.PREFILTER_BLOCK, 40)
    ties = _tie_heavy(r, (3, s))
    assert _candidate_overflow(ties, k, select_mod.PREFILTER_BLOCK, 40)
    for rows in (gauss, ties):
        got = np.asarray(jax.jit(lambda x: select_mod.select_topk(x, k))(jnp.asarray(rows)))
        np.testing.assert_array_equal(got, _oracle(rows, k))
        with monkeypatch.context() as m:
            m.setattr(select_mod, "prefilter_capacity", lambda *a, **kw: 0)
            np.testing.assert_array_equal(np.asarray(select_mod.select_topk(jnp.asarray(rows), k)), got)


@pytest.mark.parametrize("may_branch", [False, True])
@pytest.mark.parametrize("method", METHODS + ("reference",))
def test_width_ranks_the_first_columns_like_a_slice(method, may_branch, monkeypatch):
    """topk_indices(..., width=W) picks what it picks on scores[..., :W], for every method, with W long
    enough for the bisection's candidate list and short of it, and k above W; with and without leave
    to branch (the candidate list's conditional), which changes no pick."""
    from pallas_kernels.topk import select as select_mod

    monkeypatch.setattr(topk_xla, "SELECT_MIN_SCORES", 1)    # "auto" bisects here, as at a prefill chunk
    r = np.random.default_rng(5)
    s = r.standard_normal((2, 3, 1600)).astype(np.float32)
    s[0, 1, 500:] = s[0, 1, 0]                               # ties, past a narrow width too
    if method == "reference":
        fn = functools.partial(topk_indices, impl="reference")
    else:
        fn = functools.partial(topk_indices_xla, method=method)
    for width, k in ((1600, 32), (1400, 32), (600, 32), (20, 32)):
        assert (select_mod.prefilter_capacity(32, width) > 0) == (width >= 640)
        got = jax.jit(lambda x: fn(x, k, width=width, may_branch=may_branch))(jnp.asarray(s))
        np.testing.assert_array_equal(np.asarray(got), _oracle(s[..., :width], k), err_msg=f"{width}")


def test_indexer_select_branches_in_prefill_chunks_only(monkeypatch):
    """The candidate list's conditional (and the live-width switch) appear in a prefill chunk's top-k
    and never in a decode step's (T = 1), whose CUDA graph a conditional would cut; both pick the
    oracle's entries."""
    from deepinfer_jax.model.indexer import select
    from deepinfer_jax.model.numerics import Numerics

    monkeypatch.setattr(topk_xla, "SELECT_MIN_SCORES", 1)
    num = Numerics.reference()
    r = np.random.default_rng(9)
    for t in (1, 4):
        sc = r.standard_normal((2, t, 2048)).astype(np.float32)
        for live in (None, jnp.int32(2048)):
            fn = lambda x: select(x, 64, num, live=live)   # noqa: E731
            jaxpr = str(jax.make_jaxpr(fn)(jnp.asarray(sc)))
            assert ("cond[" in jaxpr) == (t > 1), (t, live)
            np.testing.assert_array_equal(np.asarray(jax.jit(fn)(jnp.asarray(sc))), _oracle(sc, 64))


@pytest.mark.parametrize("bits_per_pass", [1, 2, 4])
def test_least_key_below_on_uint16_keys_is_the_kth_largest(bits_per_pass):
    """uint16 keys (the candidate list's block maxima, top halves) take 16 / bits_per_pass passes and
    give numpy's k-th largest, ties and zeros included; other key types are refused."""
    from pallas_kernels.topk.select import least_key_below

    r = np.random.default_rng(30 + bits_per_pass)
    keys = r.integers(0, 2**16, (4, 50)).astype(np.uint16)
    keys[1, :25] = keys[1, 25:]                                     # ties
    keys[3] = r.integers(0, 3, 50)                                  # near zero
    budget = np.array([1, 7, 50, 20])
    got = np.asarray(jax.jit(lambda x: least_key_below(x, jnp.asarray(budget), bits_per_pass))(jnp.asarray(keys)))
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, [np.sort(keys[i])[::-1][budget[i] - 1] for i in range(4)])
    with pytest.raises(ValueError, match="uint16 or uint32"):
        least_key_below(jnp.zeros((1, 4), jnp.int32), 1, bits_per_pass)


def test_auto_selects_by_bisection_from_select_min_scores(monkeypatch):
    s = jnp.zeros((1, 4, 64))

    def sorts():
        return " sort[" in str(jax.make_jaxpr(lambda x: topk_indices_xla(x, 8))(s))

    assert sorts()
    monkeypatch.setattr(topk_xla, "SELECT_MIN_SCORES", s.size)
    assert not sorts()


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
    # Magnitudes from ~1e-30 to ~1e30 (subnormals: the adversarial rows above).
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


def test_live_widths_cover_the_row_in_aligned_steps():
    from deepinfer_jax.model.indexer import live_widths

    assert live_widths(32784, 512) == (8448, 16640, 24832, 32784)
    assert live_widths(2000, 64) == (512, 1024, 1536, 2000)
    assert live_widths(2000, 900) == (900, 1024, 1536, 2000)      # never narrower than k
    assert live_widths(200, 16) == (200,)                           # short rows: one width, no switch


@pytest.mark.parametrize("select_min", [None, 1])
def test_select_on_the_live_width_is_the_full_width_bit_for_bit(select_min, monkeypatch):
    """``indexer.select(..., live=L)``: a prefill chunk's top-k on the narrowest width that holds the
    batch's visible entries gives the full-width picks, for live bounds in every width bucket, below k,
    and 0, with ties, -0.0 and NaN among the visible scores and rows that see fewer entries than others
    (so the result cannot depend on what else is in the batch). select_min=1 forces the bisection."""
    from deepinfer_jax.model.indexer import live_entries, select
    from deepinfer_jax.model.numerics import Numerics

    if select_min is not None:
        monkeypatch.setattr(topk_xla, "SELECT_MIN_SCORES", select_min)
    rng = np.random.default_rng(3)
    b, t, s, k = 2, 5, 2000, 64
    base = rng.integers(-4, 4, size=(b, t, s)).astype(np.float32)   # few values: ties everywhere
    base[0, 0, :40] = -0.0
    base[1, 2, 7] = np.nan
    num = Numerics.reference()
    run = jax.jit(lambda sc, live: select(sc, k, num, live=live))
    full = jax.jit(lambda sc: select(sc, k, num))
    for live in (0, 30, 511, 512, 513, 1100, 1536, 1999, 2000):
        pos = rng.integers(-1, live, size=(b, t))                   # each row sees (pos + 1) entries
        pos[0, 0] = live - 1                                        # one row sees them all
        n_vis = np.where(pos >= 0, pos + 1, 0)
        scores = np.where(np.arange(s)[None, None, :] < n_vis[..., None], base, -np.inf).astype(np.float32)
        assert int(live_entries(jnp.asarray(pos), 1)) == live
        got = np.asarray(run(jnp.asarray(scores), jnp.int32(live)))
        want = np.asarray(full(jnp.asarray(scores)))
        assert np.array_equal(got, want), live
        assert np.array_equal(want, _oracle(scores, k)), live


@pytest.mark.parametrize("k", [1, 5, 30, 48, 60])
def test_top_mask_is_the_sorts_first_k_less_unreachable(k):
    """``top_mask`` (the candidate pool's block mask) against the form it replaced: a stable descending
    sort's first k, scattered into a mask where the value is above -inf; and against the oracle's picks.
    Adversarial rows as above, plus +inf (the pinned newest block), jitted."""
    from pallas_kernels.topk.select import top_mask

    r = np.random.default_rng(12)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-40, -1e-40, 3.4e38], np.float32)
    rows = np.concatenate([r.standard_normal((8, 48)), r.integers(-2, 3, (8, 48)), r.choice(specials, (16, 48)),
                           np.full((2, 48), -np.inf), np.full((2, 48), np.inf)]).astype(np.float32)
    x = jnp.asarray(rows.reshape(4, 9, 48))

    def sorted_form(s):
        vals, idx = topk_xla.topk_desc(s, min(k, s.shape[-1]))
        keep = jnp.zeros(s.shape, bool)
        lead = jnp.indices(idx.shape[:-1], sparse=True)
        return keep.at[(*[a[..., None] for a in lead], idx)].set(vals > -jnp.inf)

    got = np.asarray(jax.jit(lambda s: top_mask(s, k))(x))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(sorted_form)(x)))
    want = np.zeros(rows.shape, bool)
    for i, picks in enumerate(_oracle(rows, min(k, 48))):
        want[i, picks[picks >= 0]] = True
    np.testing.assert_array_equal(got.reshape(rows.shape), want)
    assert got.sum() > 0 and not got.all()
    # k >= S keeps every reachable score by one compare: no bisection passes (reductions) are traced
    reduces = [e for e in jax.make_jaxpr(lambda s: top_mask(s, k))(x).eqns if "reduce" in e.primitive.name]
    assert (not reduces) == (k >= 48), (k, reduces)


@pytest.mark.parametrize("k", [1, 2, 6, 8])
def test_topk_desc_rows_by_passes_is_the_stable_sort(k):
    """The router's top-k (``topk_desc_rows``): from PASSES_MIN_ROWS rows it takes k argmax passes on
    order keys instead of the sort; the same indices and values as ``topk_desc`` on tie-heavy rows
    (+-0, +-inf, NaN, subnormals, whole rows of one value, rows with fewer than k finite entries)."""
    r = np.random.default_rng(20 + k)
    n = topk_xla.PASSES_MIN_ROWS
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-40, -1e-40, 3.4e38], np.float32)
    rows = np.concatenate([r.standard_normal((n // 2, 24)), r.integers(-2, 3, (n // 4, 24)),
                           r.choice(specials, (n // 4 - 3, 24)), np.full((1, 24), np.nan),
                           np.full((1, 24), -np.inf), np.full((1, 24), 7.0)]).astype(np.float32)
    rows[-4, :20] = np.nan                     # fewer than k reachable entries
    x = jnp.asarray(rows.reshape(2, n // 2, 24))
    got_v, got_i = jax.jit(lambda s: topk_xla.topk_desc_rows(s, k))(x)
    want_v, want_i = jax.jit(lambda s: topk_xla.topk_desc(s, k))(x)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))
    small = x[:1, :8]                          # below PASSES_MIN_ROWS: the sort itself
    np.testing.assert_array_equal(np.asarray(topk_xla.topk_desc_rows(small, k)[1]),
                                  np.asarray(topk_xla.topk_desc(small, k)[1]))
