"""The notebooks in notebooks/ are stored without outputs and run top to bottom on a CPU.

They run with JAX_QTRAIN_NOTEBOOK_SMALL=1, which a notebook that trains for a while reads to
train fewer steps (03_moe_training: 12 instead of 40); every cell still runs. Their kernels
share the suite's persistent compilation cache (tests/conftest.py exports it)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
PLOTS = {
    "01_formats_explorer": 2,
    "02_backward_overrides": 1,
    "03_moe_training": 2,
    "04_sharded_weights": 2,
}


def test_there_are_notebooks():
    names = [path.name for path in NOTEBOOKS]
    assert names == [f"{stem}.ipynb" for stem in PLOTS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: clear the outputs before committing"
            )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_runs_without_errors(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' run directories land here
    monkeypatch.setenv("JAX_QTRAIN_NOTEBOOK_SMALL", "1")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError with the cell and traceback on a failure
    images = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]
    assert len(images) == PLOTS[path.stem], f"{path.name} drew {len(images)} plots"
