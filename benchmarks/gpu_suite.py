"""Every GPU test and the GPU benchmarks in one command, for a machine with a CUDA GPU (planned for under 10
minutes on an H100). Each step's output goes to OUT/<step>.md and one line per step to OUT/summary.md.

    python benchmarks/gpu_suite.py --out gpu-results            # everything
    python benchmarks/gpu_suite.py --out gpu-results --steps tests attention-d128
    python benchmarks/gpu_suite.py --list                       # the steps and their commands; runs nothing

Run it from the repository root with the package importable (`pip install -e .`, or PYTHONPATH=.). Without a GPU it
says so and exits with status 2; a failing step makes the exit status 1, the other steps still run.
"""

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
# The tests that run on CUDA when it is there (tests/conftest.py sets TRITON_INTERPRET only without it); -m "" also
# runs those marked slow and gpu.
GPU_TESTS = ["tests/test_diff_flash_kernel.py", "tests/test_backends.py", "tests/test_attention_functions.py",
             "tests/test_kernel_selection.py", "tests/test_compile.py", "tests/test_modeling.py"]
SEQS = ["1024", "2048", "4096", "8192", "16384"]
# name -> (command, time limit in seconds); the limits add up to 9 minutes
STEPS: dict[str, tuple[list[str], int]] = {
    "tests": ([PY, "-m", "pytest", "-q", "-m", "", "-p", "no:cacheprovider", *GPU_TESTS], 210),
    "attention-d64": ([PY, "benchmarks/bench_attention.py", "--dtype", "bf16", "--head-dim", "64", "--seqs", *SEQS],
                      90),
    "attention-d128": ([PY, "benchmarks/bench_attention.py", "--dtype", "bf16", "--head-dim", "128", "--heads", "4",
                        "--kv-heads", "4", "--seqs", *SEQS], 90),
    "model": ([PY, "benchmarks/bench_model.py", "--seq", "4096", "--batch", "1", "--repeats", "4", "--models",
               "diff-sdpa", "diff-diff_flash", "diffllama-sdpa", "llama-sdpa"], 150),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-results"), help="folder for the step outputs")
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS))
    parser.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    return parser.parse_args(argv)


def run_step(name: str, out: Path) -> str:
    """Run one step with its time limit; its output to out/<name>.md; the summary row."""
    command, limit = STEPS[name]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
        status, text = ("ok" if done.returncode == 0 else f"failed (exit {done.returncode})"), done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        status, text = f"stopped at its {limit} s limit", f"{error.stdout or ''}{error.stderr or ''}"
    (out / f"{name}.md").write_text(f"command: {shlex.join(command)}\n\n{text}")
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return f"| {name} | {status} | {time.perf_counter() - start:.0f} | {last[:160]} |"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name in args.steps:
            print(f"{name} ({STEPS[name][1]} s): {shlex.join(STEPS[name][0])}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run. "
              "The CPU suite is `bash .ci/run`; --list shows this suite's steps.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = ["| step | result | seconds | last line |", "|---|---|---:|---|"]
    header = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"command: {shlex.join(['python', *sys.argv])}")
    for name in args.steps:
        rows.append(run_step(name, args.out))
        print(rows[-1], flush=True)
    (args.out / "summary.md").write_text(header + "\n\n" + "\n".join(rows) + "\n")
    return 0 if all("| ok |" in row for row in rows[2:]) else 1


if __name__ == "__main__":
    sys.exit(main())
