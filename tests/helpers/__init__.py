"""What the tests share: `assert_close` and its tolerance table, tiny configs and models, padding, and a whole
attention layer in fp64 from its raw weight matrices (`reference_diff_attention`: projections, RoPE, SubLN and the
output projection written from docs/design.md, the attention itself the package's one fp64 reference,
`naive_diff_attention`). Reading raw weights (no model code) checks the weight row layout as well.

The package's modules hold what some test files share: kernel_cases (kernel shapes and inputs), motif_format
(Motif-2 folders in the publisher's format), multiprocess (scripts on several processes), without_package (a fresh
interpreter without `diff_transformer`), training (a tiny Trainer), folders (a tiny saved folder) and
adapter_training (a few optimizer steps on one batch). `load_benchmark` loads a script of benchmarks/ as a module;
`printed_differences` compares a recomputed table with a committed one to the printed digits. A test module imports
from here, never from another test module (tests/test_layout.py checks it).
"""

import importlib.util
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from transformers.masking_utils import create_causal_mask

from diff_transformer import DiffConfig
from diff_transformer.kernel_naive import naive_diff_attention
from diff_transformer.input_checks import CACHE_KWARG


class Tolerance(NamedTuple):
    atol: float
    rtol: float
    peak_scaled: bool = False  # both bounds times max(1, max |expected|) of the tensor compared
    rel: float | None = None  # and ||actual - expected|| / ||expected|| at most this (a zero tensor gives 1)
    cos: float | None = None  # and the cosine of actual and expected at least this (a sign flip gives -1)


# |actual - expected| <= atol + rtol * |expected| per element, by what is compared and the dtype of the inputs;
# bf16 adds a whole-tensor relative error and cosine, since its elementwise bound alone would pass a zero or
# sign-flipped tensor whose entries are small. Each bound is a few times the largest error measured over the
# default suite (DIFF_TOLERANCE_LOG=FILE logs every comparison; tests/faults.py plants the bugs they must catch).
TOLERANCES = {
    # a model or attention layer vs the fp64 reference of this file
    "model": {
        torch.float32: Tolerance(2e-6, 2e-5),
        torch.bfloat16: Tolerance(6e-3, 6e-3, rel=2e-2, cos=0.99995),
        torch.float64: Tolerance(1e-10, 1e-9),
    },
    # one gradient tensor of a layer or model vs its fp64 (or eager) reference, compared per tensor: scaled by that
    # tensor's own peak, never a layer-wide one
    "grad": {
        torch.float32: Tolerance(2e-6, 2e-5, True),
        torch.bfloat16: Tolerance(2e-2, 2e-2, True, rel=3e-2, cos=0.9999),
        torch.float64: Tolerance(1e-10, 1e-9, True),
    },
    # the gradient of the lambda vectors: in bf16 a sum over every output element of terms of both signs, whose
    # size may be off by a fifth (measured: up to 0.18) while its direction (that of the vectors) stays; the bound
    # still fails a zero (relative error 1), doubled (1) or sign-flipped (2, cosine -1) gradient
    "lambda_grad": {
        torch.float32: Tolerance(2e-6, 2e-5, True),
        torch.bfloat16: Tolerance(1e-2, 1e-2, True, rel=0.6, cos=0.99995),
        torch.float64: Tolerance(1e-10, 1e-9, True),
    },
    # a backend vs `eager` on the same whole model
    "backend": {
        torch.float32: Tolerance(2e-6, 2e-5, True),
        torch.bfloat16: Tolerance(1.2e-2, 1.2e-2, True, rel=3e-2, cos=0.9998),
    },
    # kernels that compute in fp32 whatever the input dtype (tiled, eager) vs the naive reference on the same
    # inputs; with bf16 inputs, autograd rounds the input gradients to bf16
    "tiled": {torch.float32: Tolerance(2e-5, 2e-5), torch.bfloat16: Tolerance(1e-3, 1e-2)},
    # torch's sdpa (and flex) computes in the input dtype, so bf16 outputs carry bf16 rounding
    "sdpa": {torch.float32: Tolerance(2e-5, 2e-5), torch.bfloat16: Tolerance(2e-2, 2e-2)},
    # the Triton kernel: fp32 softmax and accumulators, matmul inputs in the input dtype
    "diff_flash": {
        torch.float32: Tolerance(1e-5, 1e-5),
        torch.float16: Tolerance(5e-3, 5e-3),
        torch.bfloat16: Tolerance(6e-2, 3e-2),
    },
}
# On a CUDA GPU diff_flash multiplies fp32 tiles as TF32 (a 10-bit mantissa; `_dot` in kernel_diff_flash.py): its
# fp32 comparisons there (`tf32_kind`) take these bounds, about three times the largest error measured on an H200
# (the lambda gradient, a sum of terms of both signs, has the largest relative error, 3.8e-2). Every other
# comparison, and diff_flash's on a CPU (the interpreter multiplies in exact fp32), keeps the bounds above.
TF32 = {
    "diff_flash": Tolerance(2.5e-2, 2.5e-2, rel=0.1, cos=0.9999),
    "backend": Tolerance(5e-4, 5e-4, True, rel=3e-3, cos=0.99999),
    "lambda_grad": Tolerance(2e-5, 2e-5, True, rel=3e-2, cos=0.9999),
}
TOLERANCES.update({f"{kind}-tf32": {**TOLERANCES[kind], torch.float32: bound} for kind, bound in TF32.items()})


def tf32_kind(kind: str, backend: str) -> str:
    """The TOLERANCES entry of a comparison of `backend`'s results by `kind`: its TF32 entry where `backend` is
    diff_flash on a CUDA GPU (fp32 products in TF32), else `kind`."""
    return f"{kind}-tf32" if backend == "diff_flash" and torch.cuda.is_available() else kind


def _log_comparison(kind: str, dtype: torch.dtype, what: str, max_diff: float, ratio: float, rel: float,
                    cos: float) -> None:
    """With DIFF_TOLERANCE_LOG set, append one tab-separated line per comparison (how the bounds were measured)."""
    path = os.environ.get("DIFF_TOLERANCE_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"{kind}\t{str(dtype).removeprefix('torch.')}\t{max_diff:.3e}\t{ratio:.3e}\t{rel:.3e}\t"
                      f"{cos:.6f}\t{what}\n")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 kind: str = "model") -> None:
    """`actual` within TOLERANCES[kind][dtype] of `expected` (same shape, finite); the message gives the max and
    mean absolute difference (and, where the bound has them, the relative error and cosine)."""
    atol, rtol, peak_scaled, rel_bound, cos_bound = TOLERANCES[kind][dtype]
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    actual, expected = actual.detach().double(), expected.detach().double()
    diff = (actual - expected).abs()
    scale = max(expected.abs().max().item(), 1.0) if peak_scaled and expected.numel() else 1.0
    bound = (atol + rtol * expected.abs()) * scale
    ok = diff <= bound
    norm = expected.norm().item()
    rel = (actual - expected).norm().item() / norm if norm > 0 else (0.0 if diff.max() == 0 else math.inf)
    cos = torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0, eps=1e-30).item()
    if expected.numel():
        _log_comparison(kind, dtype, what, diff.max().item(), (diff / bound).max().item(), rel, cos)
    message = (f"{what} ({dtype}): max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}, "
               f"{(~ok).sum().item()} of {ok.numel()} outside atol={atol}, rtol={rtol}")
    assert ok.all(), message
    if rel_bound is not None and norm > 0:
        assert rel <= rel_bound, f"{message}; relative error {rel:.3e} > {rel_bound}"
    if cos_bound is not None and norm > 0 and expected.numel() > 1:
        assert cos >= cos_bound, f"{message}; cosine {cos:.6f} < {cos_bound}"


def assert_grads_close(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype,
                       what: str) -> None:
    """Weight gradients, each tensor against its own reference by TOLERANCES["grad"] (scaled by its own peak;
    bf16 also by relative error and cosine, so a zero, doubled or sign-flipped gradient fails; `grad_kind`)."""
    for name, grad in grads.items():
        assert grad is not None, f"{what} d{name}: no gradient"
        assert_close(grad, expected[name], dtype, f"{what} d{name}", grad_kind(name))


def grad_kind(name: str, kind: str = "grad") -> str:
    """The TOLERANCES entry for the gradient of parameter `name`: "lambda_grad" for the lambda vectors (by their
    name in the model, or in `attention_params`), else `kind`."""
    return "lambda_grad" if "lambda_params" in name or name in ("lq1", "lk1", "lq2", "lk2") else kind


def tiny_config(**overrides) -> DiffConfig:
    fields = dict(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    fields.update(overrides)
    return DiffConfig(**fields)


# The three attention stacks every contract test covers: V1 with GQA, DIFF V2, and a hybrid V1 + standard stack.
STACKS = {
    "V1-GQA": dict(num_attention_heads=2, num_key_value_heads=1),
    "V2": dict(diff_version=2),
    "hybrid": dict(attention_types=["differential", "standard"]),
}


def build_stack(backend: str, stack: str, seed: int = 0, **overrides):
    """A seeded tiny `DiffForCausalLM` of one of `STACKS`, in eval mode."""
    from diff_transformer import DiffForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(**STACKS[stack], **overrides)
    return DiffForCausalLM._from_config(config, attn_implementation=backend).eval()


def paper_lambda_init(layer_idx: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotate_half RoPE over the last dim of x [..., T, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_lambda(weights: dict, config: DiffConfig, layer_idx: int) -> tuple[torch.Tensor, float]:
    """(lambda, lambda_init) of a layer: exp(<lq1, lk1>) - exp(<lq2, lk2>) + lambda_init."""
    lam_init = config.lambda_init if config.lambda_init is not None else paper_lambda_init(layer_idx)
    return torch.exp(weights["lq1"] @ weights["lk1"]) - torch.exp(weights["lq2"] @ weights["lk2"]) + lam_init, lam_init


def reference_projections(x: torch.Tensor, weights: dict, config: DiffConfig) -> tuple[torch.Tensor, ...]:
    """x [B, T, hidden] -> the kernels' packed layout from the raw fp64 weights q, k, v, laid out as docs/design.md
    section 2 says: rotated q [B, 2h, T, d] (branch-1 heads, then branch-2), keys packed [B, h_kv, T, 2d] = (k1 | k2)
    and v [B, h_kv, T, dv]."""
    h, h_kv, d, dv = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.value_head_dim
    batch, length, _ = x.shape
    positions, theta = torch.arange(length), config.rope_parameters["rope_theta"]
    q = rope((x @ weights["q"].T).view(batch, length, 2 * h, d).transpose(1, 2), positions, theta)  # [B, 2h, T, d]
    k = rope((x @ weights["k"].T).view(batch, length, 2 * h_kv, d).transpose(1, 2), positions, theta)
    v = (x @ weights["v"].T).view(batch, length, h_kv, dv).transpose(1, 2)  # [B, h_kv, T, dv]
    return q, torch.cat([k[:, :h_kv], k[:, h_kv:]], dim=-1), v  # k [B, 2h_kv, T, d] -> [B, h_kv, T, 2d]


def causal_allowed(length: int, key_valid: torch.Tensor | None) -> torch.Tensor:
    """Which keys each query may attend: [1 | B, 1, T, T], causal and (with key_valid [B, T]) not padding."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    return allowed if key_valid is None else allowed & key_valid.bool()[:, None, None, :]


def reference_diff_attention(x, weights: dict, config: DiffConfig, layer_idx: int, key_valid=None):
    """x [B, T, hidden] -> [B, T, hidden] from the raw fp64 weights q, k, v, o, lq1, lk1, lq2, lk2, subln; the
    attention itself is `naive_diff_attention`."""
    q, k, v = reference_projections(x, weights, config)
    lam, lam_init = reference_lambda(weights, config, layer_idx)
    mask = causal_allowed(x.shape[1], key_valid)
    heads = naive_diff_attention(q, k, v, lam, config.head_dim**-0.5, mask=mask)  # [B, T, h, dv]
    if config.use_subln:
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
        heads = (1 - lam_init) * heads * weights["subln"]
    return heads.flatten(2) @ weights["o"].T


def reference_branch_maps(x: torch.Tensor, weights: dict, config: DiffConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal softmax maps A1, A2 [B, h, T, T] of x [B, T, hidden]: `naive_diff_attention` with lambda 0 and
    V = the identity (so its output is A1), and with the branches swapped for A2."""
    q, k, _ = reference_projections(x, weights, config)
    batch, length = x.shape[:2]
    h, d = q.shape[1] // 2, q.shape[-1]
    identity = torch.eye(length, dtype=x.dtype).expand(batch, k.shape[1], length, length)  # [B, h_kv, S, S]
    zero, scaling, mask = torch.zeros((), dtype=x.dtype), config.head_dim**-0.5, causal_allowed(length, None)
    swapped_q, swapped_k = torch.cat([q[:, h:], q[:, :h]], dim=1), torch.cat([k[..., d:], k[..., :d]], dim=-1)
    a1 = naive_diff_attention(q, k, identity, zero, scaling, mask=mask).transpose(1, 2)  # [B, h, T, T]
    a2 = naive_diff_attention(swapped_q, swapped_k, identity, zero, scaling, mask=mask).transpose(1, 2)
    return a1, a2


def attention_params(attn) -> dict[str, torch.nn.Parameter]:
    """The raw parameters of a DiffAttention module, by the names `reference_diff_attention` reads."""
    return {
        "q": attn.q_proj.weight, "k": attn.k_proj.weight, "v": attn.v_proj.weight, "o": attn.o_proj.weight,
        "lq1": attn.lambda_params.q1, "lk1": attn.lambda_params.k1,
        "lq2": attn.lambda_params.q2, "lk2": attn.lambda_params.k2, "subln": attn.subln.weight,
    }


def fp64_leaves(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached float64 copies that require grad."""
    return {name: t.detach().double().requires_grad_() for name, t in tensors.items()}


def attention_weights(attn) -> dict[str, torch.Tensor]:
    """`attention_params` as leaf fp64 tensors that require grad."""
    return fp64_leaves(attention_params(attn))


def run_attention(attn, model, x: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor:
    """The output of attention layer `attn` of DiffModel `model` for hidden states x [B, T, hidden], under the causal
    mask the model builds for the 2-D attention mask `key_valid` (None: no padding)."""
    position_ids = torch.arange(x.shape[1])[None]
    mask = create_causal_mask(
        config=model.config, inputs_embeds=x, attention_mask=key_valid, position_ids=position_ids, **{CACHE_KWARG: None}
    )
    return attn(x, position_embeddings=model.rotary_emb(x, position_ids), attention_mask=mask)[0]


def assert_layer_matches_reference(attn, model, x: torch.Tensor, key_valid: torch.Tensor | None,
                                   params: dict[str, torch.Tensor], reference: Callable, dtype: torch.dtype,
                                   what: str) -> None:
    """Output, input gradient and weight gradients of attention layer `attn` (`run_attention`) vs
    `reference(x, weights, key_valid)` on float64 copies of x and of the layer's weights `params` (by the names the
    reference reads). Queries at pad positions see no valid key: their output is unspecified and gets no gradient."""
    out = run_attention(attn, model, x, key_valid)
    rows = torch.ones(out.shape[:2], dtype=torch.bool) if key_valid is None else key_valid.bool()
    grad_out = torch.randn_like(out) * rows[..., None]
    out.backward(grad_out)
    weights, x_ref = fp64_leaves(params), x.detach().double().requires_grad_()
    ref = reference(x_ref, weights, key_valid)
    ref.backward(grad_out.double())
    assert_close(out[rows], ref[rows], dtype, f"{what} output")
    assert_close(x.grad, x_ref.grad, dtype, f"{what} d input", "grad")
    assert_grads_close({name: p.grad for name, p in params.items()}, {name: w.grad for name, w in weights.items()},
                       dtype, what)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = {  # with hidden 64: d = 16
    "MHA": dict(num_attention_heads=2, num_key_value_heads=2),
    "GQA": dict(num_attention_heads=2, num_key_value_heads=1),
}
PADDED = pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
# (dtype, heads, padded) over DTYPES x HEADS x padding, with ids like bf16-GQA-leftpad
DTYPE_HEADS_PADDING = pytest.mark.parametrize("dtype, heads, padded", [
    pytest.param(dtype, heads, padded, id=f"{name}-{heads}-{'leftpad' if padded else 'nopad'}")
    for name, dtype in DTYPES.items() for heads in HEADS for padded in (False, True)
])


def attention_mask(padded: bool, batch: int = 2, length: int = 12, device: str = "cpu") -> torch.Tensor:
    """A 2-D transformers attention mask [batch, length] of ones; with `padded`, row 1 left-padded by 4 tokens."""
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    if padded:
        mask[1, :4] = 0
    return mask


def left_padded(prompts: list[torch.Tensor], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one left-padded batch (pad id 0) and its attention mask."""
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return batch, mask


# Weights far enough from init that tiny models' logits have clear margins and lambda is far from lambda_init, so
# that a check of tokens or logits cannot pass on near-ties.
NONDEGENERATE = dict(initializer_range=0.1, lambda_std_dev=0.3)


def randomize_gains(model: torch.nn.Module, scale: float = 0.2) -> None:
    """Norm gains start at 1; perturb them so that a skipped one shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "subln" in name:
                param.add_(scale * torch.randn_like(param))


def assert_decode_matches_full_forward(model, reference, prompts: list[torch.Tensor], steps: int, what: str) -> None:
    """Prompts left-padded into one batch, `steps` greedy tokens with `model`'s cache; each row's per-step logits vs
    `reference`'s full forward without a cache over that row's own tokens (no padding) by TOLERANCES["backend"].
    `reference` holds the same weights, ideally under another backend, so no path is compared with itself."""
    batch, mask = left_padded(prompts, str(next(model.parameters()).device))
    out = model.generate(batch, attention_mask=mask, max_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    width = batch.shape[1]
    for i, prompt in enumerate(prompts):
        sequence = torch.cat([prompt, out.sequences[i, width:]])[None]  # [1, len + steps]
        with torch.no_grad():
            full = reference(sequence, use_cache=False).logits[0, len(prompt) - 1 : len(prompt) - 1 + steps]
        cached = torch.stack([step_logits[i] for step_logits in out.logits])  # [steps, vocab]
        assert_close(cached, full, torch.float32, f"{what}: prompt {i}, cached decode vs full forward logits",
                     "backend")


SAVED_FOLDERS = ("diff", "word", "no-tokenizer", "gpt2", "llama", "binary.bin")


def saved_folders(root: os.PathLike, names: tuple[str, ...] = SAVED_FOLDERS) -> os.PathLike:
    """Folders a user may point the package at, under `root` (the error-message tests' fixtures): diff (a DIFF model
    with an English BPE tokenizer), word (one with the synthetic task's word-level tokenizer), no-tokenizer, gpt2,
    llama, and a binary file, binary.bin; only those in `names`."""
    from pathlib import Path

    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from diff_transformer import DiffForCausalLM
    from diff_transformer.tools.data import KeyValueTask
    from diff_transformer.tools.evaluation import CITIES, FILLER, needle
    from diff_transformer.tokenization_diff import train_bpe_tokenizer

    def save_diff(path: Path, tokenizer) -> Path:
        DiffForCausalLM(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=512)).save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return path

    root = Path(root)
    if {"diff", "gpt2"} & set(names):
        texts = list(FILLER) * 20 + [needle(c, str(1000 + i)) for i, c in enumerate(CITIES)] * 3
        english = train_bpe_tokenizer(texts=texts + [f"What is the magic number of {c}?" for c in CITIES],
                                      vocab_size=400)
    if "diff" in names:
        save_diff(root / "diff", english)
    if "word" in names:
        save_diff(root / "word", KeyValueTask().tokenizer())
    if "no-tokenizer" in names:
        DiffForCausalLM(tiny_config()).save_pretrained(root / "no-tokenizer")
    if "gpt2" in names:
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(english))).save_pretrained(
            root / "gpt2")
        english.save_pretrained(root / "gpt2")
    if "llama" in names:
        LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2)).save_pretrained(root / "llama")
    if "binary.bin" in names:
        (root / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    return root


FIGURE = re.compile(r"-?\d+\.\d+")  # a printed decimal figure; integers (counts, steps, seeds) are text


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as a fresh module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed_differences(got: str, committed: str, slack: float = 1e-9) -> list[str]:
    """The lines where a recomputed text differs from the committed one beyond its printing: with the decimal
    figures masked the lines must be equal, and each figure within one unit of its last printed digit of the
    committed one (+ `slack`): the values behind them may lie on either side of a rounding boundary, where another
    CPU's last bits put them. Empty when they agree."""
    lines = list(zip(got.splitlines(), committed.splitlines()))
    found = [f"{len(got.splitlines())} lines vs {len(committed.splitlines())} committed"] if len(
        got.splitlines()) != len(committed.splitlines()) else []
    for number, (a, b) in enumerate(lines, 1):
        pairs = list(zip(FIGURE.findall(a), FIGURE.findall(b)))
        if FIGURE.sub("#", a) != FIGURE.sub("#", b) or any(
                abs(float(x) - float(y)) > 10.0 ** -len(y.split(".")[1]) + slack for x, y in pairs):
            found.append(f"line {number}: {a}\n   committed: {b}")
    return found
