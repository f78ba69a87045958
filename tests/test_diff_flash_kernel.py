"""The fused Triton differential attention kernel against the naive torch reference in float64.

Without a GPU the kernels run on CPU under the Triton interpreter (TRITON_INTERPRET=1); shapes are tiny
because it is slow.
"""

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the import of the kernel module
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from diff_transformer.diff_flash_attention import diff_flash_attention, naive_diff_attention, triton_available

_ok, _reason = triton_available()
if not _ok:
    pytest.skip(_reason, allow_module_level=True)

# Kernel result vs the float64 reference on the same (cast) inputs: |actual - expected| <= atol + rtol * |expected|.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
}
NAMES = ("out", "dq1", "dq2", "dk1", "dk2", "dv", "dlam")


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    S: int
    H: int
    KV: int
    D: int
    DV: int
    attn: str  # "causal" (bottom-right), "full" (no mask) or "padmask" (left padding & causal, bool mask)
    packed: bool = False  # q1/q2 slice a [B, 2H, T, D] tensor, k1/k2 slice a [B, KV, S, 2D] tensor

    @property
    def id(self) -> str:
        packed = "-packed" if self.packed else ""
        return f"B{self.B}-T{self.T}-S{self.S}-H{self.H}-KV{self.KV}-D{self.D}-DV{self.DV}-{self.attn}{packed}"


CASES = [
    Case(2, 40, 40, 4, 2, 16, 32, "causal"),  # GQA, T and S not multiples of the tile
    Case(1, 33, 33, 2, 2, 16, 16, "causal"),  # MHA, dv == d
    Case(2, 24, 40, 4, 1, 16, 32, "causal"),  # chunked prefill T < S, bottom-right causal, n_rep = 4
    Case(2, 1, 37, 4, 2, 16, 32, "causal", packed=True),  # decode step, strided views
    Case(2, 36, 36, 4, 2, 16, 32, "padmask", packed=True),  # left padding with fully masked rows
    Case(1, 20, 44, 2, 1, 16, 32, "full"),  # no causality, no mask
]
DTYPES = [torch.float32, torch.bfloat16]
PAD = (0, 5)  # left padding per batch row in "padmask" cases


def make_mask(case: Case) -> torch.Tensor | None:
    if case.attn != "padmask":
        return None
    causal = torch.ones(case.T, case.S, dtype=torch.bool).tril(case.S - case.T)
    key_valid = torch.arange(case.S)[None, :] >= torch.tensor(PAD[: case.B])[:, None]  # [B, S]
    return (causal[None, None] & key_valid[:, None, None, :]).to(DEVICE)  # [B, 1, T, S]


def make_leaves(case: Case, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    B, T, S, H, KV, D, DV = case.B, case.T, case.S, case.H, case.KV, case.D, case.DV
    if case.packed:
        qk = [randn(B, 2 * H, T, D), randn(B, KV, S, 2 * D)]
    else:
        qk = [randn(B, H, T, D), randn(B, H, T, D), randn(B, KV, S, D), randn(B, KV, S, D)]
    lam = torch.tensor(0.37, dtype=torch.float32, device=DEVICE)
    return [t.requires_grad_() for t in (*qk, randn(B, KV, S, DV), lam)]


def split(case: Case, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """(q1, q2, k1, k2, v, lam); for packed cases these are views of the leaves."""
    if not case.packed:
        return leaves
    q, k, v, lam = leaves
    return [q[:, : case.H], q[:, case.H :], k[..., : case.D], k[..., case.D :], v, lam]


def run(fn, case: Case, leaves: list[torch.Tensor], grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    inputs = split(case, leaves)
    out = fn(*inputs, scaling=case.D**-0.5, causal=case.attn != "full", mask=make_mask(case))
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return dict(zip(NAMES, (out, *grads)))


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    diff = (actual.double() - expected).abs()
    tol = TOL[dtype]
    ok = diff <= tol["atol"] + tol["rtol"] * expected.abs()
    assert ok.all(), (f"{name} ({dtype}): max abs diff {diff.max():.3e}, mean abs diff {diff.mean():.3e}, "
                      f"{(~ok).sum()} of {ok.numel()} outside atol={tol['atol']}, rtol={tol['rtol']}")


def check_against_reference(case: Case, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Kernel outputs and gradients vs the float64 reference on the same inputs; returns the kernel's."""
    leaves = make_leaves(case, dtype)
    grad_out = torch.randn(case.B, case.H, case.T, case.DV, generator=torch.Generator().manual_seed(99)).to(DEVICE)
    got = run(diff_flash_attention, case, leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    expected = run(naive_diff_attention, case, ref_leaves, grad_out.double())
    for name in NAMES:
        assert_close(name, got[name], expected[name], dtype)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: str(dt).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference(case: Case, dtype: torch.dtype):
    got = check_against_reference(case, dtype)
    assert got["out"].dtype == dtype and got["dlam"].dtype == torch.float32 and got["dlam"].dim() == 0
    if case.attn == "padmask":  # rows with no key to attend: exactly zero output and query grads
        empty = make_mask(case).squeeze(1).any(-1).logical_not()  # [B, T]
        assert empty.any()
        for name in ("out", "dq1", "dq2"):
            assert (got[name].transpose(1, 2)[empty] == 0).all(), f"{name} is not zero on fully masked rows"


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=lambda c: c.id)
def test_float16(case: Case):
    check_against_reference(case, torch.float16)


def test_rejects_unsupported_head_dim():
    q = torch.zeros(1, 2, 8, 24, device=DEVICE)
    v = torch.zeros(1, 2, 8, 48, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        diff_flash_attention(q, q, q, q, v, torch.tensor(0.5, device=DEVICE), scaling=24**-0.5)
