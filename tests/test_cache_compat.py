"""The cache reaches every layer under either argument name, and is never dropped silently (issue #14).

transformers 5.24 renamed the forward argument `past_key_values` to `cache`; a model that reads only one name loses
the cache under the other, and every decode step then sees one token and no context. Each test here fails then.
"""

import warnings

import pytest
import torch
from helpers import STACKS, assert_close, build_stack
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from diff_transformer.modeling_diff import CACHE_KWARG, DIFF_FLASH, triton_available

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
