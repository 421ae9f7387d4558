"""The dense-FP8 split-K benchmark's CPU smoke run (``benchmarks/dense_fp8_gpu.py --tiny``): the grouped-GEMM
kernel in the Mosaic GPU interpreter, K split into groups with the partials summed in a fixed order, in both
operand forms (bf16-dequantized weights, E4M3 weights with E4M3 rows), against the XLA einsum on the
bf16-held weights the engine uses now."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow
def test_split_k_kernel_matches_the_bf16_einsum_and_keeps_rows_independent(tmp_path):
    import dense_fp8_gpu

    assert dense_fp8_gpu.main(["--tiny", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "dense_fp8_gpu.json").read_text())["rows"]
    assert {r["splits"] for r in rows} >= {1, 2, 4}
    assert {r["groups"] for r in rows} == {1, 2}
    assert {r["operands"] for r in rows} == {"bf16", "e4m3"}    # both forms of the FP8 weights
    for r in rows:
        # the script's own bound (2^-7 of the largest output: one bf16 step of rounding either side);
        # a wrong split, group or scale block moves outputs by their own size
        assert r["max_rel_diff"] <= 2.0 ** -7, r
        assert r["row0_invariant"], r
