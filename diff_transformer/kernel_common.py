"""What every differential attention kernel shares (Ye et al., "Differential Transformer", arXiv 2410.05258): the
packed layout, its branch views, transformers' masks and the fp32 compute precision.

Shape names: B batch, T query positions, S key positions, h differential heads, h_kv kv heads, n_rep = h / h_kv,
d q/k sub-head dim, dv value dim. A suffix names a tensor's dims in order (torchtitan's convention): K kv heads,
b branch, R n_rep, D d; `q_BKbRD` is [B, h_kv, 2, n_rep, d].

The packed layout:

    q      : [B, 2h, T, d]       projected, rotated queries, "halves" order: q1 = q[:, :h], q2 = q[:, h:]
             [B, h + g, T, d]    with g < h grouped noise heads (GDA): q2 = q[:, h:] holds one query per noise
                                 head, serving differential heads [i h / g, (i + 1) h / g)
    k      : [B, h_kv, S, 2d]    keys packed per kv head as (k1 | k2): k1 = k[..., :d], k2 = k[..., d:]
    v      : [B, h_kv, S, dv]
    lam    : 0-dim tensor
    output : [B, T, h, dv]

Query head j reads kv head j // (h / h_kv) in both branches (noise head i: kv head i // (g / h_kv), the same).
Keys are packed so that K and V share one head count (one cache layer per attention layer) and both branches read
their keys as zero-copy views.
"""

import functools
from collections.abc import Callable

import torch


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """fp32, or float64 for float64 inputs (the precision of the differential math, whatever the input dtype)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def split_branches(q: torch.Tensor, k: torch.Tensor, group: int = 1) -> tuple[torch.Tensor, ...]:
    """q [B, h + h / group, T, d] -> q1 [B, h, T, d], q2 [B, h / group, T, d]; packed k [B, h_kv, S, 2d] -> k1,
    k2 [B, h_kv, S, d] (views). `group`: differential heads per noise head (grouped noise heads; 1: q is [B, 2h])."""
    h, d = q.shape[1] * group // (group + 1), q.shape[-1]
    return q[:, :h], q[:, h:], k[..., :d], k[..., d:]


def per_head(noise: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """A noise branch's tensor (one entry per noise head along `dim`) repeated for the `group` differential heads
    each serves; itself, with no copy, where every head has its own noise head (`group` 1, plain DIFF)."""
    return noise if group == 1 else noise.repeat_interleave(group, dim=dim)


def expand_noise(q: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped queries [B, h + h / group, T, d] -> [B, 2h, T, d], each noise head's query repeated for the `group`
    differential heads it serves, for kernels that take one noise query per head. Exact: differential head j and
    its noise head j // group read the same kv head (j // (h / h_kv)), so each copy computes the group's map."""
    if group == 1:
        return q
    q1, q2, _, _ = split_branches(q, q, group)
    return torch.cat([q1, per_head(q2, group, dim=1)], dim=1)


def drop_unfilled_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values a maskless call may attend. sdpa's skipped mask (None) with T > 1 means its top-left
    `is_causal`: a static cache's prefill has S = max_cache_len > T, so the keys past T (unfilled slots) go, and
    the kernels' bottom-right causal rule then sees the T keys of the T queries."""
    length = q.shape[2]
    if mask is None and length > 1:
        return k[:, :, :length], v[:, :, :length]  # [B, h_kv, T, .]
    return k, v


def mask_scores_(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """In place, fp32 scores [..., T, S] with transformers' attention mask applied: boolean (True: may attend),
    additive (0 or the dtype's minimum; clamped, since a float64 mask's minimum would overflow fp32 to -inf), or
    None (causal, the T queries being the last T of the S keys). Masked scores get a finite fill, so a fully masked
    row's softmax is uniform instead of NaN."""
    fill = torch.finfo(scores.dtype).min
    rows = scores.shape[-2]
    if mask is None and rows > 1:
        scores[..., -rows:].add_(torch.full((rows, rows), fill, device=scores.device).triu_(1))  # beats masked_fill_
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, fill)
    return scores.add_(mask.clamp(min=fill) if torch.finfo(mask.dtype).min < fill else mask)


def masked_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """fp32 (float64) scores q k^T * scaling [B, H, T, S] with transformers' mask applied (`mask_scores_`)."""
    scores = torch.matmul(upcast(q) * scaling, upcast(k).transpose(2, 3))
    return mask_scores_(scores, None if mask is None else mask[..., : k.shape[2]])


def autocast_off(kernel: Callable) -> Callable:
    """Run `kernel` with autocast disabled on the device of its first tensor argument. These kernels compute scores
    and softmax in fp32 whatever the input dtype; under autocast `torch.bmm` returns bf16 scores, where an additive
    mask's fp32 minimum rounds to -inf in place and a fully masked row's softmax gives NaN."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        device = next(arg.device.type for arg in args if isinstance(arg, torch.Tensor))
        if not torch.is_autocast_enabled(device):
            return kernel(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return kernel(*args, **kwargs)

    return run
