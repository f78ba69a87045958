"""Grouped differential attention (GDA, arXiv 2510.06949; `num_noise_heads`): g noise heads, each serving h / g
differential heads, its map A2 subtracted with the layer's lambda in every head of its group.

The float64 reference (kernel_naive.py, `group=`) is first checked against the formula written per head in this
file; then every kernel against the reference for group sizes 1, 2 and 4 (MHA, GQA; causal, padded, decode;
output and gradients), ids as `B2-T16-H4-N2-KV2-D16`. A GDA model equals the plain DIFF model whose branch-2 query
rows are its noise rows copied over each group, caches and batches as one, and what cannot run it refuses in
one line."""

import pytest
import torch
from helpers import assert_close, tf32_kind, tiny_config
from helpers.kernel_cases import Case, check_against_reference, empty_rows, leaves, padding_mask, seeded_randn

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.attention_kernels import DIFF_FLASH, run_kernel, triton_available
from diff_transformer.diff_tensor_parallel import check_tp_size
from diff_transformer.kernel_naive import naive_diff_attention
from diff_transformer.kernel_tiled import tiled_diff_attention
from diff_transformer.serving.layout import check_servable

NAMES = ("out", "dq", "dk", "dv", "dlam")
# (H, N, KV): group sizes 1 (MHA), 2 and 4 (GQA; a noise head reads the k2 of one kv head, so KV divides N)
HEADS = [(4, 4, 4), (4, 2, 2), (4, 2, 1), (4, 1, 1), (8, 2, 2)]
CASES = [Case(2, 16, 16, h, kv, 16, N=n) for h, n, kv in HEADS]
CASES += [Case(2, 16, 16, 4, 2, 16, N=2, attn="padmask"), Case(2, 16, 16, 4, 1, 16, N=1, attn="padmask"),
          Case(2, 1, 16, 4, 2, 16, N=2), Case(2, 1, 16, 8, 2, 16, N=2)]  # decode steps
# kernel -> (backend it runs under, tolerance kind); `tiled` and `sdpa_decode_step` are picked by shape in a model
KERNELS = {"eager": ("eager", "tiled"), "standard_calls": ("sdpa", "sdpa"), "tiled": ("sdpa", "tiled"),
           "sdpa_decode_step": ("sdpa", "sdpa"), DIFF_FLASH: (DIFF_FLASH, DIFF_FLASH)}


def per_head_formula(q, k, v, lam, scaling, case: Case, mask):
    """out [B, T, H, DV] float64, written head by head: head j takes its query q1_j, its noise head's query
    q2_(j // (H / N)) and kv head j // (H / KV)."""
    h, d, group = case.H, case.D, case.H // case.noise
    q, k, v = q.double(), k.double(), v.double()
    allowed = torch.ones(case.T, case.S, dtype=torch.bool).tril(case.S - case.T) if mask is None else mask[:, 0]
    outs = []
    for j in range(h):
        m = j // (h // case.KV)
        scores1 = (q[:, j] @ k[:, m, :, :d].mT * scaling).masked_fill(~allowed, float("-inf"))
        scores2 = (q[:, h + j // group] @ k[:, m, :, d:].mT * scaling).masked_fill(~allowed, float("-inf"))
        diff = scores1.softmax(-1) - lam.double() * scores2.softmax(-1)
        outs.append(torch.nan_to_num(diff) @ v[:, m])  # rows without keys: NaN -> 0
    return torch.stack(outs, dim=2)


def layer_for(case: Case, backend: str) -> torch.nn.Module:
    """The real attention layer of a one-layer GDA model of the case's heads, under `backend`."""
    config = tiny_config(hidden_size=64, num_hidden_layers=1, num_attention_heads=case.H,
                         num_key_value_heads=case.KV, num_noise_heads=case.N, head_dim=case.D)
    model = DiffForCausalLM._from_config(config, attn_implementation=backend)
    return model.model.layers[0].self_attn


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_is_the_per_head_formula(case: Case):
    q, k, v, lam = (t.detach() for t in leaves(case, torch.float64))
    mask, scaling = padding_mask(case), case.D**-0.5
    expected = per_head_formula(q, k, v, lam, scaling, case, mask)
    got = naive_diff_attention(q, k, v, lam, scaling, mask=mask, group=case.H // case.noise)
    keep = ~empty_rows(case)
    assert_close(got[keep], expected[keep], torch.float64, f"{case.id} reference", "model")


def check_kernel(name: str, backend: str, kind: str, case: Case) -> None:
    device = "cuda" if name == DIFF_FLASH and torch.cuda.is_available() else "cpu"  # Triton: interpreted on CPU
    layer, mask, scaling = layer_for(case, backend).to(device), padding_mask(case, device), case.D**-0.5
    empty = empty_rows(case).to(device)
    grad_out = seeded_randn(case.B, case.T, case.H, case.dv, seed=99).to(device)
    grad_out[empty] = 0  # a model never sends gradient into rows that see no key
    group = case.H // case.noise
    check_against_reference(lambda *t: run_kernel(name, layer, *t, mask, scaling)[0].float(),
                            lambda *t: naive_diff_attention(*t, scaling, mask=mask, group=group),
                            leaves(case, torch.float32, device=device), grad_out, NAMES, torch.float32,
                            tf32_kind(kind, name), f"{name} {case.id}", rows=~empty)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_matches_reference(name: str, case: Case):
    if name == "sdpa_decode_step" and case.T != 1:
        pytest.skip("one query row only")
    if name == DIFF_FLASH and not triton_available()[0]:
        pytest.skip(triton_available()[1])
    check_kernel(name, *KERNELS[name], case)


# inference (no gradients): `tiled` takes the g noise queries as they are, each noise map once per tile; one tile
# and several (rows 5: tiles of 5 rows, the last one short); two noise heads per kv head, so a wrong order shows
GROUPED_CASES = CASES + [Case(2, 16, 16, 8, 2, 16, N=4), Case(2, 16, 16, 8, 2, 16, N=4, attn="padmask")]


@pytest.mark.parametrize("rows", [128, 5])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: c.id)
def test_tiled_inference_computes_each_noise_map_once(case: Case, rows: int):
    q, k, v, lam = (t.detach() for t in leaves(case, torch.float32))
    mask, scaling, group = padding_mask(case), case.D**-0.5, case.H // case.noise
    with torch.no_grad():
        got = tiled_diff_attention(q, k, v, lam, scaling, mask, rows=rows, group=group)
    expected = naive_diff_attention(q.double(), k.double(), v.double(), lam.double(), scaling, mask=mask, group=group)
    keep = ~empty_rows(case)
    assert_close(got[keep], expected[keep].float(), torch.float32, f"tiled inference {case.id} rows {rows}", "tiled")


# ---- whole models ----------------------------------------------------------------------------------------------

GDA = dict(num_attention_heads=4, num_key_value_heads=2, num_noise_heads=2, head_dim=16, initializer_range=0.1,
           lambda_std_dev=0.3)


def gda_and_copied(backend: str) -> tuple[DiffForCausalLM, DiffForCausalLM]:
    """A seeded GDA model and the plain DIFF model with its weights, each noise head's q rows copied to the heads
    of its group."""
    torch.manual_seed(0)
    gda = DiffForCausalLM._from_config(tiny_config(**GDA), attn_implementation=backend).eval()
    plain = DiffForCausalLM._from_config(tiny_config(**{**GDA, "num_noise_heads": None}),
                                         attn_implementation=backend).eval()
    state, d, h = gda.state_dict(), 16, 4
    for key, value in list(state.items()):
        if key.endswith("q_proj.weight"):
            noise = value[h * d:].view(2, d, -1).repeat_interleave(2, dim=0).reshape(h * d, -1)
            state[key] = torch.cat([value[: h * d], noise])
    plain.load_state_dict(state)
    return gda, plain


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_model_equals_the_copied_plain_model(backend: str):
    gda, plain = gda_and_copied(backend)
    assert plain.num_parameters() - gda.num_parameters() == 2 * 2 * 16 * 64  # 2 layers, 2 copies of 16 x 64 rows
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(gda(ids).logits, plain(ids).logits, torch.float32, f"{backend} GDA vs copied", "backend")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_generate_with_cache_equals_full_forwards(backend: str, cache: str):
    """Left-padded greedy generation on a dynamic cache, and on a static one allocated before the first forward
    (chunked prefill) from the layers' cache geometry."""
    gda, _ = gda_and_copied(backend)
    prompt = torch.tensor([[0, 0, 5, 17, 33], [8, 61, 40, 2, 77]])
    mask = (prompt != 0).long()
    static = dict(cache_implementation="static", prefill_chunk_size=3) if cache == "static" else {}
    out = gda.generate(prompt, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                       pad_token_id=0, **static)
    sequence = prompt
    with torch.no_grad():
        for _ in range(6):
            full = torch.cat([mask, torch.ones(2, sequence.shape[1] - mask.shape[1], dtype=torch.long)], 1)
            logits = gda(sequence, attention_mask=full, use_cache=False).logits[:, -1]
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, sequence), f"{backend}: generate {out.tolist()} != full forwards {sequence.tolist()}"


def test_continuous_batching_equals_generate():
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from diff_transformer.paged_cache import UPDATE_TAKES_KWARGS

    if not UPDATE_TAKES_KWARGS:
        pytest.skip("this transformers' paged cache is refused")
    gda, _ = gda_and_copied("sdpa")
    prompts = [[5, 17, 33, 8, 61], [40, 2, 77, 12, 9, 30, 51, 6, 25]]
    generation = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=8, max_batch_tokens=32)
    results = gda.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    for prompt, result in zip(prompts, results.values()):
        expected = gda.generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                pad_token_id=0)[0, len(prompt):]
        assert result.generated_tokens == expected.tolist(), (prompt, result.generated_tokens, expected.tolist())


@pytest.mark.parametrize("fields, named", [
    (dict(num_attention_heads=4, num_key_value_heads=2, num_noise_heads=3), "num_noise_heads (3) must divide"),
    (dict(num_attention_heads=4, num_key_value_heads=4, num_noise_heads=2), "multiple of num_key_value_heads (4)"),
    (dict(num_attention_heads=4, num_noise_heads=2, diff_version=2), "diff_version=1 only"),
    (dict(num_attention_heads=4, num_noise_heads=0), "num_noise_heads must be a positive integer"),
])
def test_invalid_noise_heads_are_refused_in_one_line(fields, named):
    with pytest.raises(ValueError, match="num_noise_heads") as error:
        DiffConfig(hidden_size=64, **fields)
    assert named in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_tensor_parallelism_refuses_grouped_noise_heads_and_vllm_serves_them():
    """transformers' tensor parallelism refuses GDA in one line (its styles split q_proj's branches alike); the vLLM
    mapping serves it (tokens: tests/vllm_serving), on one rank or on two when each holds whole kv heads."""
    config = tiny_config(**GDA)
    check_tp_size(config, 1)
    with pytest.raises(ValueError, match="num_noise_heads=2") as error:
        check_tp_size(config, 2)
    assert "--expand-noise-heads" in str(error.value) and "\n" not in str(error.value)
    assert check_servable(config)["differential"] == 2 * config.head_dim
