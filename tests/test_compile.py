"""Static cache and torch.compile: no graph breaks in the model, compiled static-cache decoding equals dynamic."""

import pytest
import torch
from helpers import tiny_config
from transformers import StaticCache

from diff_transformer import DiffForCausalLM
from diff_transformer.attention_kernels import DIFF_FLASH

BACKENDS = ["eager", "sdpa"]
# diff_flash only on a GPU (the Triton interpreter does not run under torch.compile), and with graph breaks around
# its launcher (docs/kernels.md), so not under fullgraph=True
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WITH_BREAKS = [*BACKENDS, pytest.param(DIFF_FLASH, marks=ON_GPU)]
VERSIONS = {"V1": dict(diff_version=1), "V2": dict(diff_version=2)}


def build(backend: str, **overrides) -> DiffForCausalLM:
    fields = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    fields.update(overrides)
    model = DiffForCausalLM._from_config(tiny_config(**fields), attn_implementation=backend).eval()
    return model.cuda() if backend == DIFF_FLASH else model


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("backend", WITH_BREAKS)
def test_static_cache_generation_equals_dynamic(backend, version):
    model = build(backend, **VERSIONS[version])
    prompt = torch.randint(3, 97, (2, 7)).to(model.device)
    dynamic = model.generate(prompt, max_new_tokens=10, do_sample=False)
    static = model.generate(prompt, max_new_tokens=10, do_sample=False, cache_implementation="static")
    assert torch.equal(static, dynamic)


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_forward_has_no_graph_breaks(backend, version, step):
    """torch._dynamo.explain over a static-cache forward: one graph, no breaks (check_token_ids and the lambda
    stay traceable; the token-range check is skipped while compiling)."""
    torch._dynamo.reset()
    model = build(backend, **VERSIONS[version])
    cache = StaticCache(config=model.config, max_cache_len=16)
    tokens = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        model(tokens, cache=cache, use_cache=True)
    if step == "decode":
        tokens = tokens[:, -1:]
    position_ids = torch.full((1, tokens.shape[1]), 6) if step == "decode" else torch.arange(6)[None]
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(tokens, cache=cache, use_cache=True,
                                                   position_ids=position_ids)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("eager", marks=pytest.mark.slow),
                                     pytest.param(DIFF_FLASH, marks=ON_GPU)])
def test_compiled_static_cache_generation_equals_dynamic(backend):
    """torch.compile(fullgraph=True; diff_flash: with its graph breaks) of the forward + static cache: the same
    greedy tokens as dynamic-cache eager."""
    torch._dynamo.reset()
    model = build(backend, num_hidden_layers=1)
    prompt = torch.randint(3, 97, (1, 5)).to(model.device)
    dynamic = model.generate(prompt, max_new_tokens=6, do_sample=False)
    model.forward = torch.compile(model.forward, fullgraph=backend != DIFF_FLASH)
    compiled = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(compiled, dynamic)
