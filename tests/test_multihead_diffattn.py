"""`MultiheadDiffAttn` against a float64 reference written here from the paper's math and the published module's
conventions (adjacent q/k sub-head pairs, interleaved RoPE as complex rotations, GQA key sub-head (2i + b) // n_rep,
value head i // n_rep, SubLN eps 1e-5, lambda_init(depth)); and the unilm <-> DiffForCausalLM conversion against a
decoder built from `MultiheadDiffAttn` layers."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from diff_transformer import MultiheadDiffAttn, rotary_rel_pos
from diff_transformer.multihead_diffattn import lambda_init_fn
from diff_transformer.tools.unilm import diff_to_unilm, unilm_to_diff

# (embed_dim, num_heads, num_kv_heads): MHA, GQA n_rep 2 and 4; d = 8 or 16
SHAPES = {"E64-H4-KV4": (64, 4, None), "E64-H4-KV2": (64, 4, 2), "E128-H4-KV1": (128, 4, 1)}
# per dtype: outputs |a - e| <= atol + rtol |e|; gradients by relative norm error and cosine similarity, the lambda
# vectors' gradients (one scalar dL/dlambda summed over every output, with cancellation) by their own bound; "zero":
# the largest entry where the reference gradient is exactly 0 (q/k with one key). Measured over the kernel cases
# below (|a - e| / (1 + |e|) for outputs): fp32 1.4e-6, gradients 2.1e-6, lambda 3.4e-4, zero 8e-6; bf16 0.021,
# 0.032, 0.019, 1.2e-6. diff_flash in bf16 rounds P to bf16 before P V: q/k gradients that are exactly 0 come out
# up to 7.9e-3 (T = 1).
TOLERANCES = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10, "grad_rel": 1e-10, "lambda_rel": 1e-9, "cosine": 1 - 1e-12,
                    "zero": 1e-12},
    torch.float32: {"atol": 4e-6, "rtol": 4e-6, "grad_rel": 6e-6, "lambda_rel": 1e-3, "cosine": 1 - 1e-9, "zero": 3e-5},
    torch.bfloat16: {"atol": 6e-2, "rtol": 6e-2, "grad_rel": 0.1, "lambda_rel": 0.06, "cosine": 0.995, "zero": 4e-6},
}
DIFF_FLASH_TOLERANCES = {**TOLERANCES, torch.bfloat16: {**TOLERANCES[torch.bfloat16], "zero": 2e-2}}


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, d] float64: adjacent pairs of the first 2 r dims (cos, sin [T, r]) as complex numbers times
    e^(i angle); the other dims unrotated (partial rotary, as the published code's flash-attn rotary does)."""
    rotary = 2 * cos.shape[-1]
    pairs = torch.view_as_complex(x[..., :rotary].reshape(*x.shape[:-1], -1, 2).contiguous())  # [B, T, H, r]
    return torch.cat([torch.view_as_real(pairs * torch.complex(cos, sin)[:, None]).flatten(-2), x[..., rotary:]], -1)


def reference(params: dict, x: torch.Tensor, cos, sin, mask, num_heads: int, num_kv_heads: int, depth: int):
    """The published module's function in float64, head by head and branch by branch."""
    batch, length, embed = x.shape
    d, n_rep = embed // num_heads // 2, num_heads // num_kv_heads
    q = rotate_interleaved((x @ params["q_proj.weight"].T).view(batch, length, 2 * num_heads, d), cos, sin)
    k = rotate_interleaved((x @ params["k_proj.weight"].T).view(batch, length, 2 * num_kv_heads, d), cos, sin)
    v = (x @ params["v_proj.weight"].T).view(batch, length, num_kv_heads, 2 * d)
    if mask is None:
        mask = torch.full((length, length), float("-inf"), dtype=x.dtype).triu(1)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
    lam = (torch.exp((params["lambda_q1"] * params["lambda_k1"]).sum()) - torch.exp(
        (params["lambda_q2"] * params["lambda_k2"]).sum()) + lambda_init)
    heads = []
    for i in range(num_heads):
        maps = []
        for b in range(2):
            scores = q[:, :, 2 * i + b] @ k[:, :, (2 * i + b) // n_rep].transpose(1, 2) / math.sqrt(d)  # [B, T, S]
            bias = mask.reshape(-1, *mask.shape[-2:]).clamp(min=torch.finfo(x.dtype).min)  # no NaN rows
            maps.append(torch.softmax(scores + bias, dim=-1))
        head = (maps[0] - lam * maps[1]) @ v[:, :, i // n_rep]  # [B, T, 2d]
        head = head * torch.rsqrt(head.pow(2).mean(-1, keepdim=True) + 1e-5) * params["subln.weight"]
        heads.append(head * (1 - lambda_init))
    return torch.cat(heads, dim=-1) @ params["out_proj.weight"].T


def make_module(shape: str, depth: int = 2, implementation: str = "sdpa", seed: int = 0) -> MultiheadDiffAttn:
    embed, heads, kv_heads = SHAPES[shape]
    torch.manual_seed(seed)
    module = MultiheadDiffAttn(embed, depth, heads, kv_heads, attn_implementation=implementation)
    with torch.no_grad():
        module.subln.weight.uniform_(0.5, 1.5)  # a gain that matters
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(module, name).normal_(0, 0.3)  # lambda well away from lambda_init
    return module


def make_mask(kind: str, batch: int, length: int, dtype: torch.dtype) -> torch.Tensor | None:
    """None (causal), or an additive mask of the named shape and meaning."""
    inf = float("-inf")
    causal = torch.full((length, length), inf, dtype=dtype).triu(1)
    padding = torch.zeros(batch, 1, 1, length, dtype=dtype)
    padding[0, ..., : length // 3] = inf  # row 0 left-padded (its first third are pad keys)
    return {
        "causal": None,
        "causal-T-S": causal,
        "causal-1-1-T-S": causal[None, None],
        "bidirectional": torch.zeros(length, length, dtype=dtype),
        "padded-B-1-1-S": padding,
        "padded-causal-B-1-T-S": padding + causal,
    }[kind]


def compare_grads(actual: dict, expected: dict, dtype: torch.dtype, skip: tuple[str, ...] = (),
                  tolerances: dict = TOLERANCES) -> None:
    tol = tolerances[dtype]
    for name, ref in expected.items():
        if name.startswith(skip):
            continue
        got = actual[name].double()
        if ref.norm() == 0:  # q/k with one key: the softmax is constant
            assert got.abs().max() <= tol["zero"], f"grad {name}: max {got.abs().max().item():.3g}, expected 0"
            continue
        rel = ((got - ref).norm() / ref.norm()).item()
        cosine = F.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        assert rel <= tol["lambda_rel" if name.startswith("lambda") else "grad_rel"] and cosine >= tol["cosine"], (
            f"grad {name}: relative error {rel:.3g} (bound {tol['grad_rel']}), cosine {cosine:.12f}; "
            f"max diff {(got - ref).abs().max().item():.3g}, mean {(got - ref).abs().mean().item():.3g}")


def run_pair(module: MultiheadDiffAttn, dtype: torch.dtype, batch: int, length: int, mask_kind: str,
             depth: int = 2, rotary_dim: int | None = None):
    """(module outputs and grads in `dtype`, reference outputs and grads in float64) on the same inputs: the
    reference reads the module's `dtype` weights and inputs, so only the computation differs. `depth` is the
    module's; `rotary_dim` (default head_dim) the dims `rel_pos` rotates."""
    module = module.to(dtype)
    if dtype != torch.float64:
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):  # as published: fp32 lambda vectors
            getattr(module, name).data = getattr(module, name).data.float()
    torch.manual_seed(1)
    x = torch.randn(batch, length, module.embed_dim).to(dtype).requires_grad_()
    rel_pos = rotary_rel_pos(length, rotary_dim or module.head_dim, dtype=dtype)
    mask = make_mask(mask_kind, batch, length, dtype)
    grad_out = torch.randn(batch, length, module.embed_dim).to(dtype)
    valid = torch.ones(batch, length, dtype=torch.bool)
    if mask_kind.startswith("padded"):
        valid[0, : length // 3] = False  # padding query rows (fully masked when causal): no defined output
    grad_out[~valid] = 0

    params = {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}
    x_ref = x.detach().double().requires_grad_()
    mask_ref = None if mask is None else mask.double()
    cos, sin = (t.double() for t in rel_pos)
    expected = reference(params, x_ref, cos, sin, mask_ref, module.num_heads, module.num_kv_heads, depth)
    (expected * grad_out.double()).sum().backward()

    module.zero_grad()
    out = module(x, rel_pos, attn_mask=mask)
    (out * grad_out).sum().backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    grads_ref = {"x": x_ref.grad, **{n: p.grad for n, p in params.items()}}
    return out[valid], expected[valid], grads, grads_ref


def check_outputs(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCES[dtype]
    diff = (actual.double() - expected.detach()).abs()
    bound = tol["atol"] + tol["rtol"] * expected.detach().abs()
    assert (diff <= bound).all(), f"{what}: max diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}"


def test_parameters_match_the_published_module_names_and_shapes():
    module = MultiheadDiffAttn(embed_dim=64, depth=3, num_heads=4, num_kv_heads=2)
    shapes = {name: tuple(p.shape) for name, p in module.state_dict().items()}
    assert shapes == {"q_proj.weight": (64, 64), "k_proj.weight": (32, 64), "v_proj.weight": (32, 64),
                      "out_proj.weight": (64, 64), "lambda_q1": (8,), "lambda_k1": (8,), "lambda_q2": (8,),
                      "lambda_k2": (8,), "subln.weight": (16,)}
    assert module.lambda_init == lambda_init_fn(3) == pytest.approx(0.8 - 0.6 * math.exp(-0.9))
    module.load_state_dict({name: torch.randn(shape) for name, shape in shapes.items()}, strict=True)


MASK_KINDS = ["causal", "causal-T-S", "causal-1-1-T-S", "bidirectional", "padded-B-1-1-S", "padded-causal-B-1-T-S"]
FLOAT64_CASES = [(kind, length) for length in (1, 7, 128) for kind in MASK_KINDS
                 if not (length == 1 and kind.startswith("padded"))]  # padding needs more than one token


@pytest.mark.parametrize("mask_kind,length", FLOAT64_CASES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_float64_matches_the_reference(shape, mask_kind, length):
    actual, expected, grads, grads_ref = run_pair(make_module(shape), torch.float64, 2, length, mask_kind)
    check_outputs(actual, expected, torch.float64, f"{shape} {mask_kind} T={length}")
    compare_grads(grads, grads_ref, torch.float64)


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask_kind,length", [("causal", 1), ("causal", 150), ("padded-causal-B-1-T-S", 24),
                                              ("bidirectional", 24)])
def test_kernels_match_the_reference(implementation, dtype, shape, mask_kind, length):
    module = make_module(shape, implementation=implementation)
    actual, expected, grads, grads_ref = run_pair(module, dtype, 2, length, mask_kind)
    check_outputs(actual, expected, dtype, f"{implementation} {shape} {mask_kind} T={length}")
    compare_grads(grads, grads_ref, dtype)


@pytest.mark.parametrize("dtype,mask_kind,length", [
    (torch.float32, "causal", 1), (torch.float32, "causal", 20), (torch.float32, "padded-causal-B-1-T-S", 12),
    (torch.bfloat16, "causal", 1), (torch.bfloat16, "causal", 20),
])
def test_diff_flash_matches_the_reference(dtype, mask_kind, length):
    """The Triton kernel (under the interpreter without a GPU) at d = 16 with n_rep = 4."""
    pytest.importorskip("triton")
    from diff_transformer.kernel_diff_flash import triton_available, unfit_reason
    if not triton_available()[0]:
        pytest.skip(triton_available()[1])
    module = make_module("E128-H4-KV1", implementation="diff_flash")
    assert not unfit_reason(16, 32, dtype, torch.device("cpu"))  # no silent fallback to the sdpa calls
    actual, expected, grads, grads_ref = run_pair(module, dtype, 2, length, mask_kind)
    check_outputs(actual, expected, dtype, f"diff_flash {mask_kind} T={length}")
    # bf16: the kernel rounds P to bf16 before P V, and dL/dlambda, a sum over every output largely cancelled by
    # SubLN's backward, falls below that resolution (relative error up to 0.5 at T = 1); fp32 checks it at 1e-3
    compare_grads(grads, grads_ref, dtype, ("lambda",) if dtype == torch.bfloat16 else (), DIFF_FLASH_TOLERANCES)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_partial_rotary_and_another_depth_match_the_reference(dtype):
    """`rel_pos` narrower than head_dim / 2 rotates only the first dims (the published code's rotary, as flash-attn
    applies it; here 8 of d = 16) and leaves the rest as projected; `depth` 5 sets lambda_init in lambda and the
    output scale. Both against the reference, which computes them from the same arguments."""
    module = make_module("E128-H4-KV1", depth=5, implementation="eager")
    assert module.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-1.5))
    actual, expected, grads, grads_ref = run_pair(module, dtype, 2, 12, "padded-causal-B-1-T-S", depth=5,
                                                  rotary_dim=module.head_dim // 2)
    check_outputs(actual, expected, dtype, f"partial rotary, depth 5, {dtype}")
    compare_grads(grads, grads_ref, dtype)


def test_lambda_and_subln_gain_reach_the_output():
    """A 1% lambda error or a SubLN gain of 1 changes the float64 output far beyond the tolerance."""
    module = make_module("E64-H4-KV2")
    actual, expected, _, _ = run_pair(module, torch.float64, 1, 9, "causal")
    with torch.no_grad():
        module.lambda_q1.mul_(1.01)
    perturbed, _, _, _ = run_pair(module, torch.float64, 1, 9, "causal")
    assert (perturbed - actual).abs().max() > 1e-6


def test_diff_flash_mask_must_be_zero_or_minus_inf():
    from diff_transformer.multihead_diffattn import kernel_mask
    with pytest.raises(ValueError, match="0 and -inf only"):
        kernel_mask(torch.full((4, 4), -1.0), 1, 4, "diff_flash")
    assert kernel_mask(torch.zeros(4, 4), 2, 4, "diff_flash").dtype == torch.bool
    with pytest.raises(ValueError, match=r"\[B, 1, 1, S\]"):
        kernel_mask(torch.zeros(3, 1, 4, 4), 2, 4, "sdpa")


def test_bad_constructor_arguments_name_the_fix():
    with pytest.raises(ValueError, match="divisible by 2 \\* num_heads"):
        MultiheadDiffAttn(60, 0, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiheadDiffAttn(64, 0, 4, 3)
    with pytest.raises(ValueError, match="attn_implementation"):
        MultiheadDiffAttn(64, 0, 4, attn_implementation="flash")


class UnilmDecoderLayer(nn.Module):
    def __init__(self, embed: int, heads: int, kv_heads: int | None, depth: int, intermediate: int):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(embed, eps=1e-5)
        self.self_attn = MultiheadDiffAttn(embed, depth, heads, kv_heads, attn_implementation="eager")
        self.post_attention_layernorm = LlamaRMSNorm(embed, eps=1e-5)
        self.mlp = LlamaMLP(type("Cfg", (), {"hidden_size": embed, "intermediate_size": intermediate,
                                             "hidden_act": "silu", "mlp_bias": False})())

    def forward(self, x, rel_pos, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rel_pos, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class UnilmDecoder(nn.Module):
    """The paper's model shape (embeddings, pre-RMSNorm layers of MultiheadDiffAttn + SwiGLU, norm, head) with
    Llama's parameter names, the form `unilm_to_diff` reads."""

    def __init__(self, vocab=97, embed=64, layers=3, heads=4, kv_heads=None, intermediate=96, theta=10000.0):
        super().__init__()
        self.theta = theta
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, embed)
        self.model.layers = nn.ModuleList(UnilmDecoderLayer(embed, heads, kv_heads, i, intermediate)
                                          for i in range(layers))
        self.model.norm = LlamaRMSNorm(embed, eps=1e-5)
        self.lm_head = nn.Linear(embed, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        head_dim = self.model.layers[0].self_attn.head_dim
        rel_pos = rotary_rel_pos(input_ids.shape[1], head_dim, self.theta, dtype=x.dtype)
        for layer in self.model.layers:
            x = layer(x, rel_pos)
        return self.lm_head(self.model.norm(x))


def unilm_decoder(kv_heads: int | None, dtype=torch.float64) -> UnilmDecoder:
    torch.manual_seed(0)
    decoder = UnilmDecoder(kv_heads=kv_heads, theta=500.0)
    with torch.no_grad():
        for name, param in decoder.named_parameters():
            if name.endswith("norm.weight") or "subln" in name:
                param.uniform_(0.5, 1.5)
            elif "lambda" in name:
                param.normal_(0, 0.3)
            else:
                param.normal_(0, 0.2)
    return decoder.to(dtype).eval()


@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["MHA", "GQA-rep2", "GQA-rep4"])
def test_converted_decoder_gives_the_same_logits_and_round_trips(kv_heads):
    decoder = unilm_decoder(kv_heads)
    state = decoder.state_dict()
    model = unilm_to_diff(state, rope_theta=500.0)
    model.set_attn_implementation("eager")  # the kernel that keeps float64 (the others compute in fp32)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = decoder(ids)
        actual = model(ids).logits
    diff = (actual - expected).abs()
    assert diff.max() <= 1e-9, f"logits: max diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}"

    back = diff_to_unilm(model, num_kv_heads=kv_heads)
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(back[name], value), f"{name} changed in the round trip"


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["MHA", "GQA-rep2"])
def test_converted_model_greedy_tokens_equal_in_fp32(kv_heads):
    decoder = unilm_decoder(kv_heads, dtype=torch.float32)
    model = unilm_to_diff(decoder.state_dict(), rope_theta=500.0)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = ids
    with torch.no_grad():
        for _ in range(8):  # the unilm decoder has no cache: greedy by re-running the whole prefix
            expected = torch.cat([expected, decoder(expected)[:, -1:].argmax(-1)], dim=1)
    generated = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert generated.tolist() == expected.tolist()


def test_diff_gqa_model_exports_as_mha_with_copies_and_refuses_a_lossy_fold():
    from diff_transformer import DiffConfig, DiffForCausalLM
    torch.manual_seed(0)
    config = DiffConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, embedding_multiplier=1.0,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    model = DiffForCausalLM(config).double().eval()
    model.set_attn_implementation("eager")
    state = diff_to_unilm(model)  # MHA: exact
    decoder = unilm_decoder(None)
    decoder.load_state_dict(state, strict=True)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (decoder(ids) - model(ids).logits).abs()
    assert diff.max() <= 1e-9, f"logits: max diff {diff.max().item():.3g}"
    with pytest.raises(ValueError, match="hold different weights"):
        diff_to_unilm(model, num_kv_heads=2)


def test_scaled_embeddings_are_refused_by_name():
    """The decoders add unscaled embeddings: a model with another multiplier (the default) is refused, naming it."""
    from diff_transformer import DiffConfig, DiffForCausalLM
    config = DiffConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, rms_norm_eps=1e-5)
    with pytest.raises(ValueError, match=r"embedding_multiplier is 8\b.*embedding_multiplier=1.0"):
        diff_to_unilm(DiffForCausalLM(config))


def test_tied_embeddings_convert_both_ways():
    """A tied model exports without lm_head and imports back tied, with the same logits."""
    from diff_transformer import DiffConfig, DiffForCausalLM
    torch.manual_seed(0)
    config = DiffConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=True, embedding_multiplier=1.0)
    model = DiffForCausalLM(config).double().eval()
    state = diff_to_unilm(model)
    assert "lm_head.weight" not in state
    back = unilm_to_diff(state)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
