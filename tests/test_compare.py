"""The numerical-comparison tool (deepinfer_jax/compare.py, scripts/dump_numpy_reference.py).

Metrics on hand-made arrays, the dump format and its errors, thresholds through the CLI function, and the
real thing: our model (Numerics.exact) against the float64 numpy reference on the committed tiny checkpoint.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from deepinfer_jax import compare as cmp  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------


def test_cosine_identical_opposite_orthogonal_and_zero():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 4, 8))
    assert np.allclose(cmp.cosine_per_position(a, a), 1.0, atol=1e-15)
    assert np.allclose(cmp.cosine_per_position(-a, a), -1.0, atol=1e-15)
    e0, e1 = np.eye(3)[[0]], np.eye(3)[[1]]
    assert cmp.cosine_per_position(e0, e1)[0] == 0.0
    z = np.zeros((2, 3))
    assert list(cmp.cosine_per_position(z, z)) == [1.0, 1.0]  # both zero: identical
    assert list(cmp.cosine_per_position(z, np.ones((2, 3)))) == [0.0, 0.0]


def test_kl_identical_is_zero_and_known_value():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 50)) * 5
    kl = cmp.kl_per_position(logits, logits)
    assert np.all(kl >= 0) and kl.max() < 1e-15
    # p = (1/2, 1/2), q = (3/4, 1/4): KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    ref, ours = np.array([[0.0, 0.0]]), np.array([[math.log(3.0), 0.0]])
    assert cmp.kl_per_position(ref, ours)[0] == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    # shift invariance of softmax: adding a constant to ours changes nothing
    assert cmp.kl_per_position(logits, logits + 7.0).max() < 1e-13
    # a token the reference rules out (-inf) contributes nothing; one that ours rules out is infinite
    masked = np.array([[0.0, -np.inf, 1.0]])
    assert cmp.kl_per_position(masked, masked)[0] == 0.0
    assert cmp.kl_per_position(np.zeros((1, 3)), masked)[0] == math.inf


def test_known_perturbation_gives_known_errors():
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((7, 4, 16))
    ref[3, 2, 5] = 10.0  # the reference's max abs
    ours = ref.copy()
    ours[1, 0, 0] += 0.25
    assert cmp.max_abs_error(ours, ref) == pytest.approx(0.25, abs=1e-15)
    assert cmp.max_rel_error(ours, ref) == pytest.approx(0.025, rel=1e-13)
    assert cmp.max_rel_error(np.zeros(3), np.zeros(3)) == 0.0
    assert cmp.max_rel_error(np.ones(3), np.zeros(3)) == math.inf


def test_top1_agreement():
    ref = np.array([[0.0, 1.0, 0.5], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    ours = np.array([[0.0, 1.0, 0.9], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    assert cmp.top1_agreement(ours, ref).tolist() == [True, False, True]


# ---------------------------------------------------------------------------------------------------------
# The dump format, reports, errors
# ---------------------------------------------------------------------------------------------------------


def random_dump(seed=0, lengths=(5, 7), n_layers=3, hc=4, d=8, vocab=11) -> cmp.Dump:
    rng = np.random.default_rng(seed)
    prompts = []
    for t in lengths:
        prompts.append(cmp.PromptDump(
            rng.integers(0, vocab, size=t), rng.standard_normal((t, vocab)).astype(np.float32),
            tuple(rng.standard_normal((t, hc, d)).astype(np.float32) for _ in range(n_layers))))
    return cmp.Dump(tuple(prompts), {"implementation": "test", "config": "toy"})


def perturbed(dump: cmp.Dump, prompt: int, layer: int | None, delta: float) -> cmp.Dump:
    """A copy with ``delta`` added to one entry of one layer state (layer None: of the logits)."""
    out = []
    for i, p in enumerate(dump.prompts):
        hidden, logits = [h.copy() for h in p.hidden], p.logits.copy()
        if i == prompt:
            if layer is None:
                logits[0, 0] += delta
            else:
                hidden[layer][0, 0, 0] += delta
        out.append(cmp.PromptDump(p.tokens.copy(), logits, tuple(hidden)))
    return cmp.Dump(tuple(out), dict(dump.metadata))


@pytest.mark.parametrize("ext", [".safetensors", ".npz"])
def test_dump_round_trip_and_self_compare(tmp_path, ext):
    dump = random_dump()
    path = cmp.save_dump(dump, tmp_path / f"d{ext}")
    back = cmp.load_dump(path)
    assert back.metadata == dump.metadata and back.n_layers == 3 and len(back.prompts) == 2
    for a, b in zip(dump.prompts, back.prompts):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logits, b.logits)
        assert all(np.array_equal(x, y) for x, y in zip(a.hidden, b.hidden))
    rep = cmp.compare_dumps(back, dump)
    assert rep.names() == ["layer0", "layer1", "layer2", "logits"]
    assert all(s.max_abs == 0 and s.max_rel == 0 for s in rep.tensors)
    assert all(abs(s.cos_min - 1) < 1e-12 for s in rep.tensors)
    assert rep.kl_max < 1e-15 and rep.top1 == 1.0
    assert rep.check(cmp.Thresholds(0.0, 1.0, 1e-15, 0.0)) == []
    table = rep.table()
    assert "layer2" in table and "logits" in table and "top-1 agreement 12/12" in table


def test_report_locates_and_checks_a_perturbed_layer(tmp_path):
    ref = random_dump()
    ours = perturbed(ref, prompt=1, layer=1, delta=0.5)
    rep = cmp.compare_dumps(ours, ref)
    w = rep.worst("layer1")
    assert w.prompt == 1 and w.max_abs == pytest.approx(0.5, abs=1e-6)
    scale = np.abs(ref.prompts[1].hidden[1]).max()
    assert w.max_rel == pytest.approx(0.5 / scale, rel=1e-5)
    assert rep.worst("layer0").max_abs == 0 and rep.worst("layer2").max_abs == 0
    assert rep.first_layer_over(1e-3) == 1
    v = rep.check(cmp.Thresholds(max_layer_rel=1e-3))
    assert len(v) == 1 and v[0].startswith("layer1:") and "first layer over the bound" in v[0]
    assert rep.check(cmp.Thresholds(max_layer_rel=1.0)) == []
    png = rep.plot(tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_logit_thresholds_trip():
    ref = random_dump(lengths=(4,))
    ours = perturbed(ref, prompt=0, layer=None, delta=30.0)  # moves the argmax of position 0
    rep = cmp.compare_dumps(ours, ref)
    assert rep.top1 == pytest.approx(3 / 4)
    assert rep.kl_max > 1.0 and rep.logit_stats[0].kl[1:].max() < 1e-12
    v = rep.check(cmp.Thresholds(max_logit_abs=1.0, min_top1=1.0, max_kl=1e-3))
    assert [s.split(":")[0].split(" ")[0] for s in v] == ["logits", "top-1", "KL(ref"]
    assert "position 0" in v[2]
    assert rep.check(cmp.Thresholds(max_logit_abs=31.0, min_top1=0.75, max_kl=1e3)) == []


def test_nan_violates_every_bound():
    ref = random_dump(lengths=(3,))
    ours = perturbed(ref, prompt=0, layer=0, delta=np.nan)
    ours = perturbed(ours, prompt=0, layer=None, delta=np.nan)
    rep = cmp.compare_dumps(ours, ref)
    v = rep.check(cmp.Thresholds(max_logit_abs=1e9, max_kl=1e9, max_layer_rel=1e9))
    assert any(s.startswith("layer0") for s in v) and any(s.startswith("logits") for s in v)
    assert any(s.startswith("KL") for s in v)


def test_mismatch_errors_name_the_tensor_and_both_shapes(tmp_path):
    ref = random_dump()
    # hidden size differs
    other = random_dump(d=6)
    other = cmp.Dump(tuple(cmp.PromptDump(r.tokens, o.logits, o.hidden) for r, o in zip(ref.prompts, other.prompts)))
    msg = r"prompt0\.layer0\.hidden: shape mismatch, ours \[5, 4, 6\].* ref \[5, 4, 8\]"
    with pytest.raises(cmp.DumpError, match=msg):
        cmp.compare_dumps(other, ref)
    # one layer fewer
    short = cmp.Dump(tuple(cmp.PromptDump(p.tokens, p.logits, p.hidden[:2]) for p in ref.prompts))
    msg = r"prompt0\.layer2\.hidden: present in only one dump, ours absent vs ref \[5, 4, 8\]"
    with pytest.raises(cmp.DumpError, match=msg):
        cmp.compare_dumps(short, ref)
    assert cmp.compare_dumps(short, ref, layers=False).n_layers == 0  # logits only still compares
    # different prompts
    toks = cmp.Dump(tuple(cmp.PromptDump(p.tokens + (i == 1), p.logits, p.hidden) for i, p in enumerate(ref.prompts)))
    with pytest.raises(cmp.DumpError, match=r"prompt1\.tokens differ at position 0"):
        cmp.compare_dumps(toks, ref)
    with pytest.raises(cmp.DumpError, match=r"holds 1 prompts.* 2: prompt1\.\* is missing"):
        cmp.compare_dumps(cmp.Dump(ref.prompts[:1]), ref)
    no_layers = cmp.Dump(tuple(cmp.PromptDump(p.tokens, p.logits) for p in ref.prompts), source="x.npz")
    with pytest.raises(cmp.DumpError, match=r"ref \(x\.npz\) holds no prompt\{i\}\.layer\{L\}\.hidden"):
        cmp.compare_dumps(ref, no_layers)


def test_malformed_dump_files(tmp_path):
    from safetensors.numpy import save_file

    good = random_dump().tensors()
    cases = {
        "badname": ({**good, "prompt0.layer1.hiden": good["prompt0.layer1.hidden"]},
                    r"'prompt0\.layer1\.hiden' does not follow"),
        "gap": ({k: v for k, v in good.items() if k != "prompt1.layer1.hidden"}, r"prompt1\.layer1\.hidden is missing"),
        "nologits": ({k: v for k, v in good.items() if k != "prompt0.logits"}, r"prompt0\.logits is missing"),
        "noprompt0": ({k: v for k, v in good.items() if not k.startswith("prompt0.")}, r"prompt0\.\* is missing"),
        "badlogits": ({**good, "prompt0.logits": good["prompt0.logits"][:3]},
                      r"prompt0\.logits must be \[T=5, V\], got \[3, 11\]"),
    }
    for name, (tensors, msg) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(cmp.DumpError, match=msg):
            cmp.load_dump(path)
    with pytest.raises(cmp.DumpError, match=r"unknown dump extension '\.pt'"):
        cmp.load_dump(tmp_path / "x.pt")
    with pytest.raises(cmp.DumpError, match="does not exist"):
        cmp.load_dump(tmp_path / "missing.npz")


def test_read_prompts(tmp_path, tiny_ckpt):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": 1, "token_ids": [5, 6, 7]}\n\n[8, 9]\n{"prompt": "Hello world"}\n')
    out = cmp.read_prompts(p, tiny_ckpt)
    assert out[:2] == [[5, 6, 7], [8, 9]] and len(out[2]) > 0
    for bad, msg in [('{"text": "x"}', "exactly one of"), ('{"token_ids": [1.5]}', "list of integers"),
                     ("{oops", "not valid JSON"), ('{"token_ids": [1], "prompt": "x"}', "exactly one of")]:
        p.write_text('[1]\n' + bad + "\n")
        with pytest.raises(ValueError, match=rf"p\.jsonl:2: .*{msg}"):
            cmp.read_prompts(p, tiny_ckpt)


# ---------------------------------------------------------------------------------------------------------
# CLI (the functions deepinfer-jax dispatches to)
# ---------------------------------------------------------------------------------------------------------


def test_cli_thresholds_exit_status(tmp_path, capsys):
    ref = cmp.save_dump(random_dump(), tmp_path / "ref.safetensors")
    ours = cmp.save_dump(perturbed(random_dump(), prompt=0, layer=2, delta=0.1), tmp_path / "ours.npz")
    base = ["compare", "--ours", str(ours), "--ref", str(ref)]
    assert cmp.main(base + ["--max-layer-rel", "1.0", "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "layer2" in out and "THRESHOLD" not in out and (tmp_path / "c.png").exists()
    assert cmp.main(base + ["--max-layer-rel", "1e-6", "--min-top1", "1"]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.startswith("THRESHOLD VIOLATED")]
    assert len(flagged) == 1 and flagged[0].startswith("THRESHOLD VIOLATED: layer2: max relative error")
    # a mismatch is an error (2), not a violation
    bad = cmp.save_dump(random_dump(d=6), tmp_path / "bad.npz")
    assert cmp.main(["compare", "--ours", str(bad), "--ref", str(ref)]) == 2
    assert "shape mismatch" in capsys.readouterr().err
    assert cmp.main(["compare", "--ours", str(tmp_path / "nope.npz"), "--ref", str(ref)]) == 2
    assert cmp.main(base + ["--dump", str(tmp_path / "x.npz")]) == 2  # --dump needs --model
    assert "need --model" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Our model vs the float64 numpy reference on the tiny checkpoint
# ---------------------------------------------------------------------------------------------------------

# 13 and 18 tokens: both exceed sliding_window = 8, so window eviction, ratio-2/ratio-1 compressed entries,
# indexer top-k (index_topk = 4 of up to 18 visible) and layer 6's candidate pool (3 blocks of 2) all make
# choices; 13 is odd, so the ratio-2 layers also hold back an incomplete pair.
PROMPTS = ['{"id": "a", "prompt": "The quick brown fox jumps over the lazy dog again."}',
           '{"id": "b", "prompt": "Compare every layer of the model, please!"}']
# fp32 vs float64 through 12 blocks: measured 3e-7 (layer 0) .. 1.2e-6 (layer 11, logits) of the
# reference's max abs (fp32 unit roundoff 6e-8, grown by sums of <= 256 terms, Sinkhorn and 12 residual
# blocks). 1e-5 leaves ~8x. A discrete choice that flips is not small: swapping one router expert or one
# indexer entry at a single position in the reference moves later layers by 2e-2 .. 2e-1 (measured, and
# checked below by test_a_flipped_choice_is_caught_at_its_layer), so the bound separates the two cleanly.
LAYER_REL_BOUND = 1e-5


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cmp") / "prompts.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def _record_choices(ref_mod):
    """Wrap the reference's top-k helper to record, per layer and site, the gap between the k-th and the
    (k+1)-th value relative to the row's largest |value| (the margin a rounding error must beat to flip).
    Exact ties (on the tiny model: index scores that are exactly 0 because every head's ReLU is off) are
    counted apart: both sides give the lower index, and they stay ties unless a dot product sits within
    rounding of 0."""
    margins: dict[tuple[int, str], float] = {}
    ties: dict[tuple[int, str], int] = {}
    state = {"layer": -1}
    orig_top, orig_block = ref_mod._top_indices, ref_mod.block

    def block(x, carried, weights, plan, *a, **k):
        state["layer"] = plan.layer_id
        return orig_block(x, carried, weights, plan, *a, **k)

    def top(values, k):
        site = sys._getframe(1).f_code.co_name  # route / select_topk / candidate_mask
        for row in np.asarray(values, np.float64).reshape(-1, np.shape(values)[-1]):
            f = np.sort(row[np.isfinite(row)])[::-1]
            if len(f) > k:
                gap = (f[k - 1] - f[k]) / max(np.abs(f).max(), 1e-300)
                key = (state["layer"], site)
                if gap == 0:
                    ties[key] = ties.get(key, 0) + 1
                else:
                    margins[key] = min(margins.get(key, np.inf), gap)
        return orig_top(values, k)

    return (margins, ties), {"_top_indices": top, "block": block}


@pytest.fixture(scope="module")
def tiny_dumps(prompts_file, tiny_ckpt, tiny_cfg, tiny_params, tiny_token_map, tmp_path_factory):
    import dump_numpy_reference
    from reference import numpy_v41

    out = tmp_path_factory.mktemp("dumps")
    prompts = cmp.read_prompts(prompts_file, tiny_ckpt)
    margins, patches = _record_choices(numpy_v41)
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in patches.items():
            mp.setattr(numpy_v41, name, fn)
        ref = dump_numpy_reference.dump_reference(tiny_ckpt, prompts, out / "ref.safetensors")
    ours = cmp.dump_activations(tiny_params, tiny_cfg, prompts, tiny_token_map, "exact", out / "ours.safetensors",
                                metadata={"config": "tiny-v41"})
    return prompts, ours, ref, margins, out


def test_tiny_model_matches_float64_reference(tiny_dumps, tiny_cfg):
    prompts, ours, ref, margins, out = tiny_dumps
    # both beyond the window, so the compressed path and the ring's wrap-around are compared too
    assert len(prompts) == 2 and min(len(p) for p in prompts) > tiny_cfg.sliding_window, [len(p) for p in prompts]
    rep = cmp.compare_dumps(cmp.load_dump(out / "ours.safetensors"), cmp.load_dump(out / "ref.safetensors"))
    assert rep.n_layers == tiny_cfg.num_hidden_layers
    margin, ties = margins
    near = sorted(margin.items(), key=lambda kv: kv[1])[:4]
    why = (f"\n{rep.table()}\nsmallest top-k margins (layer, site): "
           + ", ".join(f"{k}: {v:.1e}" for k, v in near)
           + f"\nexact ties at the k-th place (layer, site): {ties}"
           + "\n(a margin near the error level means a rounding-level difference can flip that choice)")
    violations = rep.check(cmp.Thresholds(max_layer_rel=LAYER_REL_BOUND, max_logit_abs=None, min_top1=1.0,
                                          max_kl=1e-9))
    assert violations == [], "\n".join(violations) + why
    assert rep.worst("logits").max_rel < LAYER_REL_BOUND, why
    # the errors are rounding noise, not zero: the two sides really are different implementations
    assert rep.worst("layer0").max_abs > 0
    numerics = ours.metadata["numerics"]
    assert {k: numerics[k] for k in ("act_dtype", "fake_quant", "kv_quant")} == {
        "act_dtype": "float32", "fake_quant": False, "kv_quant": False}
    assert "jax_version" in ours.metadata and ref.metadata["implementation"].startswith("tests/reference")


def test_a_flipped_choice_is_caught_at_its_layer(tiny_dumps, tiny_ckpt):
    """Negative control: the reference with one indexer choice of layer 8 swapped (last position of
    prompt 1) must trip the bound, and the report must point at layer 8 as the first layer over it."""
    import json

    from reference import numpy_v41

    from deepinfer_jax.engine.token_map import compressed_token_map

    prompts, ours, ref, _, _ = tiny_dumps
    config = json.loads((tiny_ckpt / "config.json").read_text())
    weights = numpy_v41.load_reference_weights(
        tiny_ckpt, keep=lambda n: n.startswith(("layers.", "embed.", "head.", "norm.")))
    token_map, _ = compressed_token_map(tiny_ckpt / "tokenizer.json", int(config["text_config"]["vocab_size"]))
    state = {"layer": -1, "done": False}
    orig_top, orig_block = numpy_v41._top_indices, numpy_v41.block

    def block(x, carried, w, plan, *a, **k):
        state["layer"] = plan.layer_id
        return orig_block(x, carried, w, plan, *a, **k)

    def top(values, k):
        chosen = orig_top(values, k)
        if sys._getframe(1).f_code.co_name == "select_topk" and state["layer"] == 8 and not state["done"]:
            order = np.argsort(-values[-1], kind="stable")
            assert np.isfinite(values[-1][order[k]]), "layer 8 must have a real choice at the last position"
            chosen = chosen.copy()
            chosen[-1, k - 1] = order[k]  # the runner-up replaces the k-th pick
            state["done"] = True
        return chosen

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numpy_v41, "_top_indices", top)
        mp.setattr(numpy_v41, "block", block)
        r = numpy_v41.reference_forward(config, weights, prompts[1], token_map)
    assert state["done"]
    flipped = list(ref.prompts)
    flipped[1] = cmp.PromptDump(np.asarray(prompts[1]), r["logits"].astype(np.float32),
                                tuple(h.astype(np.float32) for h in r["hidden"]))
    rep = cmp.compare_dumps(ours, cmp.Dump(tuple(flipped)))
    assert rep.first_layer_over(LAYER_REL_BOUND) == 8
    assert rep.worst("layer8").max_rel > 1e-3 and rep.worst("layer8").prompt == 1
    assert rep.worst("layer7").max_rel < LAYER_REL_BOUND


def test_cli_compare_and_dump_on_the_tiny_model(tiny_dumps, tiny_ckpt, prompts_file, tmp_path, capsys):
    _, ours, _, _, out = tiny_dumps
    dump_path, plot = tmp_path / "cli_ours.npz", tmp_path / "cli.png"
    rc = cmp.main(["compare", "--model", str(tiny_ckpt), "--prompts", str(prompts_file), "--ref",
                   str(out / "ref.safetensors"), "--dump", str(dump_path), "--plot", str(plot), "--quiet",
                   "--max-layer-rel", str(LAYER_REL_BOUND), "--min-top1", "1", "--max-kl", "1e-9"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "layer11" in text and plot.exists()
    cli_dump = cmp.load_dump(dump_path)
    assert cli_dump.metadata["config"] == "tiny-v41" and cli_dump.metadata["model_revision"].startswith("sha256:")
    # the same jitted prefill, the same inputs: bitwise the library's dump
    for a, b in zip(cli_dump.prompts, ours.prompts):
        assert np.array_equal(a.logits, b.logits) and all(np.array_equal(x, y) for x, y in zip(a.hidden, b.hidden))
    # an impossible bound fails with exit status 1 (prompts taken from the reference dump this time)
    rc = cmp.main(["compare", "--model", str(tiny_ckpt), "--ref", str(out / "ref.safetensors"), "--quiet",
                   "--max-layer-rel", "1e-9"])
    assert rc == 1 and "THRESHOLD VIOLATED: layer0" in capsys.readouterr().out
    rc = cmp.main(["dump", "--model", str(tiny_ckpt), "--prompts", str(prompts_file), "--out",
                   str(tmp_path / "d.safetensors"), "--quiet"])
    d = cmp.load_dump(tmp_path / "d.safetensors")
    assert rc == 0 and d.n_layers == 12 and np.array_equal(d.prompts[1].hidden[5], ours.prompts[1].hidden[5])
