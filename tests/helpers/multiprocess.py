"""Run a script of examples/ or tests/workers/ on several local processes (torchrun, gloo on CPU) and read back what
each rank wrote.

The scripts take the output folder as their first argument and end with `results.finish` (examples/results.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[2]
SCRIPT_FOLDERS = (ROOT / "examples", ROOT / "tests" / "workers")


def torchrun(script: str, nproc: int, output_dir: Path, *args: str, timeout: float = 300) -> list[dict]:
    """Run `<script> OUTPUT_DIR *ARGS` on `nproc` processes; return each rank's result, in rank order."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"]
    return launch(launcher, script, output_dir, *args, timeout=timeout)


def launch(launcher: list[str], script: str, output_dir: Path, *args: str, timeout: float = 300) -> list[dict]:
    """Run `<script> OUTPUT_DIR *ARGS` (from examples/, else tests/workers/) under a launcher command (torchrun,
    `accelerate launch ...`)."""
    path = next(folder / script for folder in SCRIPT_FOLDERS if (folder / script).is_file())
    command = [*launcher, str(path), str(output_dir), *args]
    python_path = os.pathsep.join([*map(str, SCRIPT_FOLDERS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    files = sorted(Path(output_dir).glob("rank*.json"), key=lambda path: int(path.stem.removeprefix("rank")))
    return [json.loads(path.read_text()) for path in files]


def assert_same_losses(actual: list[float], expected: list[float], rtol: float, what: str) -> None:
    """Per-step losses of a multi-process run against one process, and a curve that goes down."""
    a, e = torch.tensor(actual), torch.tensor(expected)
    assert a.shape == e.shape, f"{what}: {len(actual)} steps vs {len(expected)}"
    diff = (a - e).abs()
    assert torch.allclose(a, e, rtol=rtol, atol=0), (
        f"{what}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e} (rtol={rtol})"
    )
    assert e[-1] < e[0], f"{what}: the loss curve should go down: {expected}"
