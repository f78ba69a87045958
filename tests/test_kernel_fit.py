"""diff_flash fits the GPUs people train on, checked without one (issue #29).

Every tile the kernel ships is compiled ahead of time for sm_80, sm_86, sm_89 and sm_90 (benchmarks/kernel_fit.py,
in a process without TRITON_INTERPRET) and must fit the target's shared memory without spilling a register; a
combination without a tile is routed to the standard calls with one warning, and its output equals eager's.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close, build_stack

import diff_transformer.kernel_diff_flash as kernels
from diff_transformer.modeling_diff import DIFF_FLASH, select_kernel

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "kernel_fit.py"
spec = importlib.util.spec_from_file_location("kernel_fit", SCRIPT)
kernel_fit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_fit)


@pytest.mark.skipif(kernels.triton is None, reason="needs triton")
def test_every_shipped_tile_compiles_fits_and_does_not_spill(tmp_path):
    """fp16 stands for bf16 (identical figures), fp32 has its own tiles; each kernel in each masking mode."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(tmp_path / "fit.json")], env=env,
                          capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert (tmp_path / "fit.json").exists(), done.stderr[-3000:]
    rows = json.loads((tmp_path / "fit.json").read_text())
    failed = [row for row in rows if row["error"]]
    assert not failed, "tiles that do not fit:\n" + kernel_fit.table(failed)
    covered = {(row["target"], row["head_dim"], row["value_dim"], row["dtype"]) for row in rows}
    assert covered == {(target, d, factor * d, dtype) for target in kernel_fit.TARGETS
                       for d in kernel_fit.HEAD_DIMS for factor in (1, 2) for dtype in ("fp16", "fp32")}
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(kernels.triton is None, reason="needs triton")
def test_a_tile_that_does_not_fit_fails_the_check():
    """The check itself: the sm_80 tile of the kernel before issue #29 needs more shared memory than sm_86 has."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--targets", "86", "--head-dims", "128", "--value-dims", "2d",
                           "--dtypes", "fp16", "--tile", "64", "32", "8", "3", "--jobs", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "of shared memory, sm_86 has 101376" in done.stdout


def test_tile_table_lookup():
    """Every supported dims and dtype has tiles on every target; sm_89 runs sm_86's; other dims and GPUs have none."""
    for target in kernel_fit.TARGETS:
        for d in kernel_fit.HEAD_DIMS:
            for dv in (d, 2 * d):
                for dtype in (torch.float16, torch.bfloat16, torch.float32):
                    assert all(kernels.tile_config(kernel, d, dv, dtype, target) for kernel in kernel_fit.KERNELS)
    assert kernels.tile_config("fwd", 64, 128, torch.bfloat16, 89) == kernels.tile_config("fwd", 64, 128,
                                                                                          torch.float16, 86)
    assert kernels.tile_config("fwd", 64, 256, torch.float16, 90) is None  # dv = 4d
    assert kernels.tile_config("fwd", 96, 192, torch.float16, 90) is None  # d not a power of two
    assert kernels.tile_config("fwd", 64, 128, torch.float16, 75) is None  # no tiles for sm_75


def test_unsupported_head_dims_are_routed_with_a_warning():
    q, k, v = torch.empty(1, 4, 8, 24), torch.empty(1, 1, 8, 48), torch.empty(1, 1, 8, 48)
    with pytest.warns(UserWarning, match="diff_flash cannot run head dims d=24, dv=48.*standard attention calls"):
        assert select_kernel(DIFF_FLASH, q, k, v) == "standard_calls"


@pytest.mark.skipif(not kernels.triton_available()[0], reason="needs triton (a GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("case", ["head-dim-24", "no-tiles-for-sm_75"])
def test_unfit_model_runs_the_standard_calls(case, monkeypatch):
    """A model whose dims or GPU diff_flash has no tile for trains and generates on the standard calls: one warning,
    logits and gradients equal eager's (TOLERANCES["backend"], fp32)."""
    overrides = dict(head_dim=24) if case == "head-dim-24" else {}
    if case == "no-tiles-for-sm_75":
        if torch.cuda.is_available():
            pytest.skip("simulates a GPU through the interpreter's target")
        monkeypatch.setattr(kernels, "INTERPRETER_TARGET", 75)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_stack(DIFF_FLASH, "V1-GQA", **overrides).to(device)
    reference = build_stack("eager", "V1-GQA", **overrides).to(device)
    tokens = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(3)).to(device)
    with pytest.warns(UserWarning, match="diff_flash cannot run") as caught:
        logits = model(tokens).logits
        logits.square().mean().backward()
    assert len({str(w.message) for w in caught}) == 1
    expected = reference(tokens).logits
    expected.square().mean().backward()
    assert_close(logits, expected, torch.float32, f"{case} logits", "backend")
    grad, expected_grad = (m.model.layers[0].self_attn.q_proj.weight.grad for m in (model, reference))
    assert_close(grad, expected_grad, torch.float32, f"{case} dq_proj", "backend")
