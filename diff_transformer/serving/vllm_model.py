"""The Differential Transformer (Ye et al., "Differential Transformer", ICLR 2025, arXiv 2410.05258) as a native
vLLM model, loaded by vLLM through the `vllm.general_plugins` entry point (`diff_transformer.serving.register`).

Every attention layer is ONE call of vLLM's paged `Attention` (docs/serving.md, "How the mapping works"):

    V1 differential   2h query heads [q1, 0] and [0, q2], grouped per kv head, over h_kv kv heads holding
                      (k1 | k2) and v; width 2d (or dv, or the CPU kernel's next size, zero-padded); scale d^-0.5.
                      head_j = A1 V - lambda A2 V, then (1 - lambda_init) SubLN(head_j).
    V2 differential   2h query heads of width d over h_kv kv heads;
                      head_j = attn_2j - sigmoid(lambda_proj x)_j attn_2j+1.
    standard          Llama attention with h dv / d heads of width d (padded to the V1 layers' page size).

Zero columns added to q and k leave every score unchanged, and zero columns added to v are cut from the output,
so padding is exact. This module imports vLLM at the top: only vLLM's model registry imports it.
"""

import functools
import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform

from ..modeling_diff import compute_lambda
from .layout import check_servable

BRANCH_HALVES = "diff_branch_halves"  # marks q_proj / k_proj of a V1 layer: rows in the halves order of design.md §2
STACKED = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


def pad_heads(x: torch.Tensor, heads: int, width: int, target: int, left: int = 0) -> torch.Tensor:
    """[T, heads * width] -> [T, heads * target], each head's columns moved `left` columns right, zeros elsewhere."""
    if target == width and left == 0:
        return x
    x = x.view(x.shape[0], heads, width)  # [T, heads, width]
    return F.pad(x, (left, target - width - left)).view(x.shape[0], heads * target)


def halves_shard(weight: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """Rank `rank`'s rows of a V1 q_proj / k_proj in the halves order: its slice of branch 1's rows, then the same
    slice of branch 2's (both sub-heads of its heads, as diff_tensor_parallel.py shards them)."""
    branch1, branch2 = weight.chunk(2, dim=0)  # [rows / 2, ...] each
    return torch.cat([branch1.chunk(ranks, dim=0)[rank], branch2.chunk(ranks, dim=0)[rank]])


def column(config, out_features: int, bias: bool, quant_config, prefix: str) -> ColumnParallelLinear:
    return ColumnParallelLinear(config.hidden_size, out_features, bias=bias, quant_config=quant_config, prefix=prefix)


class ParamVector(nn.Module):
    """Holds the V1 lambda vectors `q1, k1, q2, k2` under our weight names."""

    def __init__(self, size: int, names: tuple[str, ...]):
        super().__init__()
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.zeros(size), requires_grad=False))


class DiffAttentionBase(nn.Module):
    """Projections, RoPE over d-wide sub-heads and one paged `Attention` call; the subclasses say the head shapes."""

    def __init__(self, config, prefix: str, cache_config, quant_config, shapes: dict[str, int], width: int):
        super().__init__()
        ranks = get_tensor_model_parallel_world_size()
        self.layer_idx = extract_layer_index(prefix)
        self.d, self.width = config.head_dim, width
        self.heads, self.kv_heads = shapes["q_heads"] // ranks, shapes["kv_heads"] // ranks  # on this rank
        q_rows = shapes["q_heads"] * self.d
        self.q_proj = column(config, q_rows, config.attention_bias, quant_config, f"{prefix}.q_proj")
        self.k_proj = column(config, shapes["k_rows"], config.attention_bias, quant_config, f"{prefix}.k_proj")
        self.v_proj = column(config, shapes["v_rows"], config.attention_bias, quant_config, f"{prefix}.v_proj")
        self.o_proj = RowParallelLinear(shapes["o_cols"], config.hidden_size, bias=config.attention_out_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.d, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters=getattr(config, "rope_parameters", None))
        self.attn = Attention(shapes["attn_heads"] // ranks, width, self.d**-0.5, num_kv_heads=self.kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, q heads * d], k [T, k rows], v [T, v rows], RoPE applied to every d-wide q / k sub-head."""
        q, _ = self.q_proj(x)
        k, _ = self.k_proj(x)
        v, _ = self.v_proj(x)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class DiffV1Attention(DiffAttentionBase):
    """Differential attention (paper §2.1): both branches in one call over 2h padded query heads."""

    def __init__(self, config, prefix: str, cache_config, quant_config, width: int):
        h, h_kv, d, dv = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.value_head_dim
        shapes = {"q_heads": 2 * h, "k_rows": 2 * h_kv * d, "v_rows": h_kv * dv, "o_cols": h * dv, "attn_heads": 2 * h,
                  "kv_heads": h_kv}
        super().__init__(config, prefix, cache_config, quant_config, shapes, width)
        self.dv, self.n_rep = dv, h // h_kv
        for proj in (self.q_proj, self.k_proj):
            setattr(proj.weight, BRANCH_HALVES, True)
            if proj.bias is not None:
                setattr(proj.bias, BRANCH_HALVES, True)
        self.lambda_init = config.layer_lambda_init(self.layer_idx)
        self.lambda_params = ParamVector(d, ("q1", "k1", "q2", "k2"))
        self.use_subln, self.eps = config.use_subln, config.rms_norm_eps
        self.output_scale = 1.0 - self.lambda_init if config.use_subln else 1.0
        if config.use_subln:
            self.subln = ParamVector(dv, ("weight",))

    def lam(self) -> torch.Tensor:
        p = self.lambda_params
        return compute_lambda(p.q1, p.k1, p.q2, p.k2, self.lambda_init)

    def padded_inputs(self, q, k, v) -> tuple[torch.Tensor, ...]:
        """The call's inputs: q [T, h_kv * 2 n_rep * W] as [q1, 0] / [0, q2] rows ordered (kv head, branch, n_rep),
        k [T, h_kv * W] packed (k1 | k2 | 0), v [T, h_kv * W] (v | 0)."""
        tokens, d, w = q.shape[0], self.d, self.width
        q = q.view(tokens, 2, self.kv_heads, self.n_rep, d).transpose(1, 2)  # [T, h_kv, branch, n_rep, d]
        q = torch.stack([F.pad(q[:, :, 0], (0, w - d)), F.pad(q[:, :, 1], (d, w - 2 * d))], dim=2)  # [.., W]
        k = k.view(tokens, 2, self.kv_heads, d).transpose(1, 2).reshape(tokens, -1)  # [T, h_kv * 2d]: (k1 | k2)
        k = pad_heads(k, self.kv_heads, 2 * d, w)  # [T, h_kv * W]
        v = pad_heads(v, self.kv_heads, self.dv, w)  # [T, h_kv * W]
        return q.reshape(tokens, -1), k, v

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        out = self.attn(*self.padded_inputs(*self.project(positions, hidden_states)))  # [T, 2h * W]
        out = out.view(tokens, self.kv_heads, 2, self.n_rep, self.width)[..., : self.dv].float()  # [T, h_kv, b, r, dv]
        heads = torch.addcmul(out[:, :, 0], out[:, :, 1], self.lam(), value=-1)  # A1 V - lambda A2 V: [T, h_kv, r, dv]
        if self.use_subln:  # RMSNorm per head over dv with the gain, times 1 - lambda_init, in fp32
            heads = F.rms_norm(heads, (self.dv,), self.subln.weight.float(), self.eps) * self.output_scale
        output, _ = self.o_proj(heads.to(hidden_states.dtype).reshape(tokens, -1))  # [T, hidden]
        return output


class DiffV2Attention(DiffAttentionBase):
    """DIFF V2: one call over 2h heads of width d; out_j = attn_2j - sigmoid(lambda_proj(x))_j attn_2j+1."""

    def __init__(self, config, prefix: str, cache_config, quant_config, width: int):
        h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        shapes = {"q_heads": 2 * h, "k_rows": h_kv * d, "v_rows": h_kv * d, "o_cols": h * d, "attn_heads": 2 * h,
                  "kv_heads": h_kv}
        super().__init__(config, prefix, cache_config, quant_config, shapes, width)
        self.lambda_proj = column(config, h, False, quant_config, f"{prefix}.lambda_proj")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, d, w = hidden_states.shape[0], self.d, self.width
        q, k, v = self.project(positions, hidden_states)
        out = self.attn(pad_heads(q, self.heads, d, w), pad_heads(k, self.kv_heads, d, w),
                        pad_heads(v, self.kv_heads, d, w))  # [T, 2h * W]
        out = out.view(tokens, self.heads // 2, 2, w)[..., :d].float()  # [T, h, pair, d]
        gate, _ = self.lambda_proj(hidden_states)  # [T, h]
        heads = out[:, :, 0] - torch.sigmoid(gate.float())[..., None] * out[:, :, 1]  # [T, h, d]
        output, _ = self.o_proj(heads.to(hidden_states.dtype).reshape(tokens, -1))
        return output


class DiffStandardAttention(DiffAttentionBase):
    """Llama attention of a hybrid stack: h dv / d heads of width d (h_kv dv / d kv heads)."""

    def __init__(self, config, prefix: str, cache_config, quant_config, width: int):
        widen, d = config.value_head_dim // config.head_dim, config.head_dim
        h, h_kv = config.num_attention_heads * widen, config.num_key_value_heads * widen
        shapes = {"q_heads": h, "k_rows": h_kv * d, "v_rows": h_kv * d, "o_cols": h * d, "attn_heads": h,
                  "kv_heads": h_kv}
        super().__init__(config, prefix, cache_config, quant_config, shapes, width)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, d, w = hidden_states.shape[0], self.d, self.width
        q, k, v = self.project(positions, hidden_states)
        out = self.attn(pad_heads(q, self.heads, d, w), pad_heads(k, self.kv_heads, d, w),
                        pad_heads(v, self.kv_heads, d, w))  # [T, h' * W]
        out = out.view(tokens, self.heads, w)[..., :d].reshape(tokens, -1)  # [T, h' * d]
        output, _ = self.o_proj(out)
        return output


def build_attention(*, widths: dict[str, int], config, prefix: str, cache_config=None, quant_config=None,
                    **llama_arguments) -> nn.Module:
    """`LlamaDecoderLayer`'s attention factory: the layer kind of `attention_types`, heads `widths[kind]` wide
    (Llama's head arguments unused)."""
    kind = config.attention_types[extract_layer_index(prefix)]
    if kind == "standard":
        return DiffStandardAttention(config, prefix, cache_config, quant_config, widths[kind])
    attention = DiffV2Attention if config.diff_version == 2 else DiffV1Attention
    return attention(config, prefix, cache_config, quant_config, widths[kind])


class DiffForCausalLM(LlamaForCausalLM):
    """vLLM's Llama decoder (pre-RMSNorm, SwiGLU, vocab-parallel embedding and head) with differential attention."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        parallel = vllm_config.parallel_config
        widths = check_servable(config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                current_platform.is_cpu())
        if not current_platform.is_cpu():
            warnings.warn("serving a DIFF model off the CPU is untested (only vLLM's CPU build "
                          "is, docs/serving.md): compare its greedy tokens with transformers' before relying on it",
                          stacklevel=2)
        attention = functools.partial(build_attention, widths=widths)
        layer = functools.partial(LlamaDecoderLayer, attn_layer_type=attention)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load our safetensors names; gate/up go into vLLM's fused gate_up_proj, V1 q/k rows by branch halves."""
        params = dict(self.named_parameters())
        rank, ranks = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        loaded = set()
        for name, weight in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = next(((name.replace(ours, fused), index) for ours, (fused, index) in STACKED.items()
                          if ours in name), None)
            target = shard[0] if shard else name
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in the folder: it is no DIFF Transformer weight of this "
                                 "config; re-save the model with save_pretrained")
            param = params[target]
            if shard:
                param.weight_loader(param, weight, shard[1])
            elif getattr(param, BRANCH_HALVES, False):
                default_weight_loader(param, halves_shard(weight, rank, ranks))
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
            loaded.add(target)
        return loaded
