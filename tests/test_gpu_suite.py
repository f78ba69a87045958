"""The GPU suite's CPU-safe parts: its steps, their arguments, and what it says without a GPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_suite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / "gpu_suite.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=BENCHMARKS.parent)


def test_list_names_every_step_and_runs_nothing():
    done = run_suite("--list")
    assert done.returncode == 0, done.stderr
    suite = load("gpu_suite")
    assert [line.split(" ")[0] for line in done.stdout.splitlines()] == list(suite.STEPS)


def test_steps_exist_and_their_arguments_parse():
    """Every test file exists, and each benchmark step's arguments parse with that benchmark's own parser."""
    suite = load("gpu_suite")
    assert all((BENCHMARKS.parent / path).exists() for path in suite.GPU_TESTS)
    parsers = {f"{name}.py": load(name).parse_args for name in ("bench_attention", "bench_model")}
    assert sum(limit for _, limit in suite.STEPS.values()) <= 9 * 60  # one device command may run 10 minutes
    for name, (command, limit) in suite.STEPS.items():
        if name != "tests":
            script = Path(command[1]).name
            parsers[script](command[2:])  # argparse exits on an unknown argument or choice


def test_a_bad_step_is_an_argument_error():
    done = run_suite("--steps", "nonsense")
    assert done.returncode == 2 and "invalid choice: 'nonsense'" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    done = run_suite("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run. The CPU suite is "
        "`bash .ci/run`; --list shows this suite's steps."]
    assert not (tmp_path / "out").exists()
