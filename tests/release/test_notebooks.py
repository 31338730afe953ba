"""The notebooks run top to bottom, in a kernel of this interpreter (a kernel spec in a temporary
folder), show no warning or machine path, and are committed without outputs (clear them with
``nbstripout notebooks/*.ipynb``). ``CLIPJAX_NOTEBOOK_OUT`` keeps the executed copies."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

# Slow, `make test` skips it: training runs, plots.
pytestmark = pytest.mark.slow

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds; a whole notebook takes well under a minute
KERNEL = "clipjax-test"


def test_the_notebooks_are_there() -> None:
    names = {path.name for path in NOTEBOOKS}
    assert {"quickstart.ipynb", "spike_mitigation.ipynb"} <= names


def kernel_manager(folder: Path):
    """A kernel manager whose only kernel runs ``sys.executable -m ipykernel_launcher``."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = folder / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    specs = KernelSpecManager(kernel_dirs=[str(folder / "kernels")])
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel inherits this environment: clipjax importable from the checkout
    # (whether or not it is installed), and ipykernel's own inline matplotlib
    # backend (figures become outputs) whatever MPLBACKEND says.
    python_path = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in python_path if p))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    # Connection files and IPython's profile in the test's folder, not $HOME.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        km=kernel_manager(tmp_path),
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on failure
    # The executed notebooks are pages of the docs: a warning names the kernel's temporary file.
    shown = [
        (i, output.get("text", "") + str(output.get("data", {}).get("text/plain", "")))
        for i, cell in enumerate(notebook.cells)
        for output in cell.get("outputs", [])
    ]
    bad = [
        f"cell {i}: {text.strip()[:200]}"
        for i, text in shown
        if "Warning" in text or "/tmp/" in text or str(tmp_path) in text
    ]
    assert not bad, f"{path.name} shows warnings or machine paths:\n" + "\n".join(bad)
    out = os.environ.get("CLIPJAX_NOTEBOOK_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, Path(out) / path.name)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_stripped(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    dirty = [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: code cells {dirty} have outputs or execution counts; "
        f"strip them (nbstripout {path.relative_to(ROOT)}) before committing"
    )
    assert "widgets" not in notebook.metadata, f"{path.name}: widget state in metadata"
