"""Hybrid stacks (some layers standard attention, config.attention_types) on every CPU backend."""

import re

import pytest
import torch
from helpers import tiny_config
from transformers import AutoModelForCausalLM

from diff_transformer import DiffForCausalLM
from diff_transformer.decoder_layers import index_span
from diff_transformer.modeling_diff import DiffAttention, DiffStandardAttention

BACKENDS = ["eager", "sdpa"]
TYPES = ["standard", "differential", "standard", "differential"]
BACKEND_ATOL = 1e-5  # fp32 eager vs sdpa


def hybrid_model(backend: str, **overrides) -> DiffForCausalLM:
    config = tiny_config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attention_types=TYPES,
                         **overrides)
    return DiffForCausalLM._from_config(config, attn_implementation=backend).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a - b).abs()
    return f"max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"


def test_layer_classes_follow_attention_types():
    model = hybrid_model("sdpa")
    classes = [type(layer.self_attn) for layer in model.model.layers]
    assert classes == [DiffStandardAttention, DiffAttention, DiffStandardAttention, DiffAttention]
    assert model.model.layers[0].self_attn.q_proj.weight.shape == model.model.layers[1].self_attn.q_proj.weight.shape


@pytest.mark.parametrize("attention_bias, attention_out_bias", [(True, False), (False, True)])
def test_every_layer_kind_takes_each_bias_setting(attention_bias, attention_out_bias):
    """`attention_bias` sets the q/k/v biases and `attention_out_bias` o_proj's, in standard layers too (whose o_proj
    Llama's constructor builds with the q/k/v setting)."""
    torch.manual_seed(0)
    model = hybrid_model("eager", attention_bias=attention_bias, attention_out_bias=attention_out_bias)
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        found = {name: getattr(attn, name).bias is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        expected = {"q_proj": attention_bias, "k_proj": attention_bias, "v_proj": attention_bias,
                    "o_proj": attention_out_bias}
        assert found == expected, f"layer {index} ({type(attn).__name__}): biases {found}, expected {expected}"


def test_backends_agree():
    torch.manual_seed(0)
    eager = hybrid_model("eager")
    sdpa = hybrid_model("sdpa")
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(1, 97, (2, 16))
    with torch.no_grad():
        a, b = eager(ids).logits, sdpa(ids).logits
    assert (a - b).abs().max() <= BACKEND_ATOL, f"eager vs sdpa on a hybrid stack: {max_diff(a, b)}"


def test_eager_attention_maps_per_layer_type():
    model = hybrid_model("eager")
    ids = torch.randint(1, 97, (1, 10))
    with torch.no_grad():
        maps = model(ids, output_attentions=True).attentions
    assert len(maps) == 4
    standard_rows, differential_rows = maps[0].sum(-1), maps[1].sum(-1)
    lam = model.model.layers[1].self_attn.lambda_params().item()
    assert torch.allclose(standard_rows, torch.ones_like(standard_rows), atol=1e-5), "softmax rows must sum to 1"
    expected = torch.full_like(differential_rows, 1 - lam)
    assert torch.allclose(differential_rows, expected, atol=BACKEND_ATOL), (
        f"A1 - lambda A2 rows: {max_diff(differential_rows, expected)}"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_trains_generates_and_round_trips(backend, tmp_path):
    model = hybrid_model(backend).train()
    ids = torch.randint(1, 97, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], f"loss did not fall: {losses}"
    model.eval()

    prompt = ids[:1, :6]
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with torch.no_grad():
        full = model(generated[:, :-1], use_cache=False).logits
    assert torch.equal(full[:, prompt.shape[1] - 1 :].argmax(-1), generated[:, prompt.shape[1] :]), (
        "cached greedy generation differs from full-forward argmax"
    )
    static = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8, cache_implementation="static")
    assert torch.equal(static, generated), "static cache generation differs from dynamic cache"

    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=backend).eval()
    assert reloaded.config.attention_types == TYPES
    with torch.no_grad():
        before, after = model(ids).logits, reloaded(ids).logits
    assert torch.equal(before, after), f"save/load changed logits: {max_diff(before, after)}"


def expand(span: str) -> list[int]:
    """The indices a `DecoderLayers` entry names: `0-3`, `0, 2, ..., 8`, or runs and indices listed."""
    items = span.split(", ")
    if "..." in items:
        first, second, last = int(items[0]), int(items[1]), int(items[-1])
        return list(range(first, last + 1, second - first))
    return [i for item in items for i in range(int(item.split("-")[0]), int(item.split("-")[-1]) + 1)]


@pytest.mark.parametrize("indices, expected", [
    ([0, 1, 2, 3], "0-3"), ([0, 2, 4, 6, 8], "0, 2, ..., 8"), ([1, 4], "1, 4"), ([0, 1, 3, 4, 7], "0-1, 3-4, 7"),
    ([0, 3, 6], "0, 3, 6"),
])
def test_index_span(indices, expected):
    assert index_span(indices) == expected
    assert expand(expected) == indices


@pytest.mark.parametrize("pattern", [["differential", "standard"], ["differential", "differential", "standard"]],
                         ids=["alternating", "two-one"])
def test_print_shows_each_layer_kind_once(pattern):
    """print(model) of a 32-layer hybrid stack: one entry per layer kind (torch folds only equal neighbours, which
    printed every layer of an alternating stack), naming each index once and only layers of that kind, within 2x
    the lines of a Llama of the same size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    types = (pattern * 32)[:32]
    config = tiny_config(num_hidden_layers=32, attention_types=types)
    model = DiffForCausalLM(config)
    text = repr(model)
    sizes = {name: getattr(config, name) for name in ("vocab_size", "hidden_size", "intermediate_size",
                                                      "num_hidden_layers", "num_attention_heads")}
    llama = repr(LlamaForCausalLM(LlamaConfig(**sizes)))
    assert len(text.splitlines()) <= 2 * len(llama.splitlines()), text
    entries = re.findall(r"^      \(([^)]*)\): (?:(\d+) x )?DiffDecoderLayer\(\n +\(self_attn\): (\w+)\(", text,
                         re.MULTILINE)
    assert len(entries) == 2, text
    covered = []
    for span, count, attention in entries:
        indices = expand(span)
        assert int(count or 1) == len(indices), (span, count)
        assert {type(model.model.layers[i].self_attn).__name__ for i in indices} == {attention}, (span, attention)
        covered += indices
    assert sorted(covered) == list(range(32)), entries
