"""transformers' continuous batching (`generate_batch` on the paged cache) runs DIFF V1 (MHA, GQA), V2 and hybrid
stacks: each request gets plain `generate`'s greedy tokens and log-probabilities, with prompts of different lengths
in one batch, one longer than a cache page; what cannot run under batching raises before any request."""

import gc

import pytest
import torch
from helpers import STACKS, tiny_config
from transformers import ContinuousBatchingConfig, GenerationConfig

from diff_transformer import DiffForCausalLM
from diff_transformer.attention_kernels import DIFF_FLASH, triton_available
from diff_transformer.paged_cache import LLAMA_TAKES_CACHE, UPDATE_TAKES_KWARGS, paged_cache_heads

needs_batching = pytest.mark.skipif(not UPDATE_TAKES_KWARGS, reason="this transformers' paged cache is refused")
PAGE = 16  # tokens per cache page; the second prompt spans two pages
PROMPTS = [[5, 17, 33, 8, 61], torch.randint(4, 97, (PAGE + 7,), generator=torch.Generator().manual_seed(3)).tolist(),
           [40, 2, 77, 12, 9, 30, 51, 6, 25]]
NEW_TOKENS = 5
LOGPROB_ATOL = 1e-4  # fp32, the same logits through differently batched forwards; measured differences are ~1e-6

# name: (config overrides, d-wide heads per token of the paged cache, tiny_config's h_kv being 2 unless overridden)
CASES = {
    "V1-MHA": ({}, 4),
    "V1-GQA": (STACKS["V1-GQA"], 2),
    "V2": (STACKS["V2"], 2),
    "hybrid": (STACKS["hybrid"], 4),
    # keys and values of different widths: V1 values zero-padded to the packed keys' row, and a converted model's
    # standard layers (value_head_dim = head_dim) padded to its differential layers' keys
    "V1-dv=d": (dict(value_head_dim=16), 4),
    "hybrid-dv=d": (dict(STACKS["hybrid"], value_head_dim=16), 4),
}


@pytest.fixture(autouse=True, scope="module")
def frozen_gc():
    """transformers' batching manager calls gc.collect() twice as it stops, about a second each over the objects of
    torch and the test session; frozen objects are skipped, so a generate_batch call takes a fraction of that."""
    gc.freeze()
    yield
    gc.unfreeze()


def build(case: str, backend: str) -> DiffForCausalLM:
    """A seeded tiny model whose weights (std 0.2) give peaked, distinct next-token choices."""
    torch.manual_seed(0)
    config = tiny_config(**CASES[case][0], initializer_range=0.2)
    return DiffForCausalLM._from_config(config, attn_implementation=backend).eval()


def greedy(model: DiffForCausalLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Plain `generate`'s greedy tokens after `prompt` and their log-probabilities."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):]
    logprobs = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.scores, tokens)])
    return tokens.tolist(), logprobs


def generate_batch(model: DiffForCausalLM, prompts: list[list[int]]):
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, max_batch_tokens=64, return_logprobs=True)
    results = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    return list(results.values())


# the dv = d width mapping is the backend's, so sdpa alone covers those cases
BATCHING_CASES = [(case, backend) for backend in ("sdpa", "paged|eager") for case in CASES
                  if not (backend == "paged|eager" and case.endswith("dv=d"))]


@needs_batching
@pytest.mark.parametrize("case,backend", BATCHING_CASES)
def test_generate_batch_matches_generate(case, backend):
    """Three prompts (5, PAGE + 7 and 9 tokens) batched together: every request's tokens are plain `generate`'s
    and their log-probabilities agree within fp32 error. The cache rows have the heads the layout asks."""
    model = build(case, backend)
    assert paged_cache_heads(model.config) == CASES[case][1]
    if backend == "paged|eager" and case.startswith("hybrid") and not LLAMA_TAKES_CACHE:
        with pytest.raises(ValueError, match="attn_implementation=\"sdpa\""):
            generate_batch(model, PROMPTS)  # this release's paged|eager function updates the cache itself
        return
    results = generate_batch(model, PROMPTS)
    assert [r.error for r in results] == [None] * len(PROMPTS), [r.error for r in results]
    for prompt, result in zip(PROMPTS, results):
        tokens, logprobs = greedy(model, prompt)
        assert result.generated_tokens == tokens, (f"{case} {backend} prompt of {len(prompt)}: "
                                                   f"{result.generated_tokens} != generate's {tokens}")
        diff = (torch.tensor(result.logprobs) - logprobs).abs()
        assert diff.max() < LOGPROB_ATOL, (f"{case} {backend}: log-probs max diff {diff.max():.2e}, "
                                           f"mean {diff.mean():.2e}")
    assert model.config._attn_implementation == backend, "batching left the model on another backend"


@needs_batching
def test_paged_sdpa_name_runs_sdpa():
    """`attn_implementation="paged|sdpa"` (the older name) loads as sdpa, and batching gives generate's tokens."""
    with pytest.warns(FutureWarning, match="paged"):
        model = build("hybrid", "paged|sdpa")
    assert model.config._attn_implementation == "sdpa"
    results = generate_batch(model, PROMPTS)
    assert [r.generated_tokens for r in results] == [greedy(model, prompt)[0] for prompt in PROMPTS]


@needs_batching
def test_batched_requests_see_only_their_own_prompt():
    """A request's tokens do not depend on what it is batched with: alone or with the others, the same."""
    model = build("V1-GQA", "sdpa")
    together = generate_batch(model, PROMPTS)
    alone = generate_batch(model, PROMPTS[1:2])
    assert alone[0].generated_tokens == together[1].generated_tokens
    assert abs(alone[0].logprobs[-1] - together[1].logprobs[-1]) < LOGPROB_ATOL


REFUSED = ["flash_attention_2", "flex_attention", pytest.param(DIFF_FLASH, marks=pytest.mark.skipif(
    not triton_available()[0], reason=triton_available()[1]))]


@needs_batching
@pytest.mark.parametrize("backend", REFUSED)
def test_unsupported_backend_is_refused_before_any_request(backend):
    """A backend whose kernels do not read a packed batch's mask raises at once, naming the fix, instead of
    returning empty outputs; the model keeps its backend."""
    model = build("V1-GQA", "sdpa")
    if backend == "flash_attention_2":  # what loading with (paged|)flash_attention_2 leaves on a GPU with flash-attn
        model.config._attn_implementation = backend
    else:
        model.set_attn_implementation(backend)
    with pytest.raises(ValueError, match="attn_implementation 'sdpa'"):
        generate_batch(model, PROMPTS)
    assert model.config._attn_implementation == backend


@pytest.mark.skipif(UPDATE_TAKES_KWARGS, reason="this transformers' paged cache is supported")
def test_older_paged_cache_is_refused():
    """Before any request, with that release's own batching defaults (its ContinuousBatchingConfig has no page_size)."""
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(NotImplementedError, match="upgrade transformers"):
        build("V1-GQA", "sdpa").generate_batch(PROMPTS, generation_config=generation)


@needs_batching
def test_generate_batch_bounds_its_cache_from_its_prompts():
    """Without num_blocks, `generate_batch` sizes the paged cache for its own requests (each its prompt plus
    max_new_tokens, in pages) and gives the same tokens as with an explicit bound (before: transformers' default,
    most of the free RAM, 12.4 GB for a 3M-parameter model)."""
    model = build("V1-MHA", "sdpa")
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=PAGE, max_batch_tokens=64)
    try:
        results = model.generate_batch(PROMPTS, generation_config=generation, continuous_batching_config=batching,
                                       persistent_manager=True)
        resolved = model._cached_continuous_batching_manager.continuous_batching_config
    finally:
        model.destroy_cached_continuous_batching_manager()
    pages = sum(-(-(len(prompt) + NEW_TOKENS) // PAGE) for prompt in PROMPTS)
    expected = len(PROMPTS) * -(-(max(map(len, PROMPTS)) + NEW_TOKENS) // PAGE)  # every request as the longest
    assert pages <= resolved.num_blocks <= expected + 2, (resolved.num_blocks, pages, expected)
    assert [r.generated_tokens for r in results.values()] == [r.generated_tokens for r in
                                                              generate_batch(model, PROMPTS)]
