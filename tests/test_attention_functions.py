"""Each attn_implementation's attention function (attention_kernels.py) against the naive float64 reference, called as
DiffAttention calls it, with the mask transformers builds for that implementation: outputs and gradients of q,
packed k, v and lambda. The cases reach every sdpa route on CPU: per-branch calls (with V one call wide, or split
when dv = d), the one-call decode step, and the tiled kernel.

flex_attention runs uncompiled here (its math, not its fused kernel): compiling it for these inputs would use up
dynamo's recompile limit, which the compiled flex of tests/test_backends.py needs for its own inputs. It has no
backward on CPU, so only its forward is checked there. diff_flash runs under the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1).
"""

import pytest
import torch
from helpers.kernel_cases import (Case, check_against_reference, empty_rows, key_valid, leaves, padding_mask,
                                  seeded_randn)
from helpers import tf32_kind, tiny_config
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

from diff_transformer import attention_kernels, modeling_diff
from diff_transformer.kernel_naive import naive_diff_attention

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
NAMES = ("out", "dq", "dk", "dv", "dlam")
# The entry of helpers.TOLERANCES for each implementation's kernel: eager computes in fp32 as the tiled kernel does.
TOLERANCE_KIND = {"eager": "tiled", "sdpa": "sdpa", "flex_attention": "sdpa", "diff_flash": "diff_flash"}


def attend(implementation: str, case: Case, q, k, v, lam) -> torch.Tensor:
    """Out [B, T, h, dv] of `implementation`'s attention function for q [B, 2h, T, d], packed k [B, h_kv, S, 2d],
    v [B, h_kv, S, dv]. The one place that names the attention functions and how DiffAttention calls
    them; the mask is what transformers builds for the implementation when the queries are the last T of S keys."""
    config = tiny_config(num_attention_heads=case.H, num_key_value_heads=case.KV, head_dim=case.D,
                         value_head_dim=case.dv)
    config._attn_implementation = implementation
    module = modeling_diff.DiffAttention(config, layer_idx=0).to(DEVICE).eval()
    valid = key_valid(case)
    mask = ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=case.B, q_length=case.T, kv_length=case.S, q_offset=case.S - case.T, kv_offset=0,
        mask_function=causal_mask_function, attention_mask=None if valid is None else valid.to(DEVICE),
        allow_is_causal_skip=True, dtype=q.dtype, config=config, use_vmap=False, device=DEVICE,
    )
    kernel = attention_kernels.DIFF_KERNELS[attention_kernels.select_kernel(implementation, q, k, v)]
    return kernel(module, q, k, v, lam, mask, case.D**-0.5)[0]


PREFILL = Case(2, 12, 12, 2, 1, 16)
PREFILL_PADDED = Case(2, 12, 12, 2, 1, 16, attn="padmask")
CHUNK_PADDED = Case(2, 8, 12, 2, 1, 16, attn="padmask")  # chunked prefill: T < S, bottom-right causal
DECODE = Case(2, 1, 13, 2, 1, 16)
DECODE_PADDED = Case(2, 1, 13, 2, 1, 16, attn="padmask")
NARROW_V = Case(2, 12, 12, 2, 1, 16, DV=16)  # dv = d: sdpa splits V per call
LONG = Case(1, 160, 160, 2, 1, 32)  # T > 128 and d >= 32: sdpa runs the tiled kernel on CPU
ALL_CASES = [PREFILL, PREFILL_PADDED, CHUNK_PADDED, DECODE, DECODE_PADDED, NARROW_V, LONG]
needs_triton = pytest.mark.skipif(not attention_kernels.triton_available()[0],
                                  reason=attention_kernels.triton_available()[1])
uncompiled_flex = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
CASES = {
    "eager": (ALL_CASES, []),
    "sdpa": (ALL_CASES, []),
    "flex_attention": ([PREFILL, PREFILL_PADDED], [uncompiled_flex]),
    "diff_flash": ([PREFILL_PADDED, CHUNK_PADDED, DECODE_PADDED], [needs_triton]),
}
PARAMS = [pytest.param(implementation, case, id=f"{implementation}-{case.id}", marks=marks)
          for implementation, (cases, marks) in CASES.items() for case in cases]


@pytest.mark.parametrize("implementation, case", PARAMS)
def test_attention_function_matches_reference(implementation: str, case: Case):
    empty = empty_rows(case).to(DEVICE)
    grad_out = seeded_randn(case.B, case.T, case.H, case.dv, seed=99).to(DEVICE)
    grad_out[empty] = 0  # a model never sends gradient into rows that see no key
    mask, scaling = padding_mask(case, DEVICE), case.D**-0.5
    inputs, names = leaves(case, torch.float32, device=DEVICE), NAMES
    if implementation == "flex_attention" and not HAS_CUDA:  # forward only
        inputs, names = [t.detach() for t in inputs], NAMES[:1]
    with torch.compiler.set_stance("force_eager"):
        got = check_against_reference(lambda *t: attend(implementation, case, *t),
                                      lambda *t: naive_diff_attention(*t, scaling, mask=mask), inputs, grad_out,
                                      names, torch.float32, tf32_kind(TOLERANCE_KIND[implementation], implementation),
                                      f"{implementation} {case.id}", rows=~empty)
    assert got["out"].dtype == torch.float32
