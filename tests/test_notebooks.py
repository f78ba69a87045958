"""The notebooks run top to bottom with no download and are committed without outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
TIMEOUT_S = 300  # per cell


def test_notebooks_found():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_lora_finetuning.ipynb", "03_attention_maps.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    dirty = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": tmp_path}}  # the working directory: runs/ and PNGs land in tmp_path
    # execute() raises CellExecutionError, with the failing cell and its traceback, on any error
    NotebookClient(notebook, timeout=TIMEOUT_S, kernel_name="python3", resources=resources).execute()
    if path.stem == "03_attention_maps":
        png = tmp_path / "attention_maps.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "attention map PNG not written"
        assert png.stat().st_size > 20_000, f"PNG suspiciously small: {png.stat().st_size} bytes"
