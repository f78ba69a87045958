"""The GPU suite's CPU-safe parts: its steps, their arguments, and what it says without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BENCHMARKS, load_benchmark


def run_suite(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / "gpu_suite.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCHMARKS.parent)


def test_list_names_every_step_and_runs_nothing():
    done = run_suite("--list")
    assert done.returncode == 0, done.stderr
    suite = load_benchmark("gpu_suite")
    assert [line.split(" ")[0] for line in done.stdout.splitlines()] == list(suite.STEPS)


def test_steps_exist_and_their_arguments_parse(monkeypatch):
    """Every test file exists, and each benchmark step's arguments parse with that benchmark's own parser."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # bench_tiles imports bench_attention and kernel_fit
    suite = load_benchmark("gpu_suite")
    assert all((BENCHMARKS.parent / path).exists() for path in suite.GPU_TESTS)
    parsers = {f"{name}.py": load_benchmark(name).parse_args
               for name in ("bench_attention", "bench_model", "bench_tiles")}
    assert sum(step.limit for step in suite.STEPS.values()) <= 9 * 60  # one device command may run 10 minutes
    for name, step in suite.STEPS.items():
        for command in (step.command, step.rehearsal):
            if name != "tests":
                parsers[Path(command[1]).name](command[2:])  # argparse exits on an unknown argument or choice
            assert Path(command[1]).name == Path(step.command[1]).name  # the rehearsal runs the step's own script


def test_a_bad_step_is_an_argument_error():
    done = run_suite("--steps", "nonsense")
    assert done.returncode == 2 and "invalid choice: 'nonsense'" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    done = run_suite("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run. The CPU suite is "
        "`bash .ci/run`; --rehearse runs this suite's steps on the CPU at tiny shapes; --list shows them."]
    assert not (tmp_path / "out").exists()


@pytest.mark.rehearsal
@pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal is the CPU's stand-in for a GPU run")
def test_the_rehearsal_runs_every_step_through_diff_flash(tmp_path):
    """`--rehearse` (CI's floor pass: the torch, Triton and transformers of the GPU machines): every step's own
    script end to end on this CPU, diff_flash under Triton's interpreter, each table and target line written."""
    suite = load_benchmark("gpu_suite")
    done = run_suite("--rehearse", "--out", str(tmp_path), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = (tmp_path / "summary.md").read_text().splitlines()[4:]
    assert [row.split(" | ")[:2] for row in rows] == [[f"| {name}", "ok"] for name in suite.STEPS], rows
    for step in ("attention-d64", "attention-d128"):
        text = (tmp_path / f"{step}.md").read_text()
        timed = [line for line in text.splitlines() if line.startswith("| 32 | diff_flash | ")]
        assert len(timed) == 2 and "skipped" not in "".join(timed), timed  # the prefill and the decode table
        assert "seq 32 fwd+bwd: diff_flash at" in text and "seq 32 decode step: diff_flash at" in text
        assert "profile of one forward+backward: diff_flash, seq 32" in text
    model = (tmp_path / "model.md").read_text()
    assert "| diff-diff_flash |" in model and "target: diff-diff_flash at" in model
    tiles = (tmp_path / "tiles.md").read_text()
    assert [line.split(" | ")[2] for line in tiles.splitlines() if " shipped | " in line] == ["fwd", "dq", "dkdv"]
    assert "faster than shipped by 5% or more:" in tiles


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or TRITON_INTERPRET=1")
def test_a_tile_in_place_is_the_tile_that_runs(monkeypatch):
    """bench_tiles swaps one kernel's unmasked tile in the shipped table and restores it: the kernel's own lookup
    returns the swapped tile inside, the shipped one after, and the padding-mask tile is untouched."""
    import diff_transformer.kernel_diff_flash as kernels

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_tiles = load_benchmark("bench_tiles")
    if not torch.cuda.is_available():
        monkeypatch.setattr(kernels, "INTERPRETER_TARGET", 90)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    family = bench_tiles.family_of(90 if device.type == "cpu" else kernels.device_target(0))
    key, other = (family, "bf16", 64, 128, "fwd"), (16, 16, 4, 1)
    shipped = kernels.TILES[key]
    with bench_tiles.tile_in_place(key, other):
        assert kernels._tiles("fwd", 64, 128, torch.bfloat16, device) == other
        assert kernels._tiles("fwd", 64, 128, torch.bfloat16, device, masked=True) == shipped[1]
    assert kernels.TILES[key] == shipped and kernels._tiles("fwd", 64, 128, torch.bfloat16, device) == shipped[0]


def test_target_lines_set_diff_flash_against_the_right_rows():
    """bench_attention's target lines: speed over the two-call path (its time / diff_flash's), time over standard
    attention's (diff_flash's / the reference's), forward+backward for the first two, forward for the decode step."""
    bench = load_benchmark("bench_attention")
    two_calls = f"sdpa ({bench.TWO_CALLS}, DiffLlama's route)"
    prefill = {4096: {bench.REFERENCE: (1.0, 2.0), two_calls: (3.0, 6.0), bench.DIFF_FLASH: (1.5, 2.4)},
               1024: {bench.REFERENCE: (1.0, 2.0), two_calls: (3.0, 6.0)}}  # no diff_flash row: no line
    decode = {4096: {bench.REFERENCE: (0.010, None), bench.DIFF_FLASH: (0.0115, None)}}
    assert bench.target_lines(prefill, decode) == [
        "seq 4096 fwd+bwd: diff_flash at 2.50x the two-call path's speed (target 1.5 at seq >= 4096), 1.20x standard "
        "attention's time (target 1.3 or less)",
        "seq 4096 decode step: diff_flash at 1.15x standard attention's time (target 1.1 or less)"]


def test_a_step_past_its_limit_keeps_what_it_printed(tmp_path, monkeypatch):
    """A step stopped at its time limit: its row says so, and the rows it printed before are in its file and in the
    summary row (a benchmark prints each row as it is measured)."""
    suite = load_benchmark("gpu_suite")
    script = "import time; print('seq 4096 fwd+bwd: diff_flash at 1.62x', flush=True); time.sleep(30)"
    monkeypatch.setitem(suite.STEPS, "slow-step", suite.Step([sys.executable, "-c", script], 3, []))
    row = suite.run_step("slow-step", tmp_path, rehearse=False)
    assert row.startswith("| slow-step | stopped at its 3 s limit | ") and "diff_flash at 1.62x" in row, row
    text = (tmp_path / "slow-step.md").read_text()
    assert "\n\nseq 4096 fwd+bwd: diff_flash at 1.62x\n" in text, text  # the text, not the repr of its bytes
