"""Generation: the cache under either argument name, transformers' generation contract, and pipeline("text-generation").

The cache reaches every layer under either argument name, and is never dropped silently: transformers 5.24 renamed
the forward argument `past_key_values` to `cache`; a model that reads only one name loses the cache under the other,
and every decode step then sees one token and no context. Each cache-name test here fails then.

transformers' generation contract for V1, V2 and hybrid stacks: assisted decoding, dict outputs with the cache,
the static cache transformers allocates from the config, compiled generation with every output, output recording
and gradients on returned hidden states and attentions.

The cache holds the model's own layout: a differential layer caches its keys packed (k1 | k2), so its cache is not
its query shape. The config describes each layer's cache as transformers reads it (`DiffConfig.per_layer_config`,
read by transformers' `get_head_shapes`), and the tests check the cache against what transformers reads, and that
transformers' own machinery (early static allocation, cropping in assisted decoding, beam reordering) works on it.

pipeline("text-generation") on a saved folder path: greedy, sampling, beam search, max_new_tokens, stop tokens and
batching."""

import warnings

import pytest
import torch
from helpers import STACKS, assert_close, build_stack
from helpers.folders import save_tiny_folder
from transformers import CompileConfig, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache, pipeline, set_seed
from transformers.integrations.executorch import get_head_shapes
from transformers.utils.output_capturing import OutputRecorder

from diff_transformer import DiffConfig, DiffForCausalLM, DiffForSequenceClassification, DiffModel
from diff_transformer.attention_kernels import DIFF_FLASH, triton_available
from diff_transformer.input_checks import CACHE_KWARG

needs_triton = pytest.mark.skipif(not triton_available()[0], reason=triton_available()[1])
BACKENDS = ["eager", "sdpa", pytest.param(DIFF_FLASH, marks=needs_triton)]


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_under_either_name_continues_the_sequence(backend, stack, name):
    """B2: a 6-token prefill then 3 one-token steps through a cache passed as `name`; each step's logits equal the
    full forward's at that position (fp32 tolerance), and the cache holds every token."""
    model = build_stack(backend, stack)
    tokens = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        steps = [model(tokens[:, :6], use_cache=True, **{name: cache}).logits[:, -1]]
        for t in range(6, 9):
            steps.append(model(tokens[:, t : t + 1], use_cache=True, **{name: cache}).logits[:, -1])
    assert cache.get_seq_length() == 9, f"the cache holds {cache.get_seq_length()} of 9 tokens"
    for step, logits in enumerate(steps):
        assert_close(logits, full[:, 5 + step], torch.float32, f"{backend} {stack} step {step} via {name}")


def test_both_names_at_once_are_never_silent():
    """Where transformers names the cache `cache`, its own deprecation handling warns that it ignores
    `past_key_values`, as for Llama; before the rename the model refuses the pair."""
    model = build_stack("sdpa", "V1-GQA")
    both = dict(cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))
    if CACHE_KWARG == "cache":
        with pytest.warns(FutureWarning, match="Both `past_key_values` and `cache` are set"):
            model(torch.tensor([[5, 6]]), **both)
    else:
        with pytest.raises(ValueError, match="both `cache` and `past_key_values`"):
            model(torch.tensor([[5, 6]]), **both)


@pytest.mark.parametrize("name", ["past", "layer_past", "past_key_value", "my_cache"])
def test_cache_under_a_foreign_name_raises(name):
    """A cache object (or a historical cache argument name) that no layer would read is an error, not a no-op."""
    model = build_stack("sdpa", "V1-GQA")
    with pytest.raises(TypeError, match=f"pass the cache as `{CACHE_KWARG}`"):
        model(torch.tensor([[5, 6]]), **{name: DynamicCache()})


def test_output_carries_the_cache_where_transformers_llama_does():
    """Our outputs name the cache as the installed transformers' own Llama does (`cache` from 5.24 on)."""
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    tokens = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        ours, theirs = build_stack("sdpa", "V1-GQA")(tokens, use_cache=True), llama(tokens, use_cache=True)
    assert list(ours.keys()) == list(theirs.keys())
    assert CACHE_KWARG in ours.keys() and ours[CACHE_KWARG].get_seq_length() == 3


def test_past_key_values_warns_where_transformers_renamed_it():
    """transformers >= 5.24 deprecates `past_key_values` with a FutureWarning in its own models; before, it is the
    library's current name and gets none."""
    model = build_stack("sdpa", "V1-GQA")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.tensor([[5, 6]]), past_key_values=DynamicCache(config=model.config), use_cache=True)
    deprecations = [w for w in caught if "`past_key_values` is deprecated" in str(w.message)]
    assert len(deprecations) == (1 if CACHE_KWARG == "cache" else 0), [str(w.message) for w in caught]
    assert all(w.category is FutureWarning for w in deprecations)


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


PROMPTS = ["k1 v2 k3 v4 ? k1", "k5 v6 ?", "k7 v8 k9 v10 k11 v12 ? k9"]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    folder = save_tiny_folder(tmp_path_factory.mktemp("model"))
    return pipeline("text-generation", model=str(folder))


def new_ids(generator, prompt: str, output: dict) -> list[int]:
    prompt_ids = generator.tokenizer(prompt)["input_ids"]
    ids = output["generated_token_ids"]
    while ids[0] == generator.tokenizer.pad_token_id:  # batched prompts are left-padded
        ids = ids[1:]
    assert ids[: len(prompt_ids)] == prompt_ids, "the output must start with the prompt"
    return ids[len(prompt_ids) :]


def generate(generator, prompts, **kwargs) -> list[list[dict]]:
    return generator(prompts, return_tensors=True, max_new_tokens=NEW_TOKENS, **kwargs)


def test_loads_from_folder_with_auto_classes(generator):
    assert type(generator.model) is DiffForCausalLM
    assert generator.tokenizer.padding_side == "left"


def test_greedy_max_new_tokens_and_text(generator):
    output = generator(PROMPTS[0], max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    ids = new_ids(generator, PROMPTS[0], generate(generator, PROMPTS[0], do_sample=False)[0])
    assert len(ids) == NEW_TOKENS
    prompt_ids = generator.tokenizer(PROMPTS[0])["input_ids"]

    def decode(token_ids: list[int]) -> str:
        return generator.tokenizer.decode(token_ids, skip_special_tokens=True)

    # pipeline decodes prompt and new tokens together, without special tokens, and keeps what follows the prompt
    assert output == PROMPTS[0] + decode(prompt_ids + ids)[len(decode(prompt_ids)):], output


def test_batched_equals_one_by_one(generator):
    one_by_one = [new_ids(generator, p, generate(generator, p, do_sample=False)[0]) for p in PROMPTS]
    batched = generate(generator, PROMPTS, do_sample=False, batch_size=len(PROMPTS))
    assert [new_ids(generator, p, out[0]) for p, out in zip(PROMPTS, batched)] == one_by_one


def test_sampling_is_seeded(generator):
    def sample(seed: int) -> list[int]:
        set_seed(seed)
        return new_ids(generator, PROMPTS[1], generate(generator, PROMPTS[1], do_sample=True, temperature=1.5)[0])

    assert sample(0) == sample(0)
    assert sample(0) != sample(1)


def test_beam_search(generator):
    outputs = generate(generator, PROMPTS[0], num_beams=3, num_return_sequences=3, do_sample=False)
    beams = [new_ids(generator, PROMPTS[0], out) for out in outputs]
    assert len({tuple(b) for b in beams}) == 3, beams
    prompt = generator.tokenizer(PROMPTS[0], return_tensors="pt")
    direct = generator.model.generate(**prompt, num_beams=3, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert beams[0] == direct[0, prompt["input_ids"].shape[1] :].tolist()


def test_stop_token_ends_generation(generator):
    greedy = new_ids(generator, PROMPTS[2], generate(generator, PROMPTS[2], do_sample=False)[0])
    words = [generator.tokenizer.decode([token]) for token in greedy]
    # a token past the first that decodes to whole printable characters on its own, so it also works as a stop string
    stop = next(t for t, w in zip(greedy[1:], words[1:]) if w.isprintable() and "\ufffd" not in w)
    stopped = new_ids(generator, PROMPTS[2], generate(generator, PROMPTS[2], do_sample=False, eos_token_id=stop)[0])
    assert stopped == greedy[: greedy.index(stop) + 1], (stopped, greedy)
    word = generator.tokenizer.decode([stop])
    text = generator(PROMPTS[2], max_new_tokens=NEW_TOKENS, do_sample=False, stop_sequence=word)[0]["generated_text"]
    expected = PROMPTS[2] + generator.tokenizer.decode(greedy[: greedy.index(stop) + 1])
    assert text == expected, (text, expected)
