"""``benchmarks/quant_rounding_gpu.py`` on the CPU backend: every rounding row 0 (XLA:CPU keeps cast pairs and
rounds as written), so a GPU run's nonzero rows are the GPU's. The scalar-division row is informational."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_quant_rounding_script_rows_are_zero_on_the_cpu(tmp_path, monkeypatch):
    import quant_rounding_gpu

    monkeypatch.setenv("OUT", str(tmp_path))
    out = quant_rounding_gpu.main()
    assert out["values"] == 64 * 5120
    rows = {k: v for k, v in out.items() if k.endswith("_mismatches") and "div_by_scalar" not in k}
    assert len(rows) == 9
    assert all(v == 0 for v in rows.values()), rows
    assert (tmp_path / "quant_rounding_gpu.json").exists()
