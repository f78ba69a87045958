"""The authors' differential attention module (Ye et al., "Differential Transformer", arXiv 2410.05258) as a drop-in
on this project's kernels.

`MultiheadDiffAttn` has the constructor, parameter names and shapes, and forward contract of the module the paper's
code publishes (`MultiheadDiffAttn(embed_dim, depth, num_heads, num_kv_heads=None)`, `forward(x, rel_pos,
attn_mask=None)`), so its state_dicts load with `strict=True` and models built from it run unchanged. What it
computes, per differential head i and branch b = 0, 1:

    q sub-head 2i + b   (q_proj rows in adjacent pairs; interleaved RoPE from rel_pos = (cos, sin), [T, d/2])
    key sub-head (2i + b) // n_rep of the 2 h_kv key sub-heads, value head i // n_rep   (n_rep = h / h_kv)
    head_i = (A_0 - lambda A_1) V,   out_i = (1 - lambda_init(depth)) SubLN(head_i)

With GQA (n_rep >= 2) both branches of a head therefore read the same key sub-head, unlike `DiffForCausalLM`, whose
kv head holds a (k1, k2) pair. The kernels take one key pair per head here (keys and values gathered per head), so
GQA costs MHA's key/value memory inside the call.

Differences from the published code: lambda stays fp32 (the published code rounds it to the compute dtype), a fully
masked query row gives output 0 (float64) or a uniform map (the fp32 kernels) instead of NaN, and scores are not
passed through `nan_to_num` (the published code's guard against inf in q k^T). The kernels compute in fp32; float64
inputs run the float64 reference kernel (`kernel_naive.py`), for checks.
"""

import torch
from torch import nn
from transformers import PreTrainedConfig

from .attention_kernels import DIFF_FLASH, run_selected, select_kernel
from .configuration_diff import lambda_init_fn  # the published module's name, importable from here as there
from .diff_lambda import compute_lambda
from .kernel_naive import naive_diff_attention
from .modeling_diff import SubLN

IMPLEMENTATIONS = ("eager", "sdpa", "tiled", DIFF_FLASH)
SUBLN_EPS = 1e-5  # the published module's SubLN epsilon


def rotary_rel_pos(length: int, head_dim: int, theta: float = 10000.0, offset: int = 0,
                   device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
    """`rel_pos = (cos, sin)`, each [length, head_dim / 2], for positions offset .. offset + length - 1: the angles
    `DiffForCausalLM` rotates by for `rope_theta = theta` (Llama's frequencies theta^(-2m / d), computed in fp32
    as transformers computes them), cast to `dtype`."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    positions = torch.arange(offset, offset + length, device=device).float()
    angles = positions[:, None] * inv_freq  # [T, d/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, d] rotated in adjacent pairs (x_2m, x_2m+1) by the angles of cos/sin [T, d/2] (the interleaved
    convention of the published code); a cos narrower than d/2 rotates only the first 2 * cos.shape[-1] dims."""
    rotary = 2 * cos.shape[-1]
    pairs = x[..., :rotary].unflatten(-1, (-1, 2))  # [B, T, H, d/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [T, 1, d/2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., rotary:]), dim=-1)


def key_sub_heads(num_heads: int, n_rep: int, device: torch.device | None = None) -> torch.Tensor:
    """[2, h]: the key sub-head branch b of head i reads, (2i + b) // n_rep (repeat_kv over 2 h_kv sub-heads)."""
    sub_heads = torch.arange(2 * num_heads, device=device).view(num_heads, 2).T  # [branch, h]: 2i + b
    return sub_heads // n_rep


def kernel_mask(attn_mask: torch.Tensor | None, batch: int, length: int, implementation: str) -> torch.Tensor | None:
    """The published forward's `attn_mask` (additive, [T, S], [1, 1, T, S], [B, 1, 1, S] or [B, 1, T, S]; None:
    causal) as the kernels take it, [B, 1, T, S] (None stays None, the kernels' causal): boolean (True = may attend)
    when it holds only 0 and -inf, else additive with -inf clamped to the dtype's minimum, so that a fully masked
    row (left padding under a causal mask) gives no NaN. diff_flash takes boolean masks only."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        attn_mask = attn_mask[None, None]  # [1, 1, T, S]
    if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[0] not in (1, batch) \
            or attn_mask.shape[2] not in (1, length):
        raise ValueError(f"attn_mask must be [T, S], [1, 1, T, S], [B, 1, 1, S] or [B, 1, T, S] for B={batch}, "
                         f"T={length}; got {list(attn_mask.shape)}")
    attn_mask = attn_mask.expand(batch, 1, length, attn_mask.shape[-1])
    if attn_mask.dtype == torch.bool:
        return attn_mask
    allowed = attn_mask == 0
    if torch.all(allowed | (attn_mask == float("-inf"))):
        return allowed
    if implementation == DIFF_FLASH:
        raise ValueError(f"attn_implementation='{DIFF_FLASH}' takes masks of 0 and -inf only (or a boolean mask); "
                         "use 'sdpa' or 'eager' for other additive biases")
    return attn_mask.clamp(min=torch.finfo(attn_mask.dtype).min)


class MultiheadDiffAttn(nn.Module):
    """Differential multi-head attention with the published module's API and weights, on `DIFF_KERNELS`.

    `num_heads` is h, the differential heads (half a baseline Transformer's heads); `num_kv_heads` likewise (None:
    MHA). head_dim d = embed_dim / (2 h); values are 2d wide. `attn_implementation` picks the kernel as
    `DiffForCausalLM` does: "sdpa" (the default: torch sdpa calls, or the tiled kernel for long CPU inputs),
    "eager" (materialised maps), "tiled", or "diff_flash" (the Triton kernel, GPU).
    """

    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_kv_heads: int | None = None,
                 attn_implementation: str = "sdpa"):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % (2 * num_heads):
            raise ValueError(f"embed_dim={embed_dim} must be divisible by 2 * num_heads = {2 * num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if attn_implementation not in IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {', '.join(IMPLEMENTATIONS)}; "
                             f"got '{attn_implementation}'")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.n_rep = num_heads // num_kv_heads
        self.head_dim = embed_dim // num_heads // 2
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim // self.n_rep, bias=False)
        self.out_proj = nn.Linear(2 * num_heads * self.head_dim, embed_dim, bias=False)
        self.lambda_init = lambda_init_fn(depth)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(self.head_dim, dtype=torch.float32).normal_(0, 0.1)))
        self.subln = SubLN(2 * self.head_dim, eps=SUBLN_EPS)
        # what the kernels read from their module: the backend, and one kv head per head (keys gathered per head)
        self.config = PreTrainedConfig()
        self.config._attn_implementation = attn_implementation
        self.num_key_value_groups = 1
        self.is_causal = True

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"lambda_init={self.lambda_init:.4f}, attn_implementation={self.config._attn_implementation}")

    def kernel_inputs(self, x: torch.Tensor, rel_pos: tuple[torch.Tensor, torch.Tensor]):
        """Project, rotate and gather into the kernels' layout: q [B, 2h, T, d] (branch halves), keys packed per
        head [B, h, T, 2d] = (key of branch 0 | key of branch 1), v [B, h, T, 2d]."""
        batch, length, _ = x.shape
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = apply_interleaved_rotary(self.q_proj(x).view(batch, length, 2 * h, d), *rel_pos)  # [B, T, 2h, d]
        k = apply_interleaved_rotary(self.k_proj(x).view(batch, length, 2 * h_kv, d), *rel_pos)  # [B, T, 2h_kv, d]
        q = q.view(batch, length, h, 2, d).permute(0, 3, 2, 1, 4).reshape(batch, 2 * h, length, d)  # [B, 2h, T, d]
        k = k[:, :, key_sub_heads(h, self.n_rep, x.device)]  # [B, T, branch, h, d]
        k = k.permute(0, 3, 1, 2, 4).reshape(batch, h, length, 2 * d)  # [B, h, T, 2d]
        v = self.v_proj(x).view(batch, length, h_kv, 2 * d).transpose(1, 2)  # [B, h_kv, T, 2d]
        return q, k, v.repeat_interleave(self.n_rep, dim=1) if self.n_rep > 1 else v  # v [B, h, T, 2d]

    def forward(self, x: torch.Tensor, rel_pos: tuple[torch.Tensor, torch.Tensor],
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, embed_dim] -> [B, T, embed_dim]. `attn_mask` is additive (None: causal); a zero mask attends
        everywhere (encoders)."""
        batch, length, _ = x.shape
        implementation = self.config._attn_implementation
        q, k, v = self.kernel_inputs(x, rel_pos)
        mask = kernel_mask(attn_mask, batch, length, implementation)
        lam = compute_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2, self.lambda_init)
        if x.dtype == torch.float64:  # the kernels compute in fp32; float64 (checks) runs the float64 reference
            out = naive_diff_attention(q, k, v, lam, self.scaling, mask=mask)  # [B, T, h, 2d]
        else:
            kernel = "tiled" if implementation == "tiled" else select_kernel(implementation, q, k, v)
            out, _ = run_selected(kernel, self, q, k, v, lam, mask, self.scaling)  # [B, T, h, 2d] fp32
        out = self.subln(out) * (1 - self.lambda_init)
        return self.out_proj(out.to(x.dtype).reshape(batch, length, -1))
