"""Every GPU test and the GPU benchmarks in one command, for a machine with a CUDA GPU (under 9 minutes). Each
step's output goes to OUT/<step>.md and one line per step to OUT/summary.md (rewritten after each step), with the
benchmarks' target lines (docs/kernels.md) in it.

    python benchmarks/gpu_suite.py --out gpu-results            # everything
    python benchmarks/gpu_suite.py --out gpu-results --steps tests attention-d128
    python benchmarks/gpu_suite.py --list                       # the steps and their commands; runs nothing
    python benchmarks/gpu_suite.py --rehearse --out rehearsal   # every step on a CPU, tiny shapes (a few minutes)

Run it from the repository root with the package importable (`pip install -e .`, or PYTHONPATH=.). Without a GPU it
says so and exits with status 2 (unless --rehearse); a failing step makes the exit status 1, the other steps still
run. The rehearsal runs each step's own scripts through the same code paths, diff_flash under Triton's
interpreter, so that a GPU's minutes are not spent on a typo or a version difference.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
# The tests that run on CUDA when it is there (tests/conftest.py sets TRITON_INTERPRET only without it); -m "" also
# runs those marked slow and gpu.
GPU_TESTS = ["tests/test_diff_flash_kernel.py", "tests/test_backends.py", "tests/test_attention_functions.py",
             "tests/test_kernel_selection.py", "tests/test_compile.py", "tests/test_gda.py", "tests/test_modeling.py"]
SEQS = ["1024", "4096", "16384"]
MODELS = ["--models", "diff-sdpa", "diff-diff_flash", "diffllama-sdpa", "llama-sdpa"]
TINY_ATTENTION = ["--heads", "1", "--kv-heads", "1", "--seqs", "32", "--repeats", "1"]
# flex_attention compiles for every length, eager materialises 16K x 16K maps: the tests step checks both; the
# timing steps keep to what the targets read (diff_flash, the two-call path, standard attention) and V2
SKIP = ["--skip", "eager", "flex_attention"]


@dataclass(frozen=True)
class Step:
    command: list[str]  # on the GPU
    limit: int  # seconds; a step past it is stopped, what it printed kept
    rehearsal: list[str]  # the same code paths on a CPU under TRITON_INTERPRET=1, at tiny shapes (--rehearse)


# In the order of their worth; the limits add up to 9 minutes, what one device command may take with its start-up.
STEPS: dict[str, Step] = {
    # 8 test processes (pytest-xdist; the GPU machines' image has it): most of these tests run on the CPU's cores;
    # -v prints each result as it lands, so a step stopped at its limit still says what passed
    "tests": Step([PY, "-m", "pytest", "-v", "-n", "8", "-m", "", "-p", "no:cacheprovider", *GPU_TESTS], 180,
                  [PY, "-m", "pytest", "-q", "-n", "2", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TESTS]),
    "attention-d64": Step([PY, "benchmarks/bench_attention.py", "--dtype", "bf16", "--head-dim", "64", "--seqs", *SEQS,
                           "--decode", "--profile", *SKIP], 80,
                          [PY, "benchmarks/bench_attention.py", "--dtype", "bf16", "--head-dim", "64", *TINY_ATTENTION,
                           "--decode", "--profile", *SKIP]),
    "attention-d128": Step([PY, "benchmarks/bench_attention.py", "--dtype", "bf16", "--head-dim", "128", "--heads", "4",
                            "--kv-heads", "4", "--seqs", *SEQS, "--decode", "--profile", *SKIP], 80,
                           [PY, "benchmarks/bench_attention.py", "--dtype", "bf16", "--head-dim", "128",
                            *TINY_ATTENTION, "--decode", "--profile", *SKIP]),
    "model": Step([PY, "benchmarks/bench_model.py", "--seq", "4096", "--batch", "1", "--repeats", "4", *MODELS], 120,
                  [PY, "benchmarks/bench_model.py", "--hidden", "128", "--layers", "1", "--intermediate", "256",
                   "--vocab", "512", "--seq", "32", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
                   *MODELS]),
    "tiles": Step([PY, "benchmarks/bench_tiles.py", "--seq", "4096", "--alternatives", "2"], 80,
                  [PY, "benchmarks/bench_tiles.py", "--target", "90", "--head-dims", "64", "--seq", "32", "--repeats",
                   "1", "--alternatives", "1"]),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-results"), help="folder for the step outputs")
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS))
    parser.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    parser.add_argument("--rehearse", action="store_true",
                        help="run every step on this CPU under TRITON_INTERPRET=1 at tiny shapes (times mean nothing)")
    return parser.parse_args(argv)


def run_step(name: str, out: Path, rehearse: bool) -> str:
    """Run one step with its time limit; its output to out/<name>.md; the summary row."""
    step = STEPS[name]
    command = step.rehearsal if rehearse else step.command
    environment = {**os.environ, "TRITON_INTERPRET": "1"} if rehearse else None
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=None if rehearse else step.limit,
                              env=environment)
        status, text = ("ok" if done.returncode == 0 else f"failed (exit {done.returncode})"), done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:  # what the step printed before it was stopped (bytes on some Pythons)
        status, text = f"stopped at its {step.limit} s limit", "".join(map(as_text, (error.stdout, error.stderr)))
    (out / f"{name}.md").write_text(f"command: {shlex.join(command)}\n\n{text}")
    return f"| {name} | {status} | {time.perf_counter() - start:.0f} | {summary_line(text)[:600]} |"


def as_text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def summary_line(text: str) -> str:
    """What a step's summary row shows: its target lines (joined), else its last line."""
    targets = [line for line in text.splitlines() if line.startswith(("seq ", "target: ", "faster than shipped"))]
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    return "; ".join(targets) if targets else last.replace("|", "/")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name in args.steps:
            step = STEPS[name]
            print(f"{name} ({step.limit} s): {shlex.join(step.rehearsal if args.rehearse else step.command)}")
        return 0
    import torch

    if not (torch.cuda.is_available() or args.rehearse):
        print("gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run. "
              "The CPU suite is `bash .ci/run`; --rehearse runs this suite's steps on the CPU at tiny shapes; "
              "--list shows them.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = ["| step | result | seconds | targets, or the last line |", "|---|---|---:|---|"]
    where = ("a rehearsal on the CPU under TRITON_INTERPRET=1 (times mean nothing)" if args.rehearse
             else f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    header = f"{where}, torch {torch.__version__}, command: {shlex.join(['python', *sys.argv])}"
    print(header, flush=True)
    for name in args.steps:
        rows.append(run_step(name, args.out, args.rehearse))
        print(rows[-1], flush=True)
        (args.out / "summary.md").write_text(header + "\n\n" + "\n".join(rows) + "\n")
    return 0 if all("| ok |" in row for row in rows[2:]) else 1


if __name__ == "__main__":
    sys.exit(main())
