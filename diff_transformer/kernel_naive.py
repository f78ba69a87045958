"""Naive differential attention: the float64 reference that every kernel is tested against.

Written from the paper's formula (arXiv 2410.05258), per head, with both maps materialised:

    A_b = softmax(scaling q_b k_b^T + mask)      b = 1, 2
    out = (A_1 - lam A_2) v

A query row with no key it may attend gives output 0 and no gradient. Memory grows as T x S per head: for tests.
"""

import torch
from torch import Tensor


def _allowed_and_bias(mask: Tensor | None, length: int, keys: int, causal: bool,
                     device: torch.device) -> tuple[Tensor, Tensor | float]:
    """(which keys each query may attend, float64 bias added to the scores) for a mask broadcastable to [B, h, T, S].

    bool: True = may attend. Additive float (transformers' eager masks): 0 = may attend, the dtype's minimum or
    -inf = masked, other values added to the scores. None: causal, bottom-right aligned (query i sees key
    j <= i + S - T), or every key with causal=False.
    """
    if mask is None:
        allowed = torch.ones(length, keys, dtype=torch.bool, device=device)
        return (allowed.tril(keys - length) if causal else allowed), 0.0
    if mask.dtype == torch.bool:
        return mask, 0.0
    allowed = mask > torch.finfo(mask.dtype).min
    return allowed, mask.double().where(allowed, 0.0)


def naive_diff_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, scaling: float, causal: bool = True,
                         mask: Tensor | None = None, group: int = 1) -> Tensor:
    """Out [B, T, h, dv] in float64, from the packed layout every kernel takes (kernel_common.py): q [B, 2h, T, d]
    in halves order, keys packed [B, h_kv, S, 2d] = (k1 | k2), v [B, h_kv, S, dv], lam a 0-dim tensor; query head
    j reads kv head j // (h / h_kv). `mask` (see `_allowed_and_bias`) replaces the causal rule when given.

    Grouped noise heads (`group` > 1, GDA): q is [B, h + g, T, d] with g = h / group; noise head i reads kv head
    i // (g / h_kv), and its map A2_i enters differential heads [i group, (i + 1) group)."""
    d = q.shape[-1]
    h = q.shape[1] * group // (group + 1)
    g, h_kv = h // group, k.shape[1]
    q1, q2 = q[:, :h].double(), q[:, h:].double()  # [B, h, T, d], [B, g, T, d]
    k1, v = (t.double().repeat_interleave(h // h_kv, dim=1) for t in (k[..., :d], v))  # [B, h, S, .]
    k2 = k[..., d:].double().repeat_interleave(g // h_kv, dim=1)  # [B, g, S, d]
    allowed, bias = _allowed_and_bias(mask, q1.shape[-2], k1.shape[-2], causal, q1.device)
    any_allowed = allowed.any(dim=-1, keepdim=True)

    def probs(q_b: Tensor, k_b: Tensor) -> Tensor:
        scores = (q_b @ k_b.transpose(-1, -2) * scaling + bias).masked_fill(~allowed, float("-inf"))
        scores = torch.where(any_allowed, scores, 0.0)  # a row without keys: softmax of zeros, then zeroed (no NaN)
        return torch.softmax(scores, dim=-1) * any_allowed

    noise = probs(q2, k2).repeat_interleave(group, dim=1)  # [B, h, T, S]: noise head i's map in its group's heads
    out = probs(q1, k1) @ v - lam.double() * (noise @ v)  # [B, h, T, dv]
    return out.transpose(1, 2)
