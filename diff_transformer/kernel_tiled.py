"""Tiled differential attention in plain torch ops (Ye et al., "Differential Transformer", arXiv 2410.05258).

Both branches of a tile of query rows share one batched matmul, one softmax and one product with V:

    P_b  = softmax(Q_b K_b^T / sqrt(d) + mask)     b = 1, 2    [2, B, h_kv, n_rep, rows, keys]
    out  = (P_1 - lambda P_2) V                                [B, h_kv, n_rep, rows, dv]

so the attention costs Llama's FLOPs (two d-wide score products and ONE 2d-wide value product per head) instead
of the 2x that torch's fused sdpa kernels need (they take equal q/k/v widths only). Causal tiles skip the keys
after their last row. `TiledDiffAttention` saves only q, k, v (q and k also in the forward's branch layout) and
recomputes each tile's maps in backward (like FlashAttention), so memory stays O(T) apart from one tile's maps.

Layout: the packed layout of kernel_common.py, q [B, 2h, T, d] in halves order, keys packed [B, h_kv, S, 2d] =
(k1 | k2), v [B, h_kv, S, dv], lam a 0-dim tensor. GQA broadcasts over `n_rep = h / h_kv`
without repeat_kv copies. A mask of None means causal with the queries as the last T of the S keys.
"""

import math
from collections.abc import Iterator

import torch

from .kernel_common import autocast_off, drop_unfilled_keys, expand_noise, mask_scores_, split_branches

TILE_ROWS = 128  # query rows per tile: the fastest size measured on CPU


def tiled_is_faster(q: torch.Tensor) -> bool:
    """Whether the tiled kernel beats two torch sdpa calls on CPU (q [B, 2h, T, d]): it needs causal tiles to skip
    (T > TILE_ROWS) and d >= 32 (at d = 16 the padded query's wasted half costs little)."""
    return q.shape[2] > TILE_ROWS and q.shape[-1] >= 32


def branch_views(q: torch.Tensor, k: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, 2h, T, d] -> scaling * q as [2, B, h_kv, n_rep, T, d]; packed k [B, h_kv, S, 2d] -> K^T as
    [2, B, h_kv, d, S]. fp32, branch first and contiguous (one copy each), so each branch's maps are one contiguous
    block, and a tile's score product reads K^T rows (faster than reading K transposed)."""
    batch, _, length, d = q.shape
    h_kv, keys = k.shape[1], k.shape[2]
    q_branches = q.view(batch, 2, h_kv, -1, length, d).transpose(0, 1)  # [2, B, h_kv, n_rep, T, d]
    kt_branches = k.view(batch, h_kv, keys, 2, d).permute(3, 0, 1, 4, 2)  # [2, B, h_kv, d, S]
    # copy=True: q is kept, and without a copy an fp32 k would keep its permuted layout
    q_branches = q_branches.to(torch.float32, memory_format=torch.contiguous_format, copy=True).mul_(scaling)
    return q_branches, kt_branches.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def branch_mask(mask: torch.Tensor | None, h_kv: int) -> torch.Tensor | None:
    """A transformers mask [B, 1 | h, T, S] -> [B, 1 | h_kv, 1 | n_rep, T, S], broadcastable to the maps."""
    if mask is None or mask.shape[1] == 1:
        return None if mask is None else mask[:, :, None]
    batch, _, length, keys = mask.shape
    return mask.reshape(batch, h_kv, -1, length, keys)


def buffer_view(buffer: torch.Tensor | None, *shape: int) -> torch.Tensor | None:
    """The first prod(shape) elements of a flat scratch buffer as a contiguous [*shape] view (None: no buffer)."""
    return None if buffer is None else buffer[: math.prod(shape)].view(shape)


def branch_scores(
    q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor | None, buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """Both masked score maps of a tile: pre-scaled q [2, B, h_kv, n_rep, t, d], K^T [2, B, h_kv, d, e] ->
    [2, B, h_kv, n_rep, t, e] (or one branch's, with a leading 1), written to the start of `buffer` if given.
    `mask`: boolean or additive, or None (causal: the last t keys are the rows' own). Masked scores get a finite
    fill, so fully masked rows give a uniform map instead of NaN."""
    _, batch, h_kv, n_rep, rows, d = q.shape
    q_flat = q.reshape(-1, n_rep * rows, d)  # [2 * B * h_kv, n_rep * t, d], a view of a tile's slice
    kt_flat = kt.reshape(-1, d, kt.shape[-1])  # [2 * B * h_kv, d, e]
    out = buffer_view(buffer, q_flat.shape[0], n_rep * rows, kt_flat.shape[-1])
    scores = torch.bmm(q_flat, kt_flat, out=out).view(q.shape[0], batch, h_kv, n_rep, rows, -1)  # [2, B, h_kv, R, t, e]
    return mask_scores_(scores, mask)


def branch_probs(q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Both softmax maps of a tile, [2, B, h_kv, n_rep, t, e] (arguments as `branch_scores`)."""
    return torch.softmax(branch_scores(q, kt, mask), dim=-1)


def softmax_grads(d_map: torch.Tensor, probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Softmax backward of both branches, which share dM = dO V^T [B, h_kv, n_rep, t, e] (branch 2's -lambda is
    applied by the caller): dS_b = P_b dM - P_b rowsum(P_b dM), as [2, B, h_kv, n_rep, t, e]. Through torch's fused
    softmax-backward kernel (the one torch.softmax's autograd uses), one pass over each map. Written to `out`,
    shaped as `probs`."""
    for branch in range(2):
        torch.ops.aten._softmax_backward_data.out(d_map, probs[branch], -1, torch.float32, grad_input=out[branch])
    return out


def tiles(length: int, keys: int, rows: int) -> Iterator[tuple[int, int, int]]:
    """(first row, end row, number of keys the tile can see) per tile; queries are the last `length` keys."""
    offset = keys - length
    for start in range(0, length, rows):
        stop = min(start + rows, length)
        yield start, stop, offset + stop


def differential_map(probs: torch.Tensor, lam: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """P [2, B, h_kv, n_rep, t, e] -> P_1 - lambda P_2 [B, h_kv, n_rep, t, e]; `out=probs[0]` overwrites P_1."""
    return torch.addcmul(probs[0], probs[1], lam, value=-1, out=out)


def map_buffer(q_branches: torch.Tensor, keys: int, rows: int, maps: int) -> torch.Tensor:
    """Flat scratch for `maps` maps [B, h_kv, n_rep, rows, keys] that every tile of a call reuses: a fresh tensor
    per tile is written cache-cold, and a large one comes from fresh pages every time."""
    batch_heads, length = math.prod(q_branches.shape[1:4]), q_branches.shape[-2]  # B * h_kv * n_rep, T
    return q_branches.new_empty(maps * batch_heads * min(rows, length) * keys)


def tile_probs(q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor | None, start: int, stop: int, keys: int,
               buffer: torch.Tensor) -> torch.Tensor:
    """Both maps of query rows start..stop against the first `keys` keys: [2, B, h_kv, n_rep, t, keys], at the
    start of `buffer` (two maps of `map_buffer`). Outside autograd only: the softmax overwrites the scores."""
    tile_mask = None if mask is None else mask[..., start:stop, :keys]
    scores = branch_scores(q[..., start:stop, :], kt[..., :keys], tile_mask, buffer)
    return torch.softmax(scores, dim=-1, out=scores)


def tiled_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, mask: torch.Tensor | None,
                  scaling: float, rows: int) -> torch.Tensor:
    """[B, T, h_kv, n_rep, dv]: the differential attention output, tile by tile."""
    return forward_tiles(*branch_views(q, k, scaling), v, lam, branch_mask(mask, k.shape[1]), rows)


def forward_tiles(q_branches: torch.Tensor, kt_branches: torch.Tensor, v: torch.Tensor, lam: torch.Tensor,
                  map_mask: torch.Tensor | None, rows: int) -> torch.Tensor:
    """`tiled_forward` on the branch views (`branch_views`, `branch_mask`). Each tile's product is written into the
    output, laid out [B, T, h_kv, n_rep, dv] as SubLN and o_proj read it (no concatenation, no transpose)."""
    _, batch, h_kv, n_rep, length, _ = q_branches.shape
    v_flat = v.contiguous().view(batch * h_kv, -1, v.shape[-1])  # [B * h_kv, S, dv]
    out = v.new_empty(batch, length, h_kv, n_rep, v.shape[-1])
    if length <= rows:  # one tile, e.g. every decode step: no slicing (decode is bound by per-op overhead)
        write_product(out, 0, differential_map(branch_probs(q_branches, kt_branches, map_mask), lam), v_flat)
        return out
    buffer = map_buffer(q_branches, kt_branches.shape[-1], rows, 2)
    for start, stop, keys in tiles(length, kt_branches.shape[-1], rows):
        probs = tile_probs(q_branches, kt_branches, map_mask, start, stop, keys, buffer)
        write_product(out, start, differential_map(probs, lam, out=probs[0]), v_flat)
    return out


def grouped_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, mask: torch.Tensor | None,
                    scaling: float, rows: int, group: int) -> torch.Tensor:
    """`tiled_forward` with grouped noise heads (q [B, h + h / group, T, d]; a mask shared by the heads), outside
    autograd: per tile each noise head's map is computed once and subtracted, through a broadcast view, from the
    maps of the `group` heads it serves. [B, T, h_kv, n_rep, dv]."""
    q1, q2, _, _ = split_branches(q, q, group)
    batch, _, length, d = q1.shape
    h_kv, num_keys = k.shape[1], k.shape[2]
    # [B, h_kv, n_rep, T, d] and [B, h_kv, n_rep / group, T, d]: head j and noise head j // group share a kv head
    queries = [x.reshape(batch, h_kv, -1, length, d).to(torch.float32, memory_format=torch.contiguous_format,
                                                         copy=True).mul_(scaling)[None] for x in (q1, q2)]
    kt = k.view(batch, h_kv, num_keys, 2, d).permute(3, 0, 1, 4, 2).contiguous()  # [2, B, h_kv, d, S]
    map_mask, n_rep, noise_rep = branch_mask(mask, h_kv), queries[0].shape[3], queries[1].shape[3]
    v_flat = v.contiguous().view(batch * h_kv, num_keys, v.shape[-1])  # [B * h_kv, S, dv]
    out = v.new_empty(batch, length, h_kv, n_rep, v.shape[-1])
    for start, stop, keys in tiles(length, num_keys, rows):
        tile_mask = None if map_mask is None else map_mask[..., start:stop, :keys]
        p1, p2 = (torch.softmax(branch_scores(x[..., start:stop, :], kt[b : b + 1, ..., :keys], tile_mask), dim=-1)[0]
                  for b, x in enumerate(queries))  # [B, h_kv, n_rep, t, e], [B, h_kv, noise_rep, t, e]
        grouped = p1.view(batch, h_kv, noise_rep, group, stop - start, keys)  # the heads of each noise head
        torch.addcmul(grouped, p2.unsqueeze(3), lam, value=-1, out=grouped)  # P_1 - lambda P_2 of the group's noise
        write_product(out, start, p1, v_flat)
    return out


def write_product(out: torch.Tensor, start: int, diff_map: torch.Tensor, v_flat: torch.Tensor) -> None:
    """out[:, start:start + t] = M V for a tile's map M [B, h_kv, n_rep, t, e] and v_flat [B * h_kv, S, dv]: one
    bmm per kv head with the GQA groups folded into the rows, then one copy into out's [B, T, h_kv, n_rep, dv]
    layout (torch.matmul would copy V n_rep times per tile)."""
    batch, h_kv, n_rep, length, keys = diff_map.shape
    product = torch.bmm(diff_map.view(batch * h_kv, n_rep * length, keys), v_flat[:, :keys])  # [B h_kv, n_rep t, dv]
    out[:, start : start + length].permute(0, 2, 3, 1, 4).copy_(product.view(batch, h_kv, n_rep, length, -1))


class TiledDiffAttention(torch.autograd.Function):
    """`tiled_forward` with a recomputing backward. Per tile, with dM = dO V^T (shared by both branches):
    dV += M^T dO, dlambda -= <dM, P_2>, dS_1 = softmax'(dM), dS_2 = -lambda softmax'(dM); the -lambda and the
    scaling are applied once to the accumulated dq and dk."""

    @staticmethod
    def forward(ctx, q, k, v, lam, mask, scaling: float, rows: int):
        q_branches, kt_branches = branch_views(q, k, scaling)
        v = v.contiguous()  # per-tile slices fold into one bmm batch; copied once for forward and backward
        ctx.save_for_backward(q_branches, kt_branches, k, v, lam, mask)  # so that backward does not copy q, k again
        ctx.scaling, ctx.rows, ctx.q_shape = scaling, rows, q.shape
        return forward_tiles(q_branches, kt_branches, v, lam, branch_mask(mask, k.shape[1]), rows)

    @staticmethod
    def backward(ctx, grad_out):
        q_branches, kt_branches, k, v, lam, mask = ctx.saved_tensors
        grad_out = grad_out.float().permute(0, 2, 3, 1, 4).contiguous()  # [B, h_kv, n_rep, T, dv]: tiles fold into bmm
        _, batch, h_kv, n_rep, length, d = q_branches.shape
        num_keys, dv = k.shape[2], v.shape[-1]
        sign = torch.stack([torch.ones_like(lam), -lam]).view(2, 1, 1, 1, 1)  # branch 2 enters as -lambda P_2
        k_signed = torch.mul(k.view(batch, h_kv, -1, 2, d).permute(3, 0, 1, 2, 4), sign * ctx.scaling,
                             out=k.new_empty(2, batch, h_kv, num_keys, d))  # [2, B, h_kv, S, d]: dq = dS K, scaled
        map_mask = branch_mask(mask, h_kv)
        dk_flat = k.new_empty(2 * batch * h_kv, num_keys, d)  # [2 * B * h_kv, S, d]
        dv_flat = v.new_empty(batch * h_kv, num_keys, dv)  # [B * h_kv, S, dv]
        v_flat = v.view(batch * h_kv, num_keys, dv)
        dlam, dqs = torch.zeros_like(lam), []
        # P_1, P_2 | M, then dM | dS_1, dS_2: three buffers rather than one of five maps
        p_buffer, m_buffer, ds_buffer = (map_buffer(q_branches, num_keys, ctx.rows, maps) for maps in (2, 1, 2))
        for start, stop, keys in reversed(list(tiles(length, num_keys, ctx.rows))):  # last first: see `add_bmm`
            rows = n_rep * (stop - start)
            probs = tile_probs(q_branches, kt_branches, map_mask, start, stop, keys, p_buffer)
            diff_map = differential_map(probs, lam, out=buffer_view(m_buffer, *probs.shape[1:]))
            grad = grad_out[..., start:stop, :].reshape(-1, rows, dv)  # [B * h_kv, n_rep * t, dv]
            add_bmm(dv_flat, diff_map.view(-1, rows, keys).transpose(1, 2), grad)
            d_map = torch.bmm(grad, v_flat[:, :keys].transpose(1, 2), out=diff_map.view(-1, rows, keys)).view(
                probs.shape[1:])  # dM = dO V^T [B, h_kv, n_rep, t, e], GQA folded into rows (no V copy per n_rep)
            dlam -= torch.dot(probs[1].view(-1), d_map.view(-1))
            d_scores = softmax_grads(d_map, probs, out=buffer_view(ds_buffer, *probs.shape))
            if map_mask is not None and map_mask.dtype == torch.bool:  # a fully masked row's uniform map: no gradient
                d_scores.masked_fill_(~map_mask[..., start:stop, :keys], 0)
            d_scores = d_scores.view(-1, rows, keys)  # [2 * B * h_kv, n_rep * t, e]
            dq = torch.bmm(d_scores, k_signed[..., :keys, :].reshape(-1, keys, d))  # [2 * B * h_kv, n_rep * t, d]
            dqs.append(dq.view(2, batch, h_kv, n_rep, -1, d).transpose(0, 1))  # [B, 2, h_kv, n_rep, t, d]
            add_bmm(dk_flat, d_scores.transpose(1, 2), q_branches[..., start:stop, :].reshape(-1, rows, d))
        dq = torch.cat(dqs[::-1], dim=-2).view(ctx.q_shape)  # [B, 2, h_kv, n_rep, T, d] -> [B, 2h, T, d]
        dk = torch.mul(dk_flat.view(2, batch, h_kv, -1, d).permute(1, 2, 3, 0, 4), sign.view(2, 1),
                       out=k.new_empty(batch, h_kv, num_keys, 2, d))  # [B, h_kv, S, branch, d]
        return dq, dk.view(k.shape), dv_flat.view(v.shape), dlam, None, None, None


def add_bmm(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total[:, :e] += a @ b for a [n, e, r]. The full-width product (the first one: backward runs the tiles last to
    first) is written instead, so `total` needs no zero fill. bmm then add_: baddbmm_ into a strided slice runs one
    addmm_ per matrix on CPU."""
    if a.shape[1] == total.shape[1]:
        torch.bmm(a, b, out=total)
    else:
        total[:, : a.shape[1]].add_(torch.bmm(a, b))


@autocast_off
def tiled_diff_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lam: torch.Tensor, scaling: float,
    mask: torch.Tensor | None = None, rows: int = TILE_ROWS, group: int = 1,
) -> torch.Tensor:
    """Differential attention output [B, T, h, dv] in fp32 (layout in the module docstring); causal, with `mask` or
    without (None). Arguments in the order of the other kernels' (q, k, v, lam, scaling, ..., mask). `group` > 1:
    grouped noise heads, q [B, h + h / group, T, d]; without gradients each noise map is computed once per group
    (`grouped_forward`), with them (or a per-head mask) each noise query is repeated over its group."""
    k, v = drop_unfilled_keys(q, k, v, mask)
    q, k, v = q.float(), k.float(), v.float()
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, lam))
    if group > 1 and (grad or (mask is not None and mask.shape[1] > 1)):
        q, group = expand_noise(q, group), 1
    if grad:
        out = TiledDiffAttention.apply(q, k, v, lam, mask, scaling, rows)
    elif group > 1:
        out = grouped_forward(q, k, v, lam, mask, scaling, rows, group)
    else:
        out = tiled_forward(q, k, v, lam, mask, scaling, rows)
    return out.flatten(2, 3)  # [B, T, h_kv, n_rep, dv] -> [B, T, h, dv]
