"""The fused Triton differential attention kernel against the naive float64 reference.

Without a GPU the kernels run on CPU under the Triton interpreter (TRITON_INTERPRET=1); shapes are tiny
because it is slow. `test_gpu_tiles_match_reference` runs the paper's head dims with the tiles a GPU runs
(the interpreter takes them from `INTERPRETER_TARGET`; a GPU runs its own).
"""

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the import of the kernel module
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from helpers import assert_close, build_stack, tf32_kind  # noqa: E402
from helpers.kernel_cases import (Case, check_against_reference, empty_rows, leaves, padding_mask,  # noqa: E402
                                  seeded_randn)

import diff_transformer.kernel_diff_flash as kernels  # noqa: E402
from diff_transformer.kernel_diff_flash import diff_flash_attention, triton_available  # noqa: E402
from diff_transformer.attention_kernels import DIFF_FLASH, select_kernel  # noqa: E402
from diff_transformer.kernel_naive import naive_diff_attention  # noqa: E402
from diff_transformer.kernel_tiles import TILES  # noqa: E402

_ok, _reason = triton_available()
if not _ok:
    pytest.skip(_reason, allow_module_level=True)

NAMES = ("out", "dq", "dk", "dv", "dlam")
CASES = [
    Case(2, 40, 40, 4, 2, 16),  # GQA, T and S not multiples of the tile
    Case(1, 33, 33, 2, 2, 16, DV=16),  # MHA, dv == d
    Case(2, 24, 40, 4, 1, 16),  # chunked prefill T < S, bottom-right causal, n_rep = 4
    Case(2, 1, 37, 4, 2, 16),  # decode step
    Case(2, 36, 36, 4, 2, 16, attn="padmask"),  # left padding with fully masked rows
    Case(1, 20, 44, 2, 1, 16, attn="full"),  # no causality, no mask
]
DTYPES = [torch.float32, torch.bfloat16]


def check_kernel(case: Case, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Kernel outputs [B, T, H, DV] and gradients of the packed q, k, v and lambda vs the reference on the same
    inputs (the kernel reads the branch halves as strided views); returns the kernel's."""
    options = dict(scaling=case.D**-0.5, causal=case.attn != "full", mask=padding_mask(case, DEVICE))
    grad_out = seeded_randn(case.B, case.T, case.H, case.dv, seed=99).to(DEVICE)
    return check_against_reference(lambda *t: diff_flash_attention(*t, **options),
                                   lambda *t: naive_diff_attention(*t, **options), leaves(case, dtype, device=DEVICE),
                                   grad_out, NAMES, dtype, tf32_kind("diff_flash", DIFF_FLASH), case.id)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: str(dt).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference(case: Case, dtype: torch.dtype):
    got = check_kernel(case, dtype)
    assert got["out"].dtype == dtype and got["dlam"].dtype == torch.float32 and got["dlam"].dim() == 0
    if case.attn == "padmask":  # rows with no key to attend: exactly zero output and query grads
        empty = empty_rows(case).to(DEVICE)  # [B, T]
        assert empty.any()
        assert (got["out"][empty] == 0).all(), "out is not zero on fully masked rows"
        dq = got["dq"].view(case.B, 2, case.H, case.T, case.D).permute(0, 3, 1, 2, 4)  # [B, T, branch, H, D]
        assert (dq[empty] == 0).all(), "dq is not zero on fully masked rows"


# d = 64 and 128 with the tiles each GPU target runs (sm_XX: the target whose tiles the interpreter runs); T and S
# span several tiles and end inside one.
GPU_TILE_CASES = [
    *[(case, target) for target in (80, 86, 90) for case in (
        Case(1, 80, 80, 4, 2, 64),  # GQA, causal
        Case(2, 40, 72, 2, 1, 128, attn="padmask"),  # paper head size, chunked prefill with padding
        Case(1, 1, 70, 4, 2, 128),  # decode step
    )],
    (Case(1, 72, 72, 2, 2, 64, DV=64, attn="full"), 80),  # MHA, dv = d, no causality
    (Case(1, 70, 70, 4, 1, 128, DV=128), 90),  # n_rep = 4, dv = d
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda dt: str(dt).removeprefix("torch."))
@pytest.mark.parametrize(("case", "target"), GPU_TILE_CASES,
                         ids=lambda x: x.id if isinstance(x, Case) else f"sm_{x}-tiles")
def test_gpu_tiles_match_reference(case: Case, target: int, dtype: torch.dtype, monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETER_TARGET", target)
    check_kernel(case, dtype)


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=lambda c: c.id)
def test_float16(case: Case):
    check_kernel(case, torch.float16)


def test_rejects_unsupported_head_dim():
    q = torch.zeros(1, 4, 8, 24, device=DEVICE)
    k = torch.zeros(1, 2, 8, 48, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        diff_flash_attention(q, k, k, torch.tensor(0.5, device=DEVICE), scaling=24**-0.5)


def test_rejects_unpacked_keys():
    """Keys must be packed (k1 | k2) per kv head: a [B, h_kv, S, d] key tensor is refused before any work."""
    q = torch.zeros(1, 4, 8, 16, device=DEVICE)
    k = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected \[B, h_kv, S, 2d\]"):
        diff_flash_attention(q, k, torch.zeros(1, 2, 8, 32, device=DEVICE), torch.tensor(0.5, device=DEVICE),
                             scaling=0.25)


@pytest.fixture
def launch_failures(monkeypatch):
    """A fresh memory of failed launches (kernel_diff_flash._LAUNCH_FAILURES), so that no other test inherits one."""
    monkeypatch.setattr(kernels, "_LAUNCH_FAILURES", {})
    return kernels._LAUNCH_FAILURES


def test_a_lookup_without_a_tile_in_its_dtype_makes_the_standard_calls(monkeypatch, launch_failures):
    """bf16 is looked up under its own key: with sm_80's bf16 tiles gone from the table (fp16's still there), bf16
    inputs are routed to the standard calls with a warning naming the dtype and dims, fp16 ones still run
    diff_flash, and with the table as shipped bf16 runs diff_flash too."""
    if torch.cuda.is_available():
        pytest.skip("simulates a GPU through the interpreter's target")
    monkeypatch.setattr(kernels, "INTERPRETER_TARGET", 80)
    q, k, v = torch.empty(1, 4, 8, 64), torch.empty(1, 1, 8, 128), torch.empty(1, 1, 8, 128)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    assert select_kernel(DIFF_FLASH, *bf16) == DIFF_FLASH
    monkeypatch.setattr(kernels, "TILES", {key: tiles for key, tiles in TILES.items() if key[:2] != (80, "bf16")})
    with pytest.warns(UserWarning, match=r"diff_flash cannot run torch.bfloat16 at d=64, dv=128 on the sm_80 tiles: "
                                         r"no tile fits.*standard attention calls"):
        assert select_kernel(DIFF_FLASH, *bf16) == "standard_calls"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select_kernel(DIFF_FLASH, *(t.half() for t in (q, k, v))) == DIFF_FLASH


class OutOfResourcesAtLaunch:
    """Stands in for one of the Triton kernels (`kernel[grid](...)`): every launch raises Triton's OutOfResources, as
    a launch on a GPU without the tile's shared memory does. A CPU has no such limit, so the failure is planted."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            raise kernels.triton.runtime.errors.OutOfResources(180224, 166912, "shared memory")
        return launch


@pytest.mark.parametrize("kernel", ["_diff_attn_fwd", "_diff_attn_bwd_dq", "_diff_attn_bwd_dkdv"])
def test_a_launch_without_the_resources_falls_back(kernel, monkeypatch, launch_failures):
    """A launch that fails for lack of shared memory (Triton's OutOfResources, planted by monkeypatching the kernel's
    launcher: no GPU here) does not crash training: a failed forward makes that layer's standard calls, a failed
    backward takes that step's gradients from the float64 reference; one warning names the kernel and the shortfall;
    every later call makes the standard calls (the kernel is launched once). Logits and gradients equal eager's
    (TOLERANCES["backend"], fp32)."""
    failing = OutOfResourcesAtLaunch()
    monkeypatch.setattr(kernels, kernel, failing)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_stack(DIFF_FLASH, "V1-GQA").to(device)
    reference = build_stack("eager", "V1-GQA").to(device)
    tokens = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(3)).to(device)
    with pytest.warns(UserWarning, match=r"cannot run torch.float32 at d=\d+, dv=\d+ on .*: the .* kernel's launch "
                                         r"failed \(out of resource: shared memory, Required: 180224") as caught:
        for _ in range(2):
            logits = model(tokens).logits
            logits.square().mean().backward()
    assert failing.launches == 1
    routed = {str(w.message) for w in caught if "cannot run" in str(w.message)}  # (and on a GPU, fp32's TF32 note)
    assert len(routed) <= 2  # the backward's own, then the layers' routing
    expected = reference(tokens).logits
    for _ in range(2):
        reference(tokens).logits.square().mean().backward()
    kind = tf32_kind("backend", DIFF_FLASH)
    assert_close(logits, expected, torch.float32, f"{kernel} logits", kind)
    for name in ("q_proj", "k_proj", "v_proj"):
        grad, expected_grad = (getattr(m.model.layers[0].self_attn, name).weight.grad for m in (model, reference))
        assert_close(grad, expected_grad, torch.float32, f"{kernel} {name} grad", kind)
    (where, dtype, d, dv), = launch_failures  # the inputs whose launch failed: routed to the standard calls since
    q, k, v = (torch.zeros(1, heads, 4, width, dtype=dtype, device=where)
               for heads, width in ((2, d), (1, 2 * d), (1, dv)))
    with pytest.warns(UserWarning, match="launch failed"):
        assert select_kernel(DIFF_FLASH, q, k, v) == "standard_calls"
