"""transformers' generation contract for V1, V2 and hybrid stacks: assisted decoding, dict outputs with the cache,
the static cache transformers allocates from the config, compiled generation with every output, output recording
and gradients on returned hidden states and attentions (issue #15).

The cache holds the model's own layout: a differential layer caches its keys packed (k1 | k2), so its cache is not
its query shape. The config describes each layer's cache as transformers reads it (`DiffConfig.per_layer_config`,
read by transformers' `get_head_shapes`), and the tests check the cache against what transformers reads, and that
transformers' own machinery (early static allocation, cropping in assisted decoding, beam reordering) works on it.
"""

import pytest
import torch
from helpers import STACKS, assert_close, build_stack
from transformers import CompileConfig, StaticCache
from transformers.integrations.executorch import get_head_shapes
from transformers.utils.output_capturing import OutputRecorder

from diff_transformer import DiffConfig, DiffForCausalLM, DiffForSequenceClassification, DiffModel
from diff_transformer.modeling_diff import CACHE_KWARG

PROMPT = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(3))


def layer_heads(config, layer_idx: int) -> int:
    """Heads of a layer's attention map: h, or h * value_head_dim / head_dim for a standard layer."""
    if config.attention_types[layer_idx] == "standard":
        return config.num_attention_heads * config.value_head_dim // config.head_dim
    return config.num_attention_heads


def library_cache_shapes(config) -> tuple[list[int], list[int]]:
    """Per layer (kv heads, width) of keys and values, as transformers reads them from the config."""
    return tuple([x] * config.num_hidden_layers if isinstance(x, int) else x for x in get_head_shapes(config))


def assert_cache_layout(cache, config, batch: int, length: int) -> None:
    heads, widths = library_cache_shapes(config)
    for i, layer in enumerate(cache.layers):
        expected = (batch, heads[i], length, widths[i])
        assert tuple(layer.keys.shape) == expected, f"layer {i} keys {tuple(layer.keys.shape)} != {expected}"
        assert tuple(layer.values.shape) == expected, f"layer {i} values {tuple(layer.values.shape)} != {expected}"


@pytest.mark.parametrize("assistant", ["same", "other", "prompt_lookup"])
@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_assisted_decoding_equals_greedy(backend, stack, assistant):
    """Speculative decoding crops the cache after rejected drafts; its tokens must be greedy search's (B1)."""
    model = build_stack(backend, stack)
    prompt = PROMPT[:1]
    greedy = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    if assistant == "prompt_lookup":
        extra = dict(prompt_lookup_num_tokens=3)
    else:
        extra = dict(assistant_model=model if assistant == "same" else build_stack(backend, stack, seed=1))
    assisted = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, **extra)
    assert torch.equal(assisted, greedy), f"assisted {assisted.tolist()} != greedy {greedy.tolist()}"


@pytest.mark.parametrize("stack", list(STACKS))
def test_assisted_sampling_returns_every_output(stack):
    model = build_stack("eager", stack)
    out = model.generate(
        PROMPT[:1], max_new_tokens=6, min_new_tokens=6, do_sample=True, assistant_model=build_stack("eager", stack, 1),
        return_dict_in_generate=True, output_scores=True, output_attentions=True, output_hidden_states=True,
    )
    assert out.sequences.shape == (1, 13) and len(out.scores) == 6
    assert_cache_layout(getattr(out, CACHE_KWARG), model.config, 1, 12)


def check_dict_outputs(out, config, batch: int, prompt: int, new: int, beams: int) -> None:
    """Scores, attentions, hidden states and cache of `generate(return_dict_in_generate=True)` with the cache on;
    all but the sequences hold one row per beam."""
    assert out.sequences.shape == (batch, prompt + new)
    batch *= beams
    assert len(out.scores) == new and all(s.shape == (batch, config.vocab_size) for s in out.scores)
    for step, (attentions, hidden) in enumerate(zip(out.attentions, out.hidden_states)):
        rows, keys = (prompt, prompt) if step == 0 else (1, prompt + step)
        assert len(attentions) == config.num_hidden_layers and len(hidden) == config.num_hidden_layers + 1
        for i, attn in enumerate(attentions):
            assert attn.shape == (batch, layer_heads(config, i), rows, keys), f"step {step} layer {i}: {attn.shape}"
        assert all(h.shape == (batch, rows, config.hidden_size) for h in hidden), f"step {step} hidden states"
    assert_cache_layout(getattr(out, CACHE_KWARG), config, batch, prompt + new - 1)


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("stack", list(STACKS))
def test_dict_outputs_with_cache_match_no_cache(stack, beams):
    """Greedy (beams=1) and beam search with every output: the cached run's tokens equal the uncached run's, its
    scores agree within fp32 tolerance, and every output has the contract's shape."""
    model = build_stack("eager", stack)
    outputs = dict(return_dict_in_generate=True, output_scores=True, output_attentions=True, output_hidden_states=True)
    run = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=beams, **outputs)
    cached, uncached = model.generate(PROMPT, use_cache=True, **run), model.generate(PROMPT, use_cache=False, **run)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step, (a, b) in enumerate(zip(cached.scores, uncached.scores)):
        assert_close(a.masked_fill(a.isinf(), 0), b.masked_fill(b.isinf(), 0), torch.float32, f"scores, step {step}")
    check_dict_outputs(cached, model.config, PROMPT.shape[0], PROMPT.shape[1], 4, beams)


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_static_cache_allocated_from_the_config(backend, stack):
    """transformers allocates the static cache up front for a chunked prefill, with the model's shapes
    (`_get_static_cache_init_shape`); generation then equals dynamic-cache greedy search, and so does a static cache
    built by hand as transformers' ExecuTorch recipe builds it: `StaticCache(config=...)` + `early_initialization`
    with the shapes transformers reads from the config (`get_head_shapes`)."""
    model = build_stack(backend, stack)
    greedy = model.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    run = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(model.generate(PROMPT, prefill_chunk_size=3, **run), greedy)
    cache = StaticCache(config=model.config, max_cache_len=16)
    cache.early_initialization(2, *get_head_shapes(model.config), dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(model.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                      **{CACHE_KWARG: cache}), greedy)


def test_keys_and_values_of_different_widths_are_allocated_by_the_first_forward():
    """V1 with value_head_dim = head_dim (converted models) caches 2d-wide keys and d-wide values, which one
    (num_key_value_heads, head_dim) cannot describe: the config marks the layers as transformers marks MLA layers
    (`qk_head_dim`), so `generate` leaves the static cache to the first forward, and still equals greedy search."""
    model = build_stack("sdpa", "V1-GQA", value_head_dim=16)
    assert [layer.qk_head_dim for layer in model.config.per_layer_config] == [32, 32]
    assert model._get_static_cache_init_shape() is None
    greedy = model.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    static = model.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False, prefill_chunk_size=3,
                            cache_implementation="static")
    assert torch.equal(static, greedy), f"static {static.tolist()} != greedy {greedy.tolist()}"


def test_per_layer_config_cannot_be_set():
    with pytest.raises(ValueError, match="attention_types"):
        DiffConfig(num_hidden_layers=2, per_layer_config={0: {"head_dim": 8}})


@pytest.mark.parametrize("stack", list(STACKS))
def test_static_cache_generation_from_inputs_embeds(stack):
    model = build_stack("sdpa", stack)
    greedy = model.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    embeds = model.get_input_embeddings()(PROMPT)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 cache_implementation="static")
    assert torch.equal(from_embeds, greedy[:, PROMPT.shape[1]:])


@pytest.mark.parametrize("stack", ["V1-GQA", pytest.param("V2", marks=pytest.mark.slow),
                                   pytest.param("hybrid", marks=pytest.mark.slow)])
def test_compiled_generation_returns_every_output(stack):
    """`generate` compiles the decode step (static cache, fullgraph) and still returns every output, equal to the
    uncompiled run."""
    torch._dynamo.reset()
    model = build_stack("eager", stack)
    outputs = dict(return_dict_in_generate=True, output_scores=True, output_attentions=True, output_hidden_states=True)
    run = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static", **outputs)
    eager = model.generate(PROMPT, **run)
    model.generation_config.compile_config = CompileConfig(fullgraph=True)
    model.generation_config.compile_config._compile_all_devices = True  # transformers compiles on GPUs only by default
    compiled = model.generate(PROMPT, **run)
    assert hasattr(model, "_compiled_call"), "generate did not compile the forward"
    assert torch.equal(compiled.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(compiled.scores, eager.scores)):
        assert_close(a, b, torch.float32, f"compiled scores, step {step}")
    assert len(compiled.attentions) == 4 and len(compiled.hidden_states) == 4


def test_can_record_outputs_format():
    """Each recorder is a str, a module class or an OutputRecorder, or a list of them (transformers' format)."""
    model = build_stack("eager", "hybrid")
    for name, recorders in model._can_record_outputs.items():
        for recorder in recorders if isinstance(recorders, list) else [recorders]:
            assert isinstance(recorder, (str, type, OutputRecorder)), f"{name}: {recorder!r}"


@pytest.mark.parametrize("stack", list(STACKS))
def test_returned_hidden_states_and_attentions_carry_gradients(stack):
    """`retain_grad` on the first hidden state and attention map: both lie on the path to the logits."""
    model = build_stack("eager", stack)
    out = model(PROMPT, output_hidden_states=True, output_attentions=True)
    hidden, attention = out.hidden_states[0], out.attentions[0]
    hidden.retain_grad(), attention.retain_grad()
    out.logits.flatten()[0].backward()
    assert hidden.grad is not None and attention.grad is not None
    assert attention.grad.abs().sum() > 0, "the attention map does not reach the logits"


def test_inherits_generation_mixin():
    """transformers' common test of the same name (tests/test_modeling_common.py): every generative class names
    `GenerationMixin` among its direct bases, as transformers' own classes do, rather than getting it through
    `LlamaForCausalLM` alone."""
    generative = [cls for cls in (DiffModel, DiffForCausalLM, DiffForSequenceClassification) if cls.can_generate()]
    assert generative == [DiffForCausalLM], generative
    for model_class in generative:
        assert "GenerationMixin" in str(model_class.__bases__), model_class.__bases__
