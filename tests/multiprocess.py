"""Run a script of tests/ on several local processes (torchrun, gloo on CPU) and read back what each rank wrote.

The scripts take the output folder as their first argument and end with `finish`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def torchrun(script: str, nproc: int, output_dir: Path, *args: str, timeout: float = 300) -> list[dict]:
    """Run `tests/<script> OUTPUT_DIR *ARGS` on `nproc` processes; return each rank's result, in rank order."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"]
    return launch(launcher, script, output_dir, *args, timeout=timeout)


def launch(launcher: list[str], script: str, output_dir: Path, *args: str, timeout: float = 300) -> list[dict]:
    """Run `tests/<script> OUTPUT_DIR *ARGS` under a launcher command (torchrun, `accelerate launch ...`)."""
    command = [*launcher, str(Path(__file__).with_name(script)), str(output_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    files = sorted(Path(output_dir).glob("rank*.json"), key=lambda path: int(path.stem.removeprefix("rank")))
    return [json.loads(path.read_text()) for path in files]


def finish(output_dir: str | Path, results: dict) -> None:
    """End a script of tests/: each process writes OUTPUT_DIR/rank<r>.json; under torchrun every process then leaves
    the process group and exits without returning."""
    distributed = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    Path(output_dir, f"rank{rank}.json").write_text(json.dumps(results))
    if distributed:
        torch.distributed.destroy_process_group()
        # A gloo worker thread frees each finished collective after wait() has returned, and takes the GIL to drop
        # its tensors; if the interpreter is finalizing by then, the thread is killed inside C++ and the process
        # aborts ("terminate called without an active exception", pytorch/pytorch#190489; about 1 run in 30 here,
        # explicit destroy_process_group or not). Exiting without finalizing leaves no such window.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def assert_same_losses(actual: list[float], expected: list[float], rtol: float, what: str) -> None:
    """Per-step losses of a multi-process run against one process, and a curve that goes down."""
    a, e = torch.tensor(actual), torch.tensor(expected)
    assert a.shape == e.shape, f"{what}: {len(actual)} steps vs {len(expected)}"
    diff = (a - e).abs()
    assert torch.allclose(a, e, rtol=rtol, atol=0), (
        f"{what}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e} (rtol={rtol})"
    )
    assert e[-1] < e[0], f"{what}: the loss curve should go down: {expected}"
