"""Every notebook under notebooks/ runs top to bottom on CPU, in a kernel on this interpreter (outputs are
stripped in git)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "deepinfer-jax-tests"
# What some notebooks must show besides running (their own asserts check the claims; these check that the
# cells that print/plot the evidence really ran): text in the stream outputs, and the number of figures.
EXPECTED = {
    "batch_invariance": {"text": ["admitted last of 9, others reversed", "bitwise equal: True", "B=1 vs B=8:"],
                         "figures": 0},
    "architecture": {"text": ["V4.1-Flash: 40 layers", "at deployment precision",
                              "layers with their own index queries: [2, 4, 6, 8, 10]"], "figures": 2},
}


@pytest.fixture
def this_interpreter_kernel(tmp_path, monkeypatch):
    """A kernelspec for sys.executable, found first on JUPYTER_PATH: the notebooks run on the interpreter
    (and venv) running the tests, whatever kernels the machine has installed."""
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "deepinfer-jax tests", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # the kernel compiles the same engine programs as the engine tests: share their on-disk cache
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".pytest_cache" / "jax_compilation_cache"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    return KERNEL


def test_there_are_notebooks():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "compare", *EXPECTED} <= names, f"missing notebooks; found {sorted(names)}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, this_interpreter_kernel):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells
               if c.cell_type == "code"), f"{path.name}: strip the outputs before committing"
    client = NotebookClient(nb, timeout=600, kernel_name=this_interpreter_kernel,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    if path.stem in EXPECTED:
        outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        text = "".join(o.get("text", "") for o in outs if o.output_type == "stream")
        for want in EXPECTED[path.stem]["text"]:
            assert want in text, f"{path.name}: no output contains {want!r}"
        assert "bitwise equal: False" not in text
        figures = sum("image/png" in o.get("data", {}) for o in outs)
        assert figures == EXPECTED[path.stem]["figures"], f"{path.name}: {figures} figures"
