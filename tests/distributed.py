"""Run a script of tests/ on several local processes (torchrun, gloo on CPU) and collect what each rank reports.

A script takes its output folder as first argument and ends with `finish(output_dir, result)`.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).parent


def launch(script: str, nprocs: int, *args: str, timeout: float = 600) -> list[dict]:
    """Run `tests/<script> OUTPUT_DIR *args` on `nprocs` processes; return each rank's result, in rank order."""
    with tempfile.TemporaryDirectory() as output_dir:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), "--standalone",
            str(TESTS / script), output_dir, *args,
        ]
        path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        return [json.loads(Path(output_dir, f"rank{rank}.json").read_text()) for rank in range(nprocs)]


def finish(output_dir: str, result: dict) -> None:
    """End a script: write this rank's result, leave the process group and exit without finalizing the interpreter.

    A gloo worker thread frees each finished collective after wait() has returned and takes the GIL to do so; if the
    interpreter is finalizing by then, the process sometimes aborts ("terminate called without an active exception").
    `os._exit` leaves no such window.
    """
    rank = torch.distributed.get_rank()
    Path(output_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
