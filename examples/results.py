"""What the example scripts leave behind: each process's results as OUTPUT_DIR/rank<r>.json."""

import json
import os
import sys
from pathlib import Path

import torch


def finish(output_dir: str | Path, results: dict) -> None:
    """End a training script: each process writes OUTPUT_DIR/rank<r>.json; under torchrun every process then leaves
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
