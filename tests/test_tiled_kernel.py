"""The tiled torch-ops differential attention (sdpa on CPU) against the naive reference in float64:
outputs and gradients of q, packed k, v and lambda, across tiles, GQA, chunked prefill, decode and padding; and
the one-call sdpa decode step."""

from dataclasses import dataclass

import pytest
import torch

from diff_transformer.diff_flash_attention import naive_diff_attention
from diff_transformer.modeling_diff import sdpa_decode_step
from diff_transformer.tiled_diff_attention import tiled_diff_attention, tiled_forward

# Against the fp64 reference on the same (cast) inputs: |actual - expected| <= atol + rtol * |expected|. The kernel
# computes in fp32 whatever the input dtype; with bf16 inputs autograd rounds the input gradients to bf16.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-3, rtol=1e-2)}
NAMES = ("out", "dq", "dk", "dv", "dlam")
PAD = (0, 5)  # left padding per batch row in "padmask" cases


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    S: int
    H: int
    KV: int
    D: int
    rows: int  # query rows per tile
    attn: str  # "causal" (mask None: bottom-right causal) or "padmask" (left padding & causal, boolean mask)

    @property
    def id(self) -> str:
        return f"B{self.B}-T{self.T}-S{self.S}-H{self.H}-KV{self.KV}-D{self.D}-R{self.rows}-{self.attn}"


CASES = [
    Case(2, 40, 40, 4, 4, 16, 16, "causal"),  # 3 tiles, the last one short
    Case(2, 40, 40, 4, 2, 16, 16, "causal"),  # GQA n_rep = 2
    Case(1, 24, 24, 4, 1, 8, 128, "causal"),  # one tile, n_rep = 4
    Case(2, 36, 36, 4, 2, 16, 8, "padmask"),  # fully masked rows, mask sliced per tile
    Case(2, 1, 37, 4, 2, 16, 128, "padmask"),  # decode step with padding
    Case(1, 1, 37, 2, 2, 16, 128, "causal"),  # decode step, no mask
]
DTYPES = [torch.float32, torch.bfloat16]


def make_mask(case: Case) -> torch.Tensor | None:
    if case.attn != "padmask":
        return None
    causal = torch.ones(case.T, case.S, dtype=torch.bool).tril(case.S - case.T)
    key_valid = torch.arange(case.S)[None, :] >= torch.tensor(PAD[: case.B])[:, None]  # [B, S]
    return causal[None, None] & key_valid[:, None, None, :]  # [B, 1, T, S]


def make_leaves(case: Case, dtype: torch.dtype) -> list[torch.Tensor]:
    """q [B, 2H, T, D] (halves), packed k [B, KV, S, 2D], v [B, KV, S, 2D], lambda."""
    gen = torch.Generator().manual_seed(1234)
    shapes = [(case.B, 2 * case.H, case.T, case.D), *[(case.B, case.KV, case.S, 2 * case.D)] * 2]
    leaves = [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]
    return [t.requires_grad_() for t in (*leaves, torch.tensor(0.37))]


def reference(case: Case, leaves: list[torch.Tensor]) -> torch.Tensor:
    q, k, v, lam = leaves
    h, d = case.H, case.D
    out = naive_diff_attention(q[:, :h], q[:, h:], k[..., :d], k[..., d:], v, lam, d**-0.5, mask=make_mask(case))
    return out.transpose(1, 2)  # [B, T, H, DV]


def run(fn, leaves: list[torch.Tensor], grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    out = fn(leaves)
    return dict(zip(NAMES, (out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))))


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    diff = (actual.double() - expected.double()).abs()
    tol = TOL[dtype]
    ok = diff <= tol["atol"] + tol["rtol"] * expected.double().abs()
    assert ok.all(), (f"{name} ({dtype}): max abs diff {diff.max():.3e}, mean abs diff {diff.mean():.3e}, "
                      f"{(~ok).sum()} of {ok.numel()} outside atol={tol['atol']}, rtol={tol['rtol']}")


def empty_rows(case: Case) -> torch.Tensor:
    """[B, T]: query rows with no key to attend (their output is a finite don't-care, 0 in the reference)."""
    mask = make_mask(case)
    return torch.zeros(case.B, case.T, dtype=torch.bool) if mask is None else ~mask.squeeze(1).any(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: str(dt).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tiled_matches_reference(case: Case, dtype: torch.dtype):
    leaves = make_leaves(case, dtype)
    empty = empty_rows(case)
    grad_out = torch.randn(case.B, case.T, case.H, 2 * case.D, generator=torch.Generator().manual_seed(99))
    grad_out[empty] = 0  # a model never sends gradient into rows that see no key
    got = run(lambda t: tiled_diff_attention(*t, make_mask(case), case.D**-0.5, rows=case.rows), leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    expected = run(lambda t: reference(case, t), ref_leaves, grad_out.double())
    assert got["out"].dtype == torch.float32 and got["dlam"].dim() == 0
    got["out"], expected["out"] = got["out"][~empty], expected["out"][~empty]
    for name in NAMES:
        assert_close(name, got[name], expected[name], dtype)
    if empty.any():
        dq = got["dq"].view(case.B, 2, case.H, case.T, case.D)
        assert (dq.permute(0, 3, 1, 2, 4)[empty] == 0).all(), "query grads of fully masked rows are not zero"


def test_per_head_mask_matches_reference():
    """A mask with a head dim, [B, h, T, S] (custom masks), is split over (h_kv, n_rep) as the query heads are:
    outputs and gradients against the fp64 reference, B2-T40-H4-KV2-D16 with 16-row tiles."""
    case = CASES[1]
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(case.B, case.H, case.T, case.S, generator=gen) > 0.3
    mask = (mask | torch.eye(case.T, dtype=torch.bool)) & torch.ones(case.T, case.S, dtype=torch.bool).tril()
    leaves = make_leaves(case, torch.float32)
    grad_out = torch.randn(case.B, case.T, case.H, 2 * case.D, generator=gen)
    got = run(lambda t: tiled_diff_attention(*t, mask, case.D**-0.5, rows=case.rows), leaves, grad_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    h, d = case.H, case.D

    def ref(t):
        q, k, v, lam = t
        return naive_diff_attention(q[:, :h], q[:, h:], k[..., :d], k[..., d:], v, lam, d**-0.5, mask=mask).transpose(1, 2)

    expected = run(ref, ref_leaves, grad_out.double())
    for name in NAMES:
        assert_close(name, got[name], expected[name], torch.float32)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c.id)
def test_tile_size_and_no_grad_path_agree(case: Case):
    """Output does not depend on the tiling; the no-grad path (no autograd.Function) gives the same numbers."""
    q, k, v, lam = (t.detach() for t in make_leaves(case, torch.float32))
    mask, scaling = make_mask(case), case.D**-0.5
    one_tile = tiled_diff_attention(q, k, v, lam, mask, scaling, rows=case.T)
    with torch.no_grad():
        no_grad = tiled_forward(q, k, v, lam, mask, scaling, rows=3).flatten(2, 3)  # [B, T, h, dv]
    with torch.enable_grad():
        tiled = tiled_diff_attention(q, k, v, lam.requires_grad_(), mask, scaling, rows=3)
    keep = ~empty_rows(case)  # a fully masked row averages the keys its tile reads: a don't-care
    for name, actual in (("no-grad rows=3", no_grad), ("autograd rows=3", tiled)):
        assert_close(name, actual[keep], one_tile[keep], torch.float32)


def test_static_cache_prefill_ignores_empty_slots():
    """mask None with T > 1 is sdpa's top-left causal: keys past T (unfilled static-cache slots) are not read."""
    case = CASES[0]
    q, k, v, lam = (t.detach() for t in make_leaves(case, torch.float32))
    garbage = torch.full((case.B, case.KV, 8, k.shape[-1]), 1e4)
    padded = tiled_diff_attention(q, torch.cat([k, garbage], 2), torch.cat([v, garbage], 2), lam, None, 0.25)
    assert_close("static-cache prefill", padded, tiled_diff_attention(q, k, v, lam, None, 0.25), torch.float32)


# sdpa_decode_step runs torch's sdpa in the input dtype, so bf16 outputs carry bf16 rounding.
DECODE_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DECODE_CASES = [CASES[4], CASES[5], Case(2, 1, 29, 4, 1, 16, 128, "causal")]  # padding; MHA; n_rep = 4


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: str(dt).removeprefix("torch."))
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.id)
def test_sdpa_decode_step_matches_reference(case: Case, dtype: torch.dtype):
    """The one-call decode step of the sdpa backend: per kv head, the padded queries of both branches as rows."""
    q, k, v, lam = (t.detach() for t in make_leaves(case, dtype))
    got, _ = sdpa_decode_step(None, q, k, v, lam, make_mask(case), case.D**-0.5)
    expected = reference(case, [t.double() for t in (q, k, v, lam)])
    assert got.dtype == torch.float32
    tol = DECODE_TOL[dtype]
    diff = (got.double() - expected).abs()
    assert (diff <= tol["atol"] + tol["rtol"] * expected.abs()).all(), (
        f"{case.id} {dtype}: max abs diff {diff.max():.3e}, mean abs diff {diff.mean():.3e}")
