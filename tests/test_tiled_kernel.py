"""The tiled torch-ops differential attention (sdpa on CPU) against the naive float64 reference: outputs and
gradients of q, packed k, v and lambda, across tiles, GQA, chunked prefill, decode and padding; and the one-call
sdpa decode step."""

import pytest
import torch
from helpers.kernel_cases import Case, check_against_reference, empty_rows, leaves, padding_mask, seeded_randn
from helpers import assert_close

from diff_transformer.attention_kernels import sdpa_decode_step
from diff_transformer.kernel_naive import naive_diff_attention
from diff_transformer.kernel_tiled import TILE_ROWS, tiled_diff_attention, tiled_forward

NAMES = ("out", "dq", "dk", "dv", "dlam")
CASES = [
    Case(2, 40, 40, 4, 4, 16, rows=16),  # 3 tiles, the last one short
    Case(2, 40, 40, 4, 2, 16, rows=16),  # GQA n_rep = 2
    Case(1, 24, 24, 4, 1, 8, rows=128),  # one tile, n_rep = 4
    Case(2, 36, 36, 4, 2, 16, attn="padmask", rows=8),  # fully masked rows, mask sliced per tile
    Case(2, 1, 37, 4, 2, 16, attn="padmask"),  # decode step with padding
    Case(1, 1, 37, 2, 2, 16),  # decode step, no mask
]
DTYPES = [torch.float32, torch.bfloat16]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda dt: str(dt).removeprefix("torch."))


def check_tiled(case: Case, dtype: torch.dtype, mask: torch.Tensor | None, grad_out: torch.Tensor,
                what: str) -> dict[str, torch.Tensor]:
    """Output [B, T, H, DV] (rows with a key to attend) and gradients of the tiled kernel vs the reference on the
    case's inputs; returns the kernel's."""
    tile_rows, scaling = case.rows or TILE_ROWS, case.D**-0.5
    return check_against_reference(lambda *t: tiled_diff_attention(*t, scaling, mask, rows=tile_rows),
                                   lambda *t: naive_diff_attention(*t, scaling, mask=mask), leaves(case, dtype),
                                   grad_out, NAMES, dtype, "tiled", what, rows=~empty_rows(case))


@dtypes
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tiled_matches_reference(case: Case, dtype: torch.dtype):
    empty = empty_rows(case)
    grad_out = seeded_randn(case.B, case.T, case.H, case.dv, seed=99)
    grad_out[empty] = 0  # a model never sends gradient into rows that see no key
    got = check_tiled(case, dtype, padding_mask(case), grad_out, case.id)
    assert got["out"].dtype == torch.float32 and got["dlam"].dim() == 0
    if empty.any():
        dq = got["dq"].view(case.B, 2, case.H, case.T, case.D)
        assert (dq.permute(0, 3, 1, 2, 4)[empty] == 0).all(), "query grads of fully masked rows are not zero"


def test_per_head_mask_matches_reference():
    """A mask with a head dim, [B, h, T, S] (custom masks), is split over (h_kv, n_rep) as the query heads are:
    outputs and gradients against the reference, B2-T40-H4-KV2-D16 with 16-row tiles."""
    case = CASES[1]
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(case.B, case.H, case.T, case.S, generator=gen) > 0.3
    mask = (mask | torch.eye(case.T, dtype=torch.bool)) & torch.ones(case.T, case.S, dtype=torch.bool).tril()
    grad_out = torch.randn(case.B, case.T, case.H, case.dv, generator=gen)
    check_tiled(case, torch.float32, mask, grad_out, f"{case.id} per-head mask")


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c.id)
def test_tile_size_and_no_grad_path_agree(case: Case):
    """Output does not depend on the tiling; the no-grad path (no autograd.Function) gives the same numbers."""
    q, k, v, lam = (t.detach() for t in leaves(case, torch.float32))
    mask, scaling = padding_mask(case), case.D**-0.5
    one_tile = tiled_diff_attention(q, k, v, lam, scaling, mask, rows=case.T)
    with torch.no_grad():
        no_grad = tiled_forward(q, k, v, lam, mask, scaling, rows=3).flatten(2, 3)  # [B, T, h, dv]
    with torch.enable_grad():
        tiled = tiled_diff_attention(q, k, v, lam.requires_grad_(), scaling, mask, rows=3)
    keep = ~empty_rows(case)  # a fully masked row averages the keys its tile reads: a don't-care
    for name, actual in (("no-grad rows=3", no_grad), ("autograd rows=3", tiled)):
        assert_close(actual[keep], one_tile[keep], torch.float32, name, "tiled")


def test_static_cache_prefill_ignores_empty_slots():
    """mask None with T > 1 is sdpa's top-left causal: keys past T (unfilled static-cache slots) are not read."""
    case = CASES[0]
    q, k, v, lam = (t.detach() for t in leaves(case, torch.float32))
    garbage = torch.full((case.B, case.KV, 8, k.shape[-1]), 1e4)
    padded = tiled_diff_attention(q, torch.cat([k, garbage], 2), torch.cat([v, garbage], 2), lam, 0.25)
    expected = tiled_diff_attention(q, k, v, lam, 0.25)
    assert_close(padded, expected, torch.float32, "static-cache prefill", "tiled")


DECODE_CASES = [CASES[4], CASES[5], Case(2, 1, 29, 4, 1, 16)]  # padding; MHA; n_rep = 4


@dtypes
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.id)
def test_sdpa_decode_step_matches_reference(case: Case, dtype: torch.dtype):
    """The one-call decode step of the sdpa backend: per kv head, the padded queries of both branches as rows."""
    q, k, v, lam = (t.detach() for t in leaves(case, dtype))
    mask = padding_mask(case)
    got, _ = sdpa_decode_step(None, q, k, v, lam, mask, case.D**-0.5)
    expected = naive_diff_attention(q.double(), k.double(), v.double(), lam.double(), case.D**-0.5, mask=mask)
    assert got.dtype == torch.float32
    assert_close(got, expected, dtype, f"{case.id} decode step", "sdpa")
