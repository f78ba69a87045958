"""Fused one-pass differential FlashAttention in Triton (forward and backward).

Differential attention (DIFF Transformer, Ye et al., arXiv 2410.05258, ICLR 2025) computes, per head,

    out = softmax(scaling * q1 k1^T + mask) v  -  lam * softmax(scaling * q2 k2^T + mask) v

The forward kernel streams every K/V tile once per query tile and keeps two online softmaxes side by side
(FlashAttention-2, arXiv 2307.08691): the V tile is loaded once for both branches and the lambda subtraction
is fused into the epilogue. The backward kernels recompute both probability tiles from the saved log-sum-exps.
Softmaxes and accumulators are fp32; matmul inputs keep the input dtype.

Tensor layout: the packed layout of kernel_common.py (B batch, h query heads, h_kv key/value heads, T queries,
S keys, d q/k head dim, dv value dim):

    q         [B, 2h, T, d]      query sub-heads in halves order: q1 = q[:, :h], q2 = q[:, h:]
    k         [B, h_kv, S, 2d]   key sub-heads packed per kv head: k1 = k[..., :d], k2 = k[..., d:]
    v         [B, h_kv, S, dv]   dv = 2d in the paper; dv = d works too
    lam       []                 float32 scalar, may require grad
    mask      bool, broadcastable to [B, h, T, S], True = may attend; replaces the causal rule when given
    output    [B, T, h, dv]      in the input dtype (a transposed view of the kernel's [B, h, T, dv])

Strides: the kernels take the strides of every input, so the branch halves are read in place as views, and so are
a transposed output gradient or an expanded mask. The two tensors of a branch pair (q1/q2, k1/k2) share one set of
strides in the kernel.

Backward memory: besides its inputs the forward keeps the output, the normalised branch-2 output O2 (same size
and dtype as the output) and two fp32 log-sum-exps [B, h, T]; O1 = out + lam * O2 is reconstructed for the
FlashAttention-2 row sums D_b = rowsum(dO * O_b). Nothing of size T x S is stored. dk/dv are accumulated per key
tile over the GQA group's query heads, so no atomics are needed.

GQA: query head j reads kv head j // (h // h_kv) in both branches.
causal=True is bottom-right aligned: query i may attend key j iff j <= i + S - T.
A fully masked query row gives output 0 and zero gradients.

Tiles: each kernel has a tile (BLOCK_M, BLOCK_N, warps, stages) per GPU target, head dims and dtype (`tile_config`
reads the generated table of kernel_tiles.py), chosen to fit the target's shared memory without spilling registers;
the dK/dV kernel computes its tiles key-major so that BLOCK_N is the M dimension of all its products (wgmma on sm_90
needs M >= 64); bf16 has tiles of its own (a tile that fits in fp16 may not in bf16). `unfit_reason` says when
inputs have no tile on a device, or a launch of theirs failed for lack of shared memory or registers (Triton's
OutOfResources, raised as TileDoesNotFit: a GPU or Triton release the tiles were not checked for), so that the caller
can run standard attention instead; a backward whose launch fails takes that step's gradients from the float64
reference (kernel_naive.py).

Set TRITON_INTERPRET=1 before importing this module (and triton) to run the kernels on CPU: slow, for tests.

Caution: the tiles are compiled and fit-checked for sm_80, sm_86, sm_89 and sm_90 without a GPU, and run under the
interpreter on CPU, but not yet timed on the devices; GPUs newer than sm_90 run the sm_80 or sm_86 tiles untested.
"""

import functools
import math
import os
import warnings

import torch
from torch import Tensor

from .kernel_common import split_branches
from .kernel_naive import naive_diff_attention
from .kernel_tiles import TARGET_TILES, TILES, Tile

try:
    import triton
    import triton.language as tl
except ImportError as error:
    triton = None
    _TRITON_IMPORT_ERROR = str(error)
else:
    _TRITON_IMPORT_ERROR = ""

# Triton decides at decoration time whether @triton.jit functions are interpreted, so read the flag once here.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_HEAD_DIMS = (16, 32, 64, 128)
KERNELS = ("fwd", "dq", "dkdv")  # the forward, the dQ backward and the dK/dV backward


def triton_available() -> tuple[bool, str]:
    """(ok, reason): whether `diff_flash_attention` can run here, and on what or why not."""
    if triton is None:
        return False, (f"triton is not installed ({_TRITON_IMPORT_ERROR}); pip install 'diff-transformer[triton]' "
                       "or use attn_implementation='sdpa'")
    if _INTERPRET:
        return True, "Triton interpreter (TRITON_INTERPRET=1): runs on CPU, slow, for testing"
    if torch.cuda.is_available():
        return True, f"Triton on {torch.cuda.get_device_name()}"
    return False, ("no CUDA GPU; set TRITON_INTERPRET=1 before importing triton to run on CPU (slow, for testing) "
                   "or use attn_implementation='sdpa'")


if triton is not None:
    # The interpreter multiplies bf16 tiles as their raw uint16 bits (numpy has no bf16), so under it the dot
    # operands are widened to fp32 first; products of bf16 values are exact in fp32, so results match the GPU's.
    _DOT_IN_FP32 = tl.constexpr(_INTERPRET)

    @triton.jit
    def _dot(a, b, acc=None):
        """a @ b, accumulated into acc when given. fp32 tiles multiply as TF32 on the tensor cores (a 10-bit
        mantissa, like torch with allow_tf32): in exact fp32 ("ieee") the shipped tiles spill; fp16 and bf16 ignore
        the option. The interpreter multiplies in exact fp32."""
        if _DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision="tf32")

    @triton.jit
    def _load_rows(ptr, offs_rows, offs_cols, n_rows, stride_row, stride_col):
        """[rows, cols] tile, rows >= n_rows read as 0."""
        ptrs = ptr + offs_rows[:, None] * stride_row + offs_cols[None, :] * stride_col
        return tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)

    @triton.jit
    def _load_pair(ptr1, ptr2, offs_rows, offs_cols, n_rows, stride_row, stride_col):
        """The same [rows, cols] tile of both tensors of a branch pair (they share strides)."""
        tile1 = _load_rows(ptr1, offs_rows, offs_cols, n_rows, stride_row, stride_col)
        return tile1, _load_rows(ptr2, offs_rows, offs_cols, n_rows, stride_row, stride_col)

    @triton.jit
    def _store_rows(ptr, value, offs_rows, offs_cols, n_rows, stride_row):
        """Store a [rows, cols] tile to a row-major buffer, casting to its dtype."""
        ptrs = ptr + offs_rows[:, None] * stride_row + offs_cols[None, :]
        tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=offs_rows[:, None] < n_rows)

    @triton.jit
    def _query_tile(Q1, Q2, stride_qb, stride_qh, stride_qt, stride_qd, H, T, N_REP,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's query tile: (bh, b, head, kv_head, start_m, offs_m, q1, q2)."""
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b, head = bh // H, bh % H
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_off = b * stride_qb + head * stride_qh
        q1, q2 = _load_pair(Q1 + q_off, Q2 + q_off, offs_m, tl.arange(0, HEAD_DIM), T, stride_qt, stride_qd)
        return bh, b, head, head // N_REP, start_m, offs_m, q1, q2

    @triton.jit
    def _key_tile(K1, K2, V, start_n, S, stride_ks, stride_kd, stride_vs, stride_vd,
                  HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys start_n.. of one kv head (K1, K2, V point at its first key): (offs_n, k1, k2, v)."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k1, k2 = _load_pair(K1, K2, offs_n, tl.arange(0, HEAD_DIM), S, stride_ks, stride_kd)
        return offs_n, k1, k2, _load_rows(V, offs_n, tl.arange(0, V_DIM), S, stride_vs, stride_vd)

    @triton.jit
    def _row_stats(Lse1, Lse2, Delta1, Delta2, row, offs_m, T):
        """Both log2-sum-exps (+inf past T, so those rows' probabilities are 0) and both D_b of rows offs_m."""
        in_range = offs_m < T
        lse1 = tl.load(Lse1 + row + offs_m, mask=in_range, other=float("inf"))
        lse2 = tl.load(Lse2 + row + offs_m, mask=in_range, other=float("inf"))
        delta1 = tl.load(Delta1 + row + offs_m, mask=in_range, other=0.0)
        return lse1, lse2, delta1, tl.load(Delta2 + row + offs_m, mask=in_range, other=0.0)

    @triton.jit
    def _allowed(q_idx, k_idx, T, S, mask_ptr, stride_mt, stride_ms, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
        """Bool tile: query q_idx may attend key k_idx. Both index tensors are broadcast to the tile's shape, so
        either the queries (offs_m[:, None], offs_n[None, :]) or the keys may index its rows."""
        allowed = (q_idx < T) & (k_idx < S)
        if HAS_MASK:
            ptrs = mask_ptr + q_idx * stride_mt + k_idx * stride_ms
            allowed = allowed & (tl.load(ptrs, mask=allowed, other=0) != 0)
        elif CAUSAL:
            allowed = allowed & (k_idx <= q_idx + (S - T))
        return allowed

    @triton.jit
    def _online_softmax_step(q, k, v, allowed, m, l, acc, qk_scale):
        """Fold one key tile into a running (max m, sum l, accumulator acc) in the log2 domain."""
        s = tl.where(allowed, _dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all keys masked so far: keep exp2 away from NaN
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None])
        return m_new, l, acc

    @triton.jit
    def _normalize(m, l, acc):
        """Normalised branch output and its log2-sum-exp; +inf for empty rows so backward's probabilities are 0."""
        empty = l == 0.0
        l_safe = tl.where(empty, 1.0, l)
        return acc / l_safe[:, None], tl.where(empty, float("inf"), m + tl.log2(l_safe))

    @triton.jit
    def _probs_and_score_grads(q1, q2, k1, k2, v, do, lse1, lse2, delta1, delta2, allowed, lam, qk_scale,
                               KEY_MAJOR: tl.constexpr):
        """Both probability tiles and the gradients of the (unscaled-by-log2e) scores, FlashAttention-2 style.

        Branch 1 sees dO, branch 2 sees -lam * dO, so both share dP = dO V^T:
        dS1 = P1 * (dP - D1) and dS2 = -lam * P2 * (dP - D2), with D_b = rowsum(dO * O_b).
        [BLOCK_M, BLOCK_N]; KEY_MAJOR: transposed, [BLOCK_N, BLOCK_M], so that the key-side products that follow
        (dV += P^T dO, dK_b += dS_b^T Q_b) take the tiles as they are, with BLOCK_N as their M dimension.
        """
        if KEY_MAJOR:
            s1, s2, dp = _dot(k1, tl.trans(q1)), _dot(k2, tl.trans(q2)), _dot(v, tl.trans(do))
            lse1, lse2, delta1, delta2 = lse1[None, :], lse2[None, :], delta1[None, :], delta2[None, :]
        else:
            s1, s2, dp = _dot(q1, tl.trans(k1)), _dot(q2, tl.trans(k2)), _dot(do, tl.trans(v))
            lse1, lse2, delta1, delta2 = lse1[:, None], lse2[:, None], delta1[:, None], delta2[:, None]
        p1 = tl.where(allowed, tl.exp2(s1 * qk_scale - lse1), 0.0)
        p2 = tl.where(allowed, tl.exp2(s2 * qk_scale - lse2), 0.0)
        ds1 = p1 * (dp - delta1)
        ds2 = -lam * p2 * (dp - delta2)
        return p1, p2, ds1, ds2

    @triton.jit
    def _key_end(start_m, T, S, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr):
        """One past the last key that query rows [start_m, start_m + BLOCK_M) may attend (bottom-right causal)."""
        key_end = S
        if CAUSAL and not HAS_MASK:
            key_end = tl.minimum(tl.maximum(start_m + BLOCK_M + S - T, 0), S)
        return key_end

    @triton.jit
    def _diff_attn_fwd(
        Q1, Q2, K1, K2, V, Lam, Mask, Out, O2, Lse1, Lse2,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_mb, stride_mh, stride_mt, stride_ms,
        H, T, S, N_REP, qk_scale,
        HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    ):
        qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats as fp64
        bh, b, head, kv_head, start_m, offs_m, q1, q2 = _query_tile(
            Q1, Q2, stride_qb, stride_qh, stride_qt, stride_qd, H, T, N_REP, HEAD_DIM, BLOCK_M)
        k_off = b * stride_kb + kv_head * stride_kh
        v_ptr = V + b * stride_vb + kv_head * stride_vh
        mask_ptr = Mask + b * stride_mb + head * stride_mh

        m1 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        m2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        l2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
        for start_n in range(0, _key_end(start_m, T, S, BLOCK_M, CAUSAL, HAS_MASK), BLOCK_N):
            offs_n, k1, k2, v = _key_tile(K1 + k_off, K2 + k_off, v_ptr, start_n, S, stride_ks, stride_kd,
                                          stride_vs, stride_vd, HEAD_DIM, V_DIM, BLOCK_N)
            allowed = _allowed(offs_m[:, None], offs_n[None, :], T, S, mask_ptr, stride_mt, stride_ms, CAUSAL, HAS_MASK)
            m1, l1, acc1 = _online_softmax_step(q1, k1, v, allowed, m1, l1, acc1, qk_scale)
            m2, l2, acc2 = _online_softmax_step(q2, k2, v, allowed, m2, l2, acc2, qk_scale)

        o1, lse1 = _normalize(m1, l1, acc1)
        o2, lse2 = _normalize(m2, l2, acc2)
        offs_v = tl.arange(0, V_DIM)
        row = bh * T  # Out, O2, Lse1, Lse2 are contiguous [B, H, T(, V_DIM)]
        _store_rows(Out + row * V_DIM, o1 - tl.load(Lam) * o2, offs_m, offs_v, T, V_DIM)
        _store_rows(O2 + row * V_DIM, o2, offs_m, offs_v, T, V_DIM)
        tl.store(Lse1 + row + offs_m, lse1, mask=offs_m < T)
        tl.store(Lse2 + row + offs_m, lse2, mask=offs_m < T)

    @triton.jit
    def _diff_attn_bwd_dq(
        Q1, Q2, K1, K2, V, DO, Lam, Mask, Lse1, Lse2, Delta1, Delta2, DQ1, DQ2,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dot, stride_dod,
        stride_mb, stride_mh, stride_mt, stride_ms,
        H, T, S, N_REP, qk_scale, scaling,
        HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    ):
        """dq1, dq2 for one query tile: stream the key tiles exactly as the forward does."""
        qk_scale, scaling = tl.cast(qk_scale, tl.float32), tl.cast(scaling, tl.float32)  # fp64 under torch.compile
        bh, b, head, kv_head, start_m, offs_m, q1, q2 = _query_tile(
            Q1, Q2, stride_qb, stride_qh, stride_qt, stride_qd, H, T, N_REP, HEAD_DIM, BLOCK_M)
        do_ptr = DO + b * stride_dob + head * stride_doh
        do = _load_rows(do_ptr, offs_m, tl.arange(0, V_DIM), T, stride_dot, stride_dod)
        row = bh * T
        lse1, lse2, delta1, delta2 = _row_stats(Lse1, Lse2, Delta1, Delta2, row, offs_m, T)
        dq1 = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        dq2 = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        k_off = b * stride_kb + kv_head * stride_kh
        v_ptr = V + b * stride_vb + kv_head * stride_vh
        mask_ptr = Mask + b * stride_mb + head * stride_mh
        lam = tl.load(Lam)
        for start_n in range(0, _key_end(start_m, T, S, BLOCK_M, CAUSAL, HAS_MASK), BLOCK_N):
            offs_n, k1, k2, v = _key_tile(K1 + k_off, K2 + k_off, v_ptr, start_n, S, stride_ks, stride_kd,
                                          stride_vs, stride_vd, HEAD_DIM, V_DIM, BLOCK_N)
            allowed = _allowed(offs_m[:, None], offs_n[None, :], T, S, mask_ptr, stride_mt, stride_ms, CAUSAL, HAS_MASK)
            _, _, ds1, ds2 = _probs_and_score_grads(
                q1, q2, k1, k2, v, do, lse1, lse2, delta1, delta2, allowed, lam, qk_scale, False)
            dq1 = _dot(ds1.to(k1.dtype), k1, dq1)
            dq2 = _dot(ds2.to(k2.dtype), k2, dq2)

        offs_d = tl.arange(0, HEAD_DIM)
        _store_rows(DQ1 + row * HEAD_DIM, dq1 * scaling, offs_m, offs_d, T, HEAD_DIM)
        _store_rows(DQ2 + row * HEAD_DIM, dq2 * scaling, offs_m, offs_d, T, HEAD_DIM)

    @triton.jit
    def _diff_attn_bwd_dkdv(
        Q1, Q2, K1, K2, V, DO, Lam, Mask, Lse1, Lse2, Delta1, Delta2, DK1, DK2, DV,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_dob, stride_doh, stride_dot, stride_dod,
        stride_mb, stride_mh, stride_mt, stride_ms,
        H, H_KV, T, S, N_REP, qk_scale, scaling,
        HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    ):
        """dk1, dk2, dv for one key tile of one kv head: loop over the GQA group's query heads and query tiles."""
        qk_scale, scaling = tl.cast(qk_scale, tl.float32), tl.cast(scaling, tl.float32)  # fp64 under torch.compile
        start_n = tl.program_id(0) * BLOCK_N
        bh_kv = tl.program_id(1)
        b, kv_head = bh_kv // H_KV, bh_kv % H_KV
        offs_d = tl.arange(0, HEAD_DIM)
        offs_v = tl.arange(0, V_DIM)
        k_off = b * stride_kb + kv_head * stride_kh
        offs_n, k1, k2, v = _key_tile(K1 + k_off, K2 + k_off, V + b * stride_vb + kv_head * stride_vh, start_n, S,
                                      stride_ks, stride_kd, stride_vs, stride_vd, HEAD_DIM, V_DIM, BLOCK_N)
        lam = tl.load(Lam)

        dk1 = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dk2 = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, V_DIM], dtype=tl.float32)
        query_start = 0
        if CAUSAL and not HAS_MASK:  # first query tile holding a row i with i + S - T >= start_n
            query_start = tl.maximum(start_n - (S - T), 0) // BLOCK_M * BLOCK_M
        for rep in range(N_REP):
            head = kv_head * N_REP + rep
            q_off = b * stride_qb + head * stride_qh
            do_ptr = DO + b * stride_dob + head * stride_doh
            mask_ptr = Mask + b * stride_mb + head * stride_mh
            row = (b * H + head) * T
            for start_m in range(query_start, T, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                q1, q2 = _load_pair(Q1 + q_off, Q2 + q_off, offs_m, offs_d, T, stride_qt, stride_qd)
                do = _load_rows(do_ptr, offs_m, offs_v, T, stride_dot, stride_dod)
                lse1, lse2, delta1, delta2 = _row_stats(Lse1, Lse2, Delta1, Delta2, row, offs_m, T)
                allowed = _allowed(offs_m[None, :], offs_n[:, None], T, S, mask_ptr, stride_mt, stride_ms,
                                   CAUSAL, HAS_MASK)  # [BLOCK_N, BLOCK_M]
                p1, p2, ds1, ds2 = _probs_and_score_grads(  # each [BLOCK_N, BLOCK_M]
                    q1, q2, k1, k2, v, do, lse1, lse2, delta1, delta2, allowed, lam, qk_scale, True)
                dv = _dot((p1 - lam * p2).to(do.dtype), do, dv)  # += (P1 - lam P2)^T dO
                dk1 = _dot(ds1.to(q1.dtype), q1, dk1)
                dk2 = _dot(ds2.to(q2.dtype), q2, dk2)

        row_kv = bh_kv * S  # DK1, DK2, DV are contiguous [B, H_KV, S, *]
        _store_rows(DK1 + row_kv * HEAD_DIM, dk1 * scaling, offs_n, offs_d, S, HEAD_DIM)
        _store_rows(DK2 + row_kv * HEAD_DIM, dk2 * scaling, offs_n, offs_d, S, HEAD_DIM)
        _store_rows(DV + row_kv * V_DIM, dv, offs_n, offs_v, S, V_DIM)


# Per-block shared memory (the opt-in maximum, bytes) of the targets the tiles below are compiled and checked for
# ahead of time: sm_80 (A100, A800; also sm_87), sm_86 and sm_89 (A10, A40, L4, L40, RTX 30xx/40xx), sm_90 (H100,
# H200). A GPU runs the tiles of the first target whose family it belongs to (`device_target`).
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# Under TRITON_INTERPRET=1: the compute capability whose tiles the interpreter runs (e.g. 90), to test the shapes a
# GPU uses; None runs 16 x 16 tiles, the fastest on a CPU.
INTERPRETER_TARGET: int | None = None

_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}  # the dtypes of the tile table's keys
# Inputs (device, dtype, d, dv) whose launch failed for lack of shared memory or registers in this process: a GPU or
# Triton release the tiles were not fit-checked for. `unfit_reason` names them, so later calls run standard attention.
_LAUNCH_FAILURES: dict[tuple[str, torch.dtype, int, int], str] = {}


class TileDoesNotFit(RuntimeError):
    """A diff_flash kernel's launch failed for lack of shared memory or registers (Triton's OutOfResources); the
    message says what ran where and why, as `unfit_reason` does from then on."""


def _dims_supported(head_dim: int, value_dim: int) -> bool:
    return head_dim in _HEAD_DIMS and value_dim in (head_dim, 2 * head_dim)


def _dims_reason(head_dim: int, value_dim: int) -> str:
    return f"head dims d={head_dim}, dv={value_dim}: the kernel takes d in {_HEAD_DIMS} with dv = d or 2d"


def tile_config(kernel: str, head_dim: int, value_dim: int, dtype: torch.dtype | str, target: int,
                masked: bool = False) -> Tile | None:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of `kernel` ("fwd", "dq" or "dkdv") for target `target` (a compute
    capability of SHARED_MEMORY), with or without a mask, or None when no tile of these dims fits it: dv must be d
    or 2d."""
    if not _dims_supported(head_dim, value_dim):
        return None
    name = _DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
    tiles = TILES.get((TARGET_TILES.get(target), name, head_dim, value_dim, kernel))
    return None if tiles is None else tiles[masked]


@functools.cache
def device_target(index: int) -> int | None:
    """The target of SHARED_MEMORY whose tiles CUDA device `index` runs, or None when it has none: Hopper runs sm_90's;
    other GPUs of compute capability 8.0 or newer the sm_80 or the sm_86 tiles, whichever shared memory allows."""
    major, _ = torch.cuda.get_device_capability(index)
    shared = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
    if major == 9:
        return 90
    if major >= 8:
        return next((target for target in (80, 86) if shared >= SHARED_MEMORY[target]), None)
    return None


def _tiles(kernel: str, head_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device,
           masked: bool = False) -> Tile | None:
    """What runs on `device`: the table's tile, 16 x 16 tiles under the interpreter unless INTERPRETER_TARGET says."""
    if _INTERPRET:
        if INTERPRETER_TARGET is None:
            return 16, 16, 4, 1
        return tile_config(kernel, head_dim, value_dim, dtype, INTERPRETER_TARGET, masked)
    target = device_target(device.index if device.index is not None else torch.cuda.current_device())
    return None if target is None else tile_config(kernel, head_dim, value_dim, dtype, target, masked)


def unfit_reason(head_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device) -> str:
    """Why diff_flash has no tile for these dims on `device` ("" when every kernel has one): the caller routes such
    inputs to standard attention instead of letting Triton fail for lack of shared memory mid-training."""
    if not _dims_supported(head_dim, value_dim):
        return _dims_reason(head_dim, value_dim)
    if failed := _LAUNCH_FAILURES.get((str(device), dtype, head_dim, value_dim)):  # see `_failure_key`
        return failed
    runs_here = triton is not None and (_INTERPRET or device.type == "cuda")  # else the kernel says why it can't
    if not runs_here or all(_tiles(kernel, head_dim, value_dim, dtype, device) for kernel in KERNELS):
        return ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"the sm_{INTERPRETER_TARGET} tiles"
    return f"{dtype} at d={head_dim}, dv={value_dim} on {name}: no tile fits its shared memory and registers"


def _failure_key(like: Tensor, head_dim: int, value_dim: int) -> tuple[str, torch.dtype, int, int]:
    return str(like.device), like.dtype, head_dim, value_dim


def _launch(kernel: str, jit_fn, grid: tuple[int, int], like: Tensor, head_dim: int, value_dim: int, *args,
            **options) -> None:
    """`jit_fn[grid](*args, **options)`. Triton's OutOfResources (the tile needs more shared memory or registers than
    this GPU has) is remembered for these inputs (`unfit_reason`) and raised as TileDoesNotFit."""
    try:
        jit_fn[grid](*args, **options)
    except triton.runtime.errors.OutOfResources as error:
        name = torch.cuda.get_device_name(like.device) if like.device.type == "cuda" else "the Triton interpreter"
        reason = (f"{like.dtype} at d={head_dim}, dv={value_dim} on {name}: the {kernel} kernel's launch failed "
                  f"({str(error).split('. ')[0]})")
        _LAUNCH_FAILURES[_failure_key(like, head_dim, value_dim)] = reason
        raise TileDoesNotFit(reason) from error


def _recomputed_grads(q: Tensor, k: Tensor, v: Tensor, lam32: Tensor, scaling: float, causal: bool,
                      mask: Tensor | None, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dlam) through the float64 reference (`naive_diff_attention`, T x S memory per head), for a
    backward whose kernel could not launch: the forward already ran, so the gradients cannot move to the standard
    calls; later calls do (`unfit_reason`)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v, lam32)]
        out = naive_diff_attention(*leaves, scaling, causal, mask)  # [B, T, h, dv] float64
        grads = torch.autograd.grad(out, leaves, grad_out.transpose(1, 2).double())
    return tuple(grad.to(t.dtype) for grad, t in zip(grads, (q, k, v, lam32)))


def _checked_tiles(kernel: str, head_dim: int, value_dim: int, like: Tensor, masked: bool) -> Tile:
    tile = _tiles(kernel, head_dim, value_dim, like.dtype, like.device, masked)
    if tile is None:
        raise ValueError(f"diff_flash_attention cannot run "
                         f"{unfit_reason(head_dim, value_dim, like.dtype, like.device)}; check `unfit_reason` first "
                         "and use standard attention for such inputs (the model does this by itself)")
    return tile


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    ok, reason = triton_available()
    if not ok:
        raise RuntimeError(f"diff_flash_attention is unavailable: {reason}")
    if not _INTERPRET and q.device.type != "cuda":
        raise RuntimeError(f"diff_flash_attention needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1")
    if not all(t.dim() == 4 for t in (q, k, v)):
        raise ValueError("q [B, 2h, T, d], k [B, h_kv, S, 2d] and v [B, h_kv, S, dv] must be 4-D")
    if not all(t.dtype == q.dtype for t in (k, v)) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q/k/v must share one dtype among fp16, bf16, fp32; got {[t.dtype for t in (q, k, v)]}")
    B, two_h, T, d = q.shape
    _, h_kv, S, dv = v.shape
    if two_h % 2 or k.shape != (B, h_kv, S, 2 * d) or v.shape[0] != B:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} (expected [B, 2h, T, d]), k {tuple(k.shape)} "
                         f"(expected [B, h_kv, S, 2d]), v {tuple(v.shape)} (expected [B, h_kv, S, dv])")
    if (two_h // 2) % h_kv:
        raise ValueError(f"query heads ({two_h // 2}) must be a multiple of key/value heads ({h_kv})")
    if not _dims_supported(d, dv):
        raise ValueError(_dims_reason(d, dv))


def _mask_args(mask: Tensor | None, shape: tuple[int, int, int, int], like: Tensor) -> tuple[Tensor, tuple, bool]:
    """Kernel pointer, strides (0 along broadcast dims) and HAS_MASK; a dummy pointer when there is no mask."""
    if mask is None:
        return like, (0, 0, 0, 0), False
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True = may attend), got {mask.dtype}")
    mask = mask.expand(shape)
    return mask, mask.stride(), True


class DiffFlashAttentionFunction(torch.autograd.Function):
    """Packed q and k in, their gradients packed out: one copy of dq and of dk, where autograd through the branch
    views would zero-fill a full-size gradient per view and add the two."""

    @staticmethod
    def forward(ctx, q, k, v, lam, scaling, causal, mask):
        q1, q2, k1, k2 = split_branches(q, k)  # [B, h, T, d], [B, h_kv, S, d]: views
        B, h, T, d = q1.shape
        _, h_kv, S, dv = v.shape
        lam32 = lam.detach().to(device=q1.device, dtype=torch.float32).reshape(())
        mask_t, mask_strides, has_mask = _mask_args(mask, (B, h, T, S), q1)
        block_m, block_n, warps, stages = _checked_tiles("fwd", d, dv, q1, has_mask)

        out = torch.empty(B, h, T, dv, dtype=q1.dtype, device=q1.device)
        o2 = torch.empty_like(out)
        lse1 = torch.empty(B, h, T, dtype=torch.float32, device=q1.device)
        lse2 = torch.empty_like(lse1)
        _launch("forward", _diff_attn_fwd, (triton.cdiv(T, block_m), B * h), q1, d, dv,
                q1, q2, k1, k2, v, lam32, mask_t, out, o2, lse1, lse2,
                *q1.stride(), *k1.stride(), *v.stride(), *mask_strides,
                h, T, S, h // h_kv, scaling * math.log2(math.e),
                HEAD_DIM=d, V_DIM=dv, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, HAS_MASK=has_mask,
                num_warps=warps, num_stages=stages)
        ctx.save_for_backward(q, k, v, lam32, mask, out, o2, lse1, lse2)
        ctx.scaling, ctx.causal, ctx.lam_dtype, ctx.lam_shape = scaling, causal, lam.dtype, lam.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lam32, mask, out, o2, lse1, lse2 = ctx.saved_tensors
        failed = _LAUNCH_FAILURES.get(_failure_key(q, q.shape[-1], v.shape[-1]))  # by an earlier layer's backward
        if not failed:
            try:
                dq, dk, grad_v, grad_lam = _kernel_grads(q, k, v, lam32, mask, out, o2, lse1, lse2, grad_out,
                                                         ctx.scaling, ctx.causal)
            except TileDoesNotFit as error:
                failed = str(error)
        if failed:
            warnings.warn(f"diff_flash's backward cannot run {failed}; this step's gradients come from the float64 "
                          "reference kernel, and later calls make two standard attention calls", stacklevel=2)
            dq, dk, grad_v, grad_lam = _recomputed_grads(q, k, v, lam32, ctx.scaling, ctx.causal, mask, grad_out)
        return dq, dk, grad_v, grad_lam.to(ctx.lam_dtype).reshape(ctx.lam_shape), None, None, None


def _kernel_grads(q, k, v, lam32, mask, out, o2, lse1, lse2, grad_out, scaling, causal) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dlam) of `DiffFlashAttentionFunction` by the dQ and dK/dV kernels, from what its forward saved."""
    q1, q2, k1, k2 = split_branches(q, k)
    B, h, T, d = q1.shape
    _, h_kv, S, dv = v.shape
    do = grad_out.to(q1.dtype)
    # D_b = rowsum(dO * O_b) with O1 = out + lam * O2 (only out and O2 are kept from the forward).
    delta2 = (do.float() * o2.float()).sum(-1)
    delta1 = (do.float() * out.float()).sum(-1) + lam32 * delta2
    grad_lam = -delta2.sum()
    mask_t, mask_strides, has_mask = _mask_args(mask, (B, h, T, S), q1)
    common = dict(HEAD_DIM=d, V_DIM=dv, CAUSAL=causal, HAS_MASK=has_mask)
    strides = (*q1.stride(), *k1.stride(), *v.stride(), *do.stride(), *mask_strides)
    qk_scale = scaling * math.log2(math.e)

    dq1 = torch.empty(B, h, T, d, dtype=q1.dtype, device=q1.device)
    dq2 = torch.empty_like(dq1)
    block_m, block_n, warps, stages = _checked_tiles("dq", d, dv, q1, has_mask)
    _launch("dQ", _diff_attn_bwd_dq, (triton.cdiv(T, block_m), B * h), q1, d, dv,
            q1, q2, k1, k2, v, do, lam32, mask_t, lse1, lse2, delta1, delta2, dq1, dq2,
            *strides, h, T, S, h // h_kv, qk_scale, scaling,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common)
    dk1 = torch.empty(B, h_kv, S, d, dtype=k1.dtype, device=k1.device)
    dk2 = torch.empty_like(dk1)
    grad_v = torch.empty(B, h_kv, S, dv, dtype=v.dtype, device=v.device)
    block_m, block_n, warps, stages = _checked_tiles("dkdv", d, dv, q1, has_mask)
    _launch("dK/dV", _diff_attn_bwd_dkdv, (triton.cdiv(S, block_n), B * h_kv), q1, d, dv,
            q1, q2, k1, k2, v, do, lam32, mask_t, lse1, lse2, delta1, delta2, dk1, dk2, grad_v,
            *strides, h, h_kv, T, S, h // h_kv, qk_scale, scaling,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common)
    dq = torch.cat([dq1, dq2], dim=1)  # [B, 2h, T, d], halves order
    dk = torch.cat([dk1, dk2], dim=-1)  # [B, h_kv, S, 2d] = (k1 | k2)
    return dq, dk, grad_v, grad_lam


def diff_flash_attention(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, scaling: float, causal: bool = True,
                         mask: Tensor | None = None) -> Tensor:
    """softmax(scaling q1 k1^T + mask) v - lam softmax(scaling q2 k2^T + mask) v in one pass, packed layout in and
    out (see the module docstring). Returns [B, T, h, dv] in the input dtype. Differentiable in q, k, v and lam."""
    _check_inputs(q, k, v)
    out = DiffFlashAttentionFunction.apply(q, k, v, lam, float(scaling), bool(causal), mask)
    return out.transpose(1, 2)  # [B, h, T, dv] -> [B, T, h, dv]
