"""Independent fp64 reference of differential attention, written from docs/design.md §1 (arXiv 2410.05258), per head.

It reads raw weight matrices only (no model code), so it checks the row layout of docs/design.md §2 as well.
"""

import math

import torch

from diff_transformer import DiffConfig

# (atol, rtol) per dtype for comparisons against the fp64 reference.
TOLERANCES = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float64: (1e-10, 1e-9)}


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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCES[dtype]
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    ok = bool((diff <= atol + rtol * expected.abs()).all())
    assert ok, f"{what}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e} (atol={atol}, rtol={rtol})"


def paper_lambda_init(layer_idx: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotate_half RoPE over the last dim of x [T, d]."""
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


def reference_head_maps(xb: torch.Tensor, weights: dict, config: DiffConfig, j: int, allowed: torch.Tensor):
    """Differential head j of one sequence xb [T, hidden]: softmax maps A1, A2 [T, T] (fully masked rows 0)."""
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    theta, pos, m = config.rope_parameters["rope_theta"], torch.arange(xb.shape[0]), j // (h // h_kv)
    q1 = rope(xb @ weights["q"][j * d : (j + 1) * d].T, pos, theta)
    q2 = rope(xb @ weights["q"][(h + j) * d : (h + j + 1) * d].T, pos, theta)
    k1 = rope(xb @ weights["k"][m * d : (m + 1) * d].T, pos, theta)
    k2 = rope(xb @ weights["k"][(h_kv + m) * d : (h_kv + m + 1) * d].T, pos, theta)
    a1 = torch.softmax((q1 @ k1.T / math.sqrt(d)).masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    a2 = torch.softmax((q2 @ k2.T / math.sqrt(d)).masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    return a1, a2


def reference_diff_attention(x, weights: dict, config: DiffConfig, layer_idx: int, key_valid=None):
    """x [B, T, hidden] -> [B, T, hidden]; weights: q, k, v, o, lq1, lk1, lq2, lk2, subln (fp64 tensors)."""
    h, h_kv, dv = config.num_attention_heads, config.num_key_value_heads, config.value_head_dim
    lam, lam_init = reference_lambda(weights, config, layer_idx)
    batch, length, _ = x.shape
    outputs = []
    for b in range(batch):
        allowed = torch.ones(length, length).tril().bool()
        if key_valid is not None:
            allowed = allowed & key_valid[b][None, :].bool()
        heads = []
        for j in range(h):
            m = j // (h // h_kv)
            a1, a2 = reference_head_maps(x[b], weights, config, j, allowed)
            v = x[b] @ weights["v"][m * dv : (m + 1) * dv].T
            head = (a1 - lam * a2) @ v
            if config.use_subln:
                head = head * torch.rsqrt(head.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
                head = (1 - lam_init) * head * weights["subln"]
            heads.append(head)
        outputs.append(torch.cat(heads, -1) @ weights["o"].T)
    return torch.stack(outputs)


def attention_weights(attn) -> dict:
    """The raw parameters of a DiffAttention module, as leaf fp64 tensors that require grad."""
    named = {
        "q": attn.q_proj.weight, "k": attn.k_proj.weight, "v": attn.v_proj.weight, "o": attn.o_proj.weight,
        "lq1": attn.lambda_params.q1, "lk1": attn.lambda_params.k1,
        "lq2": attn.lambda_params.q2, "lk2": attn.lambda_params.k2, "subln": attn.subln.weight,
    }
    return {k: v.detach().double().requires_grad_() for k, v in named.items()}
