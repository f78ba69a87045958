"""The code a saved folder ships (what a Hub user downloads with trust_remote_code) stands alone: it names no file
the folder lacks, and no project path or history (issue #30)."""

import re
from pathlib import Path

import pytest
from helpers import build_stack

FILE_NAME = re.compile(r"(?<![\w.])((?:[\w-]+/)*[\w-]+\.(?:py|md|json|txt|yaml|yml|ipynb|safetensors|bin|pt))\b")
PROJECT_PATH = re.compile(r"\b(?:docs|benchmarks|tests|examples|configs|notebooks|tools)/")
HISTORY = re.compile(r"\b(?:transformers|torch|triton) *[<>=]* *\d+\.\d+|issue #\d+", re.IGNORECASE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hub") / "model"
    build_stack("sdpa", "V1-GQA").save_pretrained(path)
    return path


def shipped_code(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(folder.glob("*.py"))}


def test_the_folder_ships_the_model_code(folder):
    assert {"modeling_diff.py", "configuration_diff.py", "kernel_tiled.py", "kernel_diff_flash.py"} <= set(
        shipped_code(folder)), sorted(shipped_code(folder))
    assert "kernel_naive.py" not in shipped_code(folder), "the test reference is no part of the model"


@pytest.mark.parametrize("name", ["modeling_diff.py", "configuration_diff.py", "kernel_tiled.py",
                                  "kernel_diff_flash.py", "diff_tensor_parallel.py", "peft_defaults.py",
                                  "folder_defaults.py", "paged_cache.py", "kernel_tiles.py"])
def test_shipped_file_names_only_what_the_folder_holds(folder, name):
    text = shipped_code(folder)[name]
    present = {path.name for path in folder.iterdir()}
    missing = sorted({ref for ref in FILE_NAME.findall(text) if ref.rpartition("/")[2] not in present})
    assert not missing, f"{name} names files a saved folder lacks: {missing}"
    paths = [text[max(0, m.start() - 40): m.end() + 20] for m in PROJECT_PATH.finditer(text)]
    assert not paths, f"{name} points into the project's tree: {paths}"
    history = [text[max(0, m.start() - 40): m.end() + 20] for m in HISTORY.finditer(text)]
    assert not history, f"{name} carries versions or history: {history}"
