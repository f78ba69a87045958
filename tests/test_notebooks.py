"""The notebooks run top to bottom with no download, and their committed outputs match what the code prints now
(notebooks/outputs.py: numbers within its stated tolerance, images of the same size where the stored ones are)."""

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("notebook_outputs", ROOT / "notebooks" / "outputs.py")
outputs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(outputs)
NOTEBOOKS = outputs.NOTEBOOKS


def test_notebooks_found():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_lora_finetuning.ipynb", "03_attention_maps.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_with_outputs_and_pictures(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    empty = [i for i, c in enumerate(code) if not c.outputs and "print(" in c.source]
    assert not empty, f"{path.name}: code cells {empty} print but have no stored output; run notebooks/outputs.py"
    images = [o for c in code for o in c.outputs if outputs.png_size(o)]
    assert images or path.stem == "02_lora_finetuning", f"{path.name}: no picture stored"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_matches_its_stored_outputs(path, tmp_path):
    # execute() raises CellExecutionError, with the failing cell and its traceback, on any error
    fresh = outputs.execute(path, tmp_path)
    problems = outputs.differences(nbformat.read(path, as_version=4), fresh)
    assert not problems, f"{path.name} prints other outputs than it stores (run python notebooks/outputs.py):\n" + \
        "\n".join(problems)
    if path.stem == "03_attention_maps":
        png = tmp_path / "attention_maps.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "attention map PNG not written"
        assert png.stat().st_size > 20_000, f"PNG suspiciously small: {png.stat().st_size} bytes"


def test_a_changed_number_or_text_is_caught():
    """The comparison itself: a number beyond the tolerance, changed words and a lost image are reported."""
    cell = lambda *outs: nbformat.v4.new_code_cell("x", outputs=list(outs))
    stream = lambda text: nbformat.v4.new_output("stream", name="stdout", text=text)
    stored = nbformat.v4.new_notebook(cells=[cell(stream("accuracy 0.95 after 1.2 s\n"))])
    same = nbformat.v4.new_notebook(cells=[cell(stream("accuracy 0.96 after 3.4 s\n"))])
    assert outputs.differences(stored, same) == []
    moved = nbformat.v4.new_notebook(cells=[cell(stream("accuracy 0.55 after 1.2 s\n"))])
    assert outputs.differences(stored, moved) == ["code cell 0: number 0.95 -> 0.55"]
    worded = nbformat.v4.new_notebook(cells=[cell(stream("loss 0.95 after 1.2 s\n"))])
    assert "text changed" in outputs.differences(stored, worded)[0]
    assert "outputs" in outputs.differences(stored, nbformat.v4.new_notebook(cells=[cell()]))[0]


def test_a_print_the_kernel_sent_in_pieces_matches_its_stored_output():
    """Under load the kernel's flush timer can split one print into two stdout messages: still the same output;
    a piece that changed, or an image between the pieces, is still reported."""
    cell = lambda *outs: nbformat.v4.new_code_cell("x", outputs=list(outs))
    stream = lambda text: nbformat.v4.new_output("stream", name="stdout", text=text)
    image = nbformat.v4.new_output("display_data", data={"text/plain": "<Figure>"})
    stored = nbformat.v4.new_notebook(cells=[cell(stream("identical logits after reload: True\n"))])
    split = nbformat.v4.new_notebook(cells=[cell(stream("identical logits "), stream("after reload: True\n"))])
    assert outputs.differences(stored, split) == []
    changed = nbformat.v4.new_notebook(cells=[cell(stream("identical logits "), stream("after reload: False\n"))])
    assert "text changed" in outputs.differences(stored, changed)[0]
    apart = nbformat.v4.new_notebook(cells=[cell(stream("identical logits "), image, stream("after reload: True\n"))])
    assert "outputs" in outputs.differences(stored, apart)[0]
