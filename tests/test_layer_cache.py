"""What each layer caches is described once, `DiffConfig.layer_cache(kind)`, and every consumer reads it: the
property test below builds tiny models over (diff_version, layer kinds, value width, GQA, noise heads), runs one
forward with a cache, and checks each consumer against the shapes the model's cache actually holds: transformers'
per-layer configs, the paged cache's rows (continuous batching), PEFT's prefix width and the vLLM layout's head
widths and bytes per token."""

import itertools

import pytest
import torch
from helpers import tiny_config
from transformers import DynamicCache

from diff_transformer import DiffForCausalLM
from diff_transformer.configuration_diff import LayerCache
from diff_transformer.paged_cache import paged_cache_heads
from diff_transformer.peft_defaults import prefix_head_width
from diff_transformer.serving.layout import gpu_widths, kv_bytes_per_token

D = 8  # head_dim of every case; hidden 32, 4 heads
NOISE_HEADS = (None, 2)  # grouped noise heads: h / 2 differential heads each


def geometry_cases() -> list[tuple[str, dict]]:
    """(id, config overrides) over diff_version x kinds x value width x kv heads x noise heads."""
    cases = []
    for version, kinds, dv, kv, noise in itertools.product(
            (1, 2), ("diff", "hybrid"), (D, 2 * D, 3 * D), (4, 2), NOISE_HEADS):
        if version == 2 and (kinds == "hybrid" or dv != 2 * D or noise):
            continue  # V2: no hybrid stacks, heads d wide, no noise groups
        if noise and noise % kv:
            continue
        types = ["differential", "standard"] if kinds == "hybrid" else ["differential"] * 2
        fields = dict(diff_version=version, attention_types=types, value_head_dim=dv, num_key_value_heads=kv)
        fields |= {"num_noise_heads": noise} if noise else {}
        cases.append((f"V{version}-{kinds}-dv{dv}-kv{kv}-noise{noise}", fields))
    return cases


CASES = geometry_cases()


def cached_shapes(fields: dict) -> tuple[DiffForCausalLM, list[tuple[int, ...]]]:
    """A tiny model and, per layer, (kv heads, key width, value width) of what its cache holds after a forward."""
    torch.manual_seed(0)
    config = tiny_config(hidden_size=32, num_attention_heads=4, head_dim=D, **fields)
    model = DiffForCausalLM(config).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(torch.randint(3, 97, (2, 5)), past_key_values=cache, use_cache=True)
    shapes = []
    for layer in cache.layers:
        assert layer.keys.shape[:3] == (2, layer.values.shape[1], 5), (layer.keys.shape, layer.values.shape)
        shapes.append((layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]))
    return model, shapes


@pytest.mark.parametrize("fields", [fields for _, fields in CASES], ids=[name for name, _ in CASES])
def test_every_consumer_reads_the_cache_the_model_holds(fields):
    model, shapes = cached_shapes(fields)
    config = model.config
    kinds = config.attention_types
    for layer, (kind, shape) in enumerate(zip(kinds, shapes)):
        assert config.layer_cache(kind) == LayerCache(*shape), f"layer {layer} ({kind}): cache holds {shape}"
        per_layer = config.per_layer_config[layer]
        assert (per_layer.num_key_value_heads, per_layer.head_dim) == shape[:2], f"layer {layer} per_layer_config"
        assert getattr(per_layer, "v_head_dim", shape[1]) == shape[2], f"layer {layer} per_layer_config v_head_dim"
    widest = max(heads * max(key, value) for heads, key, value in shapes)
    assert paged_cache_heads(config) == -(-widest // D), "paged cache rows per token"
    assert prefix_head_width(config) * config.num_key_value_heads == widest, "PEFT prefix width"
    widths = gpu_widths(config)
    for kind, (heads, key, value) in zip(kinds, shapes):  # vLLM: one head width holds keys and values of a kind
        assert heads * widths[kind] >= heads * max(key, value), f"vLLM {kind} heads {widths[kind]} wide"
        assert kv_bytes_per_token(config, widths)[kind] == 2 * heads * widths[kind], f"vLLM {kind} bytes per token"
    differential = [shape for kind, shape in zip(kinds, shapes) if kind == "differential"][0]
    assert widths["differential"] == max(differential[1:]), "vLLM differential width is the widest of k and v"
