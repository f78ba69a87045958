"""DIFF V2 (diff_version=2) against an independent fp64 reference written from docs/design.md, per head."""

import math

import pytest
import torch
from helpers import (
    DTYPE_HEADS_PADDING,
    HEADS,
    assert_close,
    assert_layer_matches_reference,
    attention_mask,
    fp64_leaves,
    rope,
    tiny_config,
)
from transformers import AutoModelForCausalLM

from diff_transformer import DiffForCausalLM
from diff_transformer.attention_kernels import DIFF_FLASH, triton_available

BACKENDS = ["eager", "sdpa"]


def build(backend: str, dtype: torch.dtype = torch.float32, **overrides) -> DiffForCausalLM:
    fields = dict(hidden_size=64, diff_version=2, **HEADS["GQA"])
    fields.update(overrides)
    return DiffForCausalLM._from_config(tiny_config(**fields), attn_implementation=backend).to(dtype).eval()


def reference_v2_attention(x, w: dict, config, key_valid=None, return_maps: bool = False):
    """x [B, T, hidden] -> [B, T, hidden]. q: 2h heads of dim d, pair (2j, 2j+1); k/v: h_kv heads of dim d;
    out_j = A_2j V - sigmoid(x Wl^T)_j A_2j+1 V; concat_j out_j W_O^T. Optionally the maps A_2j - g_j A_2j+1."""
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    group = 2 * h // h_kv
    theta = config.rope_parameters["rope_theta"]
    batch, length, _ = x.shape
    pos = torch.arange(length)
    outputs, maps = [], []
    for b in range(batch):
        allowed = torch.ones(length, length).tril().bool()
        if key_valid is not None:
            allowed = allowed & key_valid[b][None, :].bool()
        gate = torch.sigmoid(x[b] @ w["lambda"].T)  # [T, h]

        def probs(i):
            q = rope(x[b] @ w["q"][i * d : (i + 1) * d].T, pos, theta)
            k = rope(x[b] @ w["k"][(i // group) * d : (i // group + 1) * d].T, pos, theta)
            scores = (q @ k.T / math.sqrt(d)).masked_fill(~allowed, -math.inf)
            return torch.softmax(scores, -1).nan_to_num(0.0), x[b] @ w["v"][(i // group) * d : (i // group + 1) * d].T

        heads, head_maps = [], []
        for j in range(h):
            (a1, v1), (a2, v2) = probs(2 * j), probs(2 * j + 1)
            assert (2 * j) // group == (2 * j + 1) // group, "a pair must share its GQA group"
            heads.append(a1 @ v1 - gate[:, j : j + 1] * (a2 @ v2))
            head_maps.append(a1 - gate[:, j : j + 1] * a2)
        outputs.append(torch.cat(heads, -1) @ w["o"].T)
        maps.append(torch.stack(head_maps))
    out = torch.stack(outputs)
    return (out, torch.stack(maps)) if return_maps else out


def v2_params(attn) -> dict[str, torch.nn.Parameter]:
    return {"q": attn.q_proj.weight, "k": attn.k_proj.weight, "v": attn.v_proj.weight, "o": attn.o_proj.weight,
            "lambda": attn.lambda_proj.weight}


@DTYPE_HEADS_PADDING
@pytest.mark.parametrize("backend", BACKENDS)
def test_v2_attention_matches_reference(backend, dtype, heads, padded):
    """B2-T12-H2-D16: V2 layer output and gradients (input, q/k/v/o, lambda_proj) vs the fp64 reference."""
    model = build(backend, dtype, **HEADS[heads]).model
    attn = model.layers[1].self_attn
    x = torch.randn(2, 12, 64, dtype=dtype, requires_grad=True)
    assert_layer_matches_reference(
        attn, model, x, attention_mask(padded) if padded else None, v2_params(attn),
        lambda x_ref, weights, key_valid: reference_v2_attention(x_ref, weights, model.config, key_valid),
        dtype, f"V2 {backend}",
    )


def test_v2_eager_output_attentions_is_differential_map():
    model = build("eager")
    tokens = torch.randint(3, 97, (1, 7))
    with torch.no_grad():
        out = model(tokens, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 2, 7, 7)
    for layer, (hidden, attentions) in enumerate(zip(out.hidden_states, out.attentions)):
        decoder = model.model.layers[layer]
        x = decoder.input_layernorm(hidden).double()
        _, maps = reference_v2_attention(x, fp64_leaves(v2_params(decoder.self_attn)), model.config, return_maps=True)
        assert_close(attentions, maps, torch.float32, f"V2 layer {layer} differential map")


@pytest.mark.parametrize("backend", BACKENDS)
def test_v2_cached_generation_equals_uncached(backend):
    model = build(backend)
    prompt = torch.randint(3, 97, (2, 6))
    generated = model.generate(prompt, max_new_tokens=10, do_sample=False)
    seq = prompt
    with torch.no_grad():
        for _ in range(10):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, seq)


def test_v2_save_load_bit_identical(tmp_path):
    model = build("sdpa")
    tokens = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        logits = model(tokens).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.diff_version == 2 and loaded.model.layers[0].self_attn.lambda_proj.weight.shape == (2, 64)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, logits), "V2 logits changed after save/load"


@pytest.mark.skipif(not triton_available()[0], reason=triton_available()[1])
def test_v2_diff_flash_runs_layers_through_sdpa():
    """V2 has no fused kernel: with attn_implementation='diff_flash' its layers use the sdpa interface."""
    tokens = torch.randint(3, 97, (2, 8))
    torch.manual_seed(0)
    fused = build(DIFF_FLASH)
    torch.manual_seed(0)
    sdpa = build("sdpa")
    with torch.no_grad():
        assert torch.equal(fused(tokens).logits, sdpa(tokens).logits)
    assert torch.equal(fused.generate(tokens, max_new_tokens=4, do_sample=False),
                       sdpa.generate(tokens, max_new_tokens=4, do_sample=False))
