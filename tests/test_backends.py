"""Every attention backend against `eager` on a whole tiny model; the fused `diff_flash` kernel end to end.

CPU limits (torch 2.13): flex_attention has no backward and its cached decode fails to compile, so on CPU only its
prefill forward is checked; flash_attention_2 needs CUDA and the flash-attn package. `diff_flash` runs under the
Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1), so its configs are tiny.
"""

import importlib.util

import pytest
import torch
from helpers import (DTYPE_HEADS_PADDING, HEADS, PADDED, assert_close, attention_mask, grad_kind, left_padded,
                     tf32_kind, tiny_config)
from transformers import AutoModelForCausalLM, StaticCache

from diff_transformer import DiffForCausalLM
from diff_transformer import attention_kernels
from diff_transformer.attention_kernels import DIFF_FLASH, triton_available
from diff_transformer.kernel_tiled import tiled_diff_attention

HAS_CUDA = torch.cuda.is_available()
HAS_FLASH = HAS_CUDA and importlib.util.find_spec("flash_attn") is not None
HAS_TRITON = triton_available()[0]
DEVICE = "cuda" if HAS_CUDA else "cpu"

needs_flash = [pytest.mark.gpu,
               pytest.mark.skipif(not HAS_FLASH, reason="flash_attention_2 needs the flash-attn package")]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=triton_available()[1])
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

TRAIN_BACKENDS = [
    pytest.param("sdpa"),
    pytest.param("flash_attention_2", marks=needs_flash),
    pytest.param(DIFF_FLASH, marks=needs_triton),
    pytest.param("flex_attention", marks=gpu),  # no flex backward on CPU
]
DECODE_BACKENDS = [
    pytest.param("sdpa"),
    pytest.param("flash_attention_2", marks=needs_flash),
    pytest.param(DIFF_FLASH, marks=needs_triton),
    pytest.param("flex_attention", marks=gpu),  # cached flex decode hits an inductor C++ compile error on CPU
]


def build(backend: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> DiffForCausalLM:
    torch.manual_seed(seed)
    fields = dict(hidden_size=64, num_hidden_layers=1, **HEADS["GQA"])  # d = 16: the fused kernel's smallest head
    fields.update(overrides)
    model = DiffForCausalLM._from_config(tiny_config(**fields), attn_implementation=backend)
    with torch.no_grad():  # norm gains start at 1; perturb them so a skipped one shows
        for name, param in model.named_parameters():
            if "norm" in name or "subln" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model.to(DEVICE, dtype).eval()


def batch_and_mask(padded: bool, batch: int = 2, length: int = 12):
    tokens = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    return tokens, attention_mask(padded, batch, length, DEVICE)


def loss_and_grads(model: DiffForCausalLM, tokens, mask):
    previous_valid = torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], dim=1)
    labels = tokens.masked_fill((mask == 0) | (previous_valid == 0), -100)  # pad rows' outputs are unspecified
    out = model(tokens, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@DTYPE_HEADS_PADDING
@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
def test_loss_and_all_gradients_match_eager(backend, dtype, heads, padded):
    """B2-T12-H2-D16, 1 layer: logits (valid rows), loss and the gradient of every parameter vs eager."""
    tokens, mask = batch_and_mask(padded)
    results = {}
    for name in ("eager", backend):
        results[name] = loss_and_grads(build(name, dtype, **HEADS[heads]).train(), tokens, mask)
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = results[backend], results["eager"]
    rows = mask.bool()
    assert_close(logits[rows], ref_logits[rows], dtype, f"{backend} logits", tf32_kind("backend", backend))
    assert_close(loss, ref_loss, dtype, f"{backend} loss", tf32_kind("backend", backend))
    for name, grad in ref_grads.items():
        assert_close(grads[name], grad, dtype, f"{backend} d{name}", tf32_kind(grad_kind(name, "backend"), backend))


@pytest.mark.skipif(HAS_CUDA, reason="the tiled route is sdpa's on CPU")
@PADDED
@pytest.mark.parametrize("heads", list(HEADS))
def test_sdpa_tiled_cpu_route_matches_eager(monkeypatch, heads, padded):
    """B2-T160-H2-D64, 1 layer: long enough for sdpa's CPU route to take the tiled kernel (two tiles); loss,
    logits and every parameter gradient vs eager."""
    calls = []
    monkeypatch.setattr(attention_kernels, "tiled_diff_attention",
                        lambda *args, **kwargs: calls.append(args[0].shape) or tiled_diff_attention(*args, **kwargs))
    tokens, mask = batch_and_mask(padded, length=160)
    results = {name: loss_and_grads(build(name, hidden_size=256, **HEADS[heads]).train(), tokens, mask)
               for name in ("eager", "sdpa")}
    assert calls, "sdpa did not take the tiled route"
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = results["sdpa"], results["eager"]
    rows = mask.bool()
    assert_close(logits[rows], ref_logits[rows], torch.float32, "tiled sdpa logits", "backend")
    assert_close(loss, ref_loss, torch.float32, "tiled sdpa loss", "backend")
    for name, grad in ref_grads.items():
        assert_close(grads[name], grad, torch.float32, f"tiled sdpa d{name}", "backend")


@DTYPE_HEADS_PADDING
def test_flex_prefill_forward_matches_eager(dtype, heads, padded):
    """B2-T12-H2-D16: flex_attention forward logits vs eager (the part of flex that runs on CPU)."""
    tokens, mask = batch_and_mask(padded)
    with torch.no_grad():
        logits = build("flex_attention", dtype, **HEADS[heads])(tokens, attention_mask=mask).logits
        ref = build("eager", dtype, **HEADS[heads])(tokens, attention_mask=mask).logits
    rows = mask.bool()
    assert_close(logits[rows], ref[rows], dtype, "flex_attention logits", "backend")


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_cached_decode_matches_eager(backend, heads):
    """B2-T6 prompt + 8 cached greedy steps: same tokens and per-step logits as eager."""
    prompt = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    outputs = {}
    for name in ("eager", backend):
        model = build(name, **HEADS[heads])
        outputs[name] = model.generate(prompt, max_new_tokens=8, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True)
    assert torch.equal(outputs[backend].sequences, outputs["eager"].sequences), f"{backend} greedy tokens differ"
    for step, (got, ref) in enumerate(zip(outputs[backend].logits, outputs["eager"].logits)):
        assert_close(got, ref, torch.float32, f"{backend} step {step} logits", tf32_kind("backend", backend))


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_left_padded_batch_generation_equals_one_by_one(backend):
    """GQA, prompts of 7, 3, 5 tokens left-padded into one batch vs each alone: same 6 greedy tokens."""
    model = build(backend)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=gen).to(DEVICE) for n in (7, 3, 5)]
    batch, mask = left_padded(prompts, DEVICE)
    together = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(together[i, batch.shape[1]:], alone[0, len(p):]), f"{backend}: prompt {i} differs batched"


@pytest.mark.parametrize("backend", [pytest.param("sdpa"), pytest.param(DIFF_FLASH, marks=needs_triton)])
@PADDED
def test_static_cache_prefill_and_decode_match_eager(backend, padded):
    """A static cache hands prefill S = max_cache_len > T keys (unfilled slots) with a skipped (None) sdpa mask:
    the fused kernel must use top-left causality there. Prefill and two decode steps vs eager."""
    tokens, mask = batch_and_mask(padded, length=8)
    step_logits = {}
    for name in ("eager", backend):
        model = build(name)
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            out = model(tokens, attention_mask=mask, cache=cache, use_cache=True)
            logits = [out.logits[mask.bool()]]
            for step in range(2):
                next_token = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
                position = torch.tensor([[tokens.shape[1] + step]], device=DEVICE)
                out = model(next_token, attention_mask=mask, cache=cache, use_cache=True,
                            position_ids=(mask.cumsum(-1) - 1)[:, -1:] if padded else position)
                logits.append(out.logits[:, -1])
        step_logits[name] = logits
        mask = mask[:, : tokens.shape[1]]
    for step, (got, ref) in enumerate(zip(step_logits[backend], step_logits["eager"])):
        assert_close(got, ref, torch.float32, f"{backend} static cache step {step}", tf32_kind("backend", backend))


@needs_triton
def test_fused_kernel_receives_expected_masks(monkeypatch):
    """How the sdpa mask reaches diff_flash's prefill and its decode steps (sdpa's decode kernel, `select_kernel`;
    the fused kernel where the step is compiled, as static-cache generation on a GPU does): None without padding
    (prefill T == S, decode T == 1), bool [B, 1, T, S] with left padding and in static-cache decoding, whose
    prefill mask is skipped and comes with S > T."""
    seen = []

    def spy(name):
        kernel = attention_kernels.DIFF_KERNELS[name]

        def spied(module, q, k, v, lam, attention_mask, scaling, **kwargs):
            mask = None if attention_mask is None else (attention_mask.dtype, tuple(attention_mask.shape))
            seen.append((q.shape[2], k.shape[2], mask))
            return kernel(module, q, k, v, lam, attention_mask, scaling, **kwargs)
        return spied

    for name in (DIFF_FLASH, "sdpa_decode_step"):
        monkeypatch.setitem(attention_kernels.DIFF_KERNELS, name, spy(name))
    model = build(DIFF_FLASH)
    tokens, mask = batch_and_mask(padded=True, length=6)
    model.generate(tokens, max_new_tokens=2, do_sample=False)
    assert seen == [(6, 6, None), (1, 7, None)]
    seen.clear()
    model.generate(tokens, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert seen == [(6, 6, (torch.bool, (2, 1, 6, 6))), (1, 7, (torch.bool, (2, 1, 1, 7)))]
    seen.clear()
    model.generate(tokens, max_new_tokens=2, do_sample=False, cache_implementation="static")
    (prefill_t, prefill_s, prefill_mask), (_, decode_s, decode_mask) = seen
    assert (prefill_t, prefill_mask) == (6, None) and prefill_s > prefill_t
    assert decode_mask == (torch.bool, (2, 1, 1, decode_s))


@needs_triton
def test_fused_greedy_generation_matches_eager_and_full_forward():
    """GQA, B2-T6: diff_flash cached greedy tokens equal eager's and an uncached argmax loop (6 new tokens)."""
    model, ref = build(DIFF_FLASH), build("eager")
    prompt = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, ref.generate(prompt, max_new_tokens=6, do_sample=False))
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, seq)


@needs_triton
def test_fused_from_pretrained_and_set_attn_implementation(tmp_path):
    model = build("eager")
    tokens, _ = batch_and_mask(padded=False, length=8)
    with torch.no_grad():
        ref = model(tokens).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=DIFF_FLASH).to(DEVICE)
    assert loaded.config._attn_implementation == DIFF_FLASH
    model.set_attn_implementation(DIFF_FLASH)
    assert model.config._attn_implementation == DIFF_FLASH
    with torch.no_grad():
        for m in (loaded.eval(), model):
            assert_close(m(tokens).logits, ref, torch.float32, "diff_flash logits after load / set",
                         tf32_kind("backend", DIFF_FLASH))


def test_fused_unavailable_raises_clear_error(monkeypatch):
    monkeypatch.setattr(attention_kernels, "triton_available", lambda: (False, "no CUDA GPU (test)"))
    with pytest.raises(ValueError, match=r"attn_implementation='diff_flash' is unavailable: no CUDA GPU \(test\)"):
        DiffForCausalLM._from_config(tiny_config(), attn_implementation=DIFF_FLASH)
