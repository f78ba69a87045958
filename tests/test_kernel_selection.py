"""Which differential kernel runs (`select_kernel`, docs/design.md §4), and that registering `diff_flash` leaves
other models' attention alone."""

import pytest
import torch
from helpers import build_stack
from transformers import LlamaConfig, LlamaForCausalLM

from diff_transformer import capture_branch_attentions
from diff_transformer.attention_kernels import DIFF_FLASH, DIFF_KERNELS, select_kernel


def inputs(length: int, d: int = 32, dv: int = 64, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Empty q [B1, 2h=4, T, d], packed k [B1, h_kv=1, T, 2d] and v [B1, 1, T, dv]: only their shapes count."""
    q = torch.empty(1, 4, length, d, device=device)
    return q, torch.empty(1, 1, length, 2 * d, device=device), torch.empty(1, 1, length, dv, device=device)


@pytest.mark.parametrize(
    ("implementation", "length", "dv", "expected"),
    [
        ("eager", 1, 64, "eager"),
        ("eager", 512, 64, "eager"),
        (DIFF_FLASH, 512, 64, DIFF_FLASH),
        (DIFF_FLASH, 1, 64, "sdpa_decode_step"),  # decode steps: sdpa's kernel, measured faster on an H200
        (DIFF_FLASH, 1, 32, "tiled"),
        ("sdpa", 1, 64, "sdpa_decode_step"),
        ("sdpa", 1, 32, "tiled"),
        ("sdpa", 128, 64, "standard_calls"),
        ("sdpa", 129, 64, "tiled"),
        ("flash_attention_2", 512, 64, "standard_calls"),
        ("flex_attention", 1, 64, "standard_calls"),
    ],
)
def test_select_kernel_on_cpu(implementation, length, dv, expected):
    assert select_kernel(implementation, *inputs(length, dv=dv)) == expected
    assert expected in DIFF_KERNELS


def test_select_kernel_by_head_dim_and_device():
    """The tiled kernel pays on CPU from d = 32 on; elsewhere long sdpa inputs make the standard calls."""
    assert select_kernel("sdpa", *inputs(512, d=16, dv=32)) == "standard_calls"
    assert select_kernel("sdpa", *inputs(512, device="meta")) == "standard_calls"


def test_traced_code_makes_the_standard_calls():
    """Under torch.compile the choice may not depend on the length: every length gets the same kernel."""
    chosen = []

    @torch.compile(backend="eager", fullgraph=True)
    def pick(q, k, v):
        chosen.append(select_kernel("sdpa", q, k, v))
        return q.sum()

    for length in (1, 512):
        torch._dynamo.reset()
        pick(*inputs(length))
    assert chosen == ["standard_calls", "standard_calls"]


def test_diff_flash_is_an_error_for_other_models():
    """`diff_flash` is registered with transformers for our layers only: Llama asking for it gets a clear error,
    not sdpa in disguise."""
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2)
    llama = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    llama.config._attn_implementation = DIFF_FLASH
    with pytest.raises(ValueError, match="no meaning for LlamaAttention"):
        llama(torch.tensor([[1, 2, 3]]))


def test_capture_branch_attentions_needs_eager():
    model = build_stack("sdpa", "V1-GQA")
    with pytest.raises(ValueError, match='attn_implementation="eager"'), capture_branch_attentions(model):
        pass
