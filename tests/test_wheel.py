"""The wheel: built from the checkout with pip, installed into a folder of its own, and used with no checkout on the
path: the package imports from the wheel's files, and the README's main job (train on the built-in task, reload,
generate) runs from it at toy size. The version has one source (diff_transformer/_version.py)."""

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
                            timeout=600, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, " ".join(command) + "\n" + result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the folder it is installed into, alone)."""
    root = tmp_path_factory.mktemp("wheel")
    # the venv's setuptools where it has one (no download); else pip's isolated build fetches it
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(root / "dist"), str(ROOT)],
        cwd=root)
    wheel = next((root / "dist").glob("diff_transformer-*.whl"))
    run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(root / "site"), str(wheel)],
        cwd=root)
    return wheel, root / "site"


def test_wheel_holds_every_module_of_the_checkout(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "diff_transformer").rglob("*.py")}
    modules |= {"diff_transformer_cli.py"}
    assert modules <= names, sorted(modules - names)
    from diff_transformer import __version__
    assert re.match(rf"diff_transformer-{re.escape(__version__)}-py3-none-any\.whl$", wheel.name), wheel.name


def test_main_job_runs_from_the_wheel(installed, tmp_path):
    """No checkout on the path (cwd elsewhere, the wheel's folder first): the package is the wheel's, and the
    README's main job trains, reloads and generates from it."""
    site = installed[1]
    env = {"PYTHONPATH": str(site)}
    where = run([sys.executable, "-c", "import diff_transformer, diff_transformer_cli; "
                 "print(diff_transformer.__file__); print(diff_transformer_cli.__file__)"], cwd=tmp_path, **env)
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    out = tmp_path / "tiny"
    trained = run([sys.executable, "-m", "diff_transformer_cli", "train", "--max-steps", "20", "--examples", "300",
                   "--output", str(out)], cwd=tmp_path, **env)
    assert "reloaded through AutoModelForCausalLM: DiffForCausalLM" in trained.stdout, trained.stdout
    generated = run([sys.executable, "-m", "diff_transformer_cli", "generate", str(out), "--prompt",
                     "k3 v7 k9 v2 ? k9", "--max-new-tokens", "1"], cwd=tmp_path, **env)
    assert re.search(r"^generated: k3 v7 k9 v2 \? k9 \S+$", generated.stdout, flags=re.MULTILINE), generated.stdout
