"""The Differential Transformer (Ye et al., "Differential Transformer", ICLR 2025, arXiv 2410.05258) as a native
vLLM model, loaded by vLLM through the `vllm.general_plugins` entry point (`diff_transformer.serving.register`).

Every attention layer is ONE call of vLLM's paged `Attention` (docs/serving.md, "How the mapping works"):

    V1 differential   h + g query heads, h [q1, 0] and g [0, q2] (g noise heads: h, or fewer with grouped noise
                      heads), grouped per kv head, over h_kv kv heads holding (k1 | k2) and v; width 2d (or dv,
                      or the CPU kernel's next size, zero-padded); scale d^-0.5.
                      head_j = A1 V - lambda A2 V (A2 of head j's noise head), then (1 - lambda_init) SubLN(head_j).
    V2 differential   2h query heads of width d over h_kv kv heads;
                      head_j = attn_2j - sigmoid(lambda_proj x)_j attn_2j+1.
    standard          Llama attention with h dv / d heads of width d (padded to the V1 layers' page size).

Zero columns added to q and k leave every score unchanged, and zero columns added to v are cut from the output,
so padding is exact. As in vLLM's Llama, q, k and v are one GEMM (`qkv_proj`); the loader
orders a V1 layer's k rows per kv head as (k1 | k2), so the keys come out of the GEMM packed, and it computes each
layer's lambda and the SubLN gain times (1 - lambda_init) once, after loading. This module imports vLLM at the top:
only vLLM's model registry imports it.
"""

import copy
import functools
import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm import _custom_ops as ops
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.utils import extract_layer_index, is_pp_missing_parameter
from vllm.platforms import current_platform

from ..diff_tensor_parallel import branch_halves_rank_major
from ..configuration_diff import POLY_NORM
from ..diff_lambda import compute_lambda
from ..kernel_common import per_head
from ..poly_norm import PolyNorm
from .layout import check_servable, unexpected_weight

# our projection name -> its shard in the fused qkv_proj
QKV_SHARDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
STACKED = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}


def pad_heads(x: torch.Tensor, heads: int, width: int, target: int) -> torch.Tensor:
    """[T, heads * width] -> [T, heads * target], zero columns after each head's."""
    if target == width:
        return x
    x = x.view(x.shape[0], heads, width)  # [T, heads, width]
    return F.pad(x, (0, target - width)).view(x.shape[0], heads * target)


def packed_keys(rows: torch.Tensor, kv_heads: int, d: int) -> torch.Tensor:
    """k_proj rows of one rank in halves order [branch, kv head, d] -> [kv head, branch, d], so that the GEMM gives
    each kv head's keys packed (k1 | k2), the layout of the cache (docs/design.md §5)."""
    blocks = rows.view(-1, 2, kv_heads, d, *rows.shape[1:])  # [rank, branch, kv head, d, ...]
    return blocks.transpose(1, 2).reshape(rows.shape)


class ParamVector(nn.Module):
    """Holds the V1 lambda vectors `q1, k1, q2, k2` (or the SubLN gain `weight`) under our weight names."""

    def __init__(self, size: int, names: tuple[str, ...]):
        super().__init__()
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.zeros(size), requires_grad=False))


class DiffAttentionBase(nn.Module):
    """One fused q/k/v projection, RoPE over d-wide sub-heads and one paged `Attention` call; the subclasses
    say the head shapes (`sizes`: the rows of each fused shard over all ranks)."""

    def __init__(self, config, prefix: str, cache_config, quant_config, shapes: dict[str, int], width: int,
                 sizes: list[int]):
        super().__init__()
        self.ranks = get_tensor_model_parallel_world_size()
        self.layer_idx = extract_layer_index(prefix)
        self.d, self.width = config.head_dim, width
        self.heads, self.kv_heads = shapes["q_heads"] // self.ranks, shapes["kv_heads"] // self.ranks  # on this rank
        self.split = [size // self.ranks for size in sizes]
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, sizes, bias=config.attention_bias,
                                                   quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(shapes["o_cols"], config.hidden_size, bias=config.attention_out_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.d, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters=getattr(config, "rope_parameters", None))
        self.attn = Attention(shapes["attn_heads"] // self.ranks, width, self.d**-0.5, num_kv_heads=self.kv_heads,
                              cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn")

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
        """[q, k, v] column slices of one GEMM, RoPE applied to every d-wide q / k sub-head."""
        parts = list(self.qkv_proj(x)[0].split(self.split, dim=-1))
        parts[0], parts[1] = self.rotary_emb(positions, parts[0], parts[1])
        return parts

    def shard_rows(self, projection: str, rows: torch.Tensor) -> torch.Tensor:
        """The checkpoint's rows of `projection` in the order the fused GEMM wants them (rank blocks first)."""
        return rows

    def after_loading(self) -> None:
        """Values derived from the loaded weights, computed once."""


class DiffAttention(DiffAttentionBase):
    """Differential attention (paper §2.1): both branches in one call over h + g padded query heads; with grouped
    noise heads (g < h) each noise map is computed once and subtracted in every head of its group."""

    def __init__(self, config, prefix: str, cache_config, quant_config, width: int):
        h, h_kv, d, dv = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.value_head_dim
        g = config.num_noise_heads
        shapes = {"q_heads": h + g, "o_cols": h * dv, "attn_heads": h + g, "kv_heads": h_kv}
        sizes = [(h + g) * d, 2 * h_kv * d, h_kv * dv]  # q, k, v rows
        super().__init__(config, prefix, cache_config, quant_config, shapes, width, sizes)
        self.dv, self.n_rep, self.noise_rep = dv, h // h_kv, g // h_kv  # signal / noise query heads per kv head
        self.group, self.signal_rows = h // g, h * d  # differential heads per noise head; q1's rows
        self.lambda_init = config.layer_lambda_init(self.layer_idx)
        self.lambda_params = ParamVector(d, ("q1", "k1", "q2", "k2"))
        self.use_subln, self.eps = config.use_subln, config.subln_eps
        self.output_scale = 1.0 - self.lambda_init if config.use_subln else 1.0
        if config.use_subln:
            self.subln = ParamVector(dv, ("weight",))
        self.lam, self.subln_gain = self.lambda_init, None  # set by `after_loading`

    def shard_rows(self, projection: str, rows: torch.Tensor) -> torch.Tensor:
        if projection == "q_proj":
            return branch_halves_rank_major(rows, self.ranks, self.signal_rows)
        if projection == "k_proj":
            return packed_keys(branch_halves_rank_major(rows, self.ranks), self.kv_heads, self.d)
        return rows

    def after_loading(self) -> None:
        """lambda (paper eq. 1) as a number, and the SubLN gain times (1 - lambda_init) in fp32."""
        p = self.lambda_params
        self.lam = compute_lambda(p.q1, p.k1, p.q2, p.k2, self.lambda_init).item()
        if self.use_subln:
            self.subln_gain = self.subln.weight.detach().float() * self.output_scale

    def padded_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, (h + g) d] in branch order (q1 | q2) -> [T, h_kv * (n_rep + noise_rep) * W]: per kv head its n_rep
        rows [q1, 0], then its noise_rep rows [0, q2], zeros past 2d."""
        tokens, d, signal = q.shape[0], self.d, self.n_rep
        padded = q.new_zeros(tokens, self.kv_heads, signal + self.noise_rep, self.width)
        q1, q2 = q.split([self.kv_heads * signal * d, self.kv_heads * self.noise_rep * d], dim=-1)
        padded[:, :, :signal, :d] = q1.view(tokens, self.kv_heads, signal, d)  # meets k1
        padded[:, :, signal:, d : 2 * d] = q2.view(tokens, self.kv_heads, self.noise_rep, d)  # meets k2
        return padded.view(tokens, -1)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, w = hidden_states.shape[0], self.width
        q, k, v = self.project(positions, hidden_states)  # k: [T, h_kv * 2d], packed (k1 | k2) by the loader
        out = self.attn(self.padded_query(q), pad_heads(k, self.kv_heads, 2 * self.d, w),
                        pad_heads(v, self.kv_heads, self.dv, w))  # [T, (h + g) * W]
        out = out.view(tokens, self.kv_heads, -1, w)[..., : self.dv].float()  # [T, h_kv, n_rep + noise_rep, dv]
        signal, noise = out.split([self.n_rep, self.noise_rep], dim=2)  # A1 V: [T, h_kv, n_rep, dv]; A2 V
        # noise head l of a kv head serves its signal heads l * group ... (l + 1) * group - 1
        noise = per_head(noise, self.group, dim=2)  # [T, h_kv, n_rep, dv]
        heads = torch.sub(signal, noise, alpha=self.lam)  # A1 V - lambda A2 V: [T, h_kv, n_rep, dv]
        if self.use_subln:  # RMSNorm per head over dv, gain times (1 - lambda_init), in fp32: vLLM's one-op kernel
            normed = torch.empty_like(heads)
            ops.rms_norm(normed, heads, self.subln_gain, self.eps)
            heads = normed
        output, _ = self.o_proj(heads.to(hidden_states.dtype).view(tokens, -1))  # [T, hidden]
        return output


class DiffV2Attention(DiffAttentionBase):
    """DIFF V2: one call over 2h heads of width d; out_j = attn_2j - sigmoid(lambda_proj(x))_j attn_2j+1.
    lambda_proj stays its own GEMM: appended to qkv_proj, its h columns would leave the rows of q and k at a stride
    vLLM's CPU RoPE kernel cannot take in bf16 (it crashes)."""

    def __init__(self, config, prefix: str, cache_config, quant_config, width: int):
        h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        shapes = {"q_heads": 2 * h, "o_cols": h * d, "attn_heads": 2 * h, "kv_heads": h_kv}
        super().__init__(config, prefix, cache_config, quant_config, shapes, width, [2 * h * d, h_kv * d, h_kv * d])
        self.lambda_proj = ColumnParallelLinear(config.hidden_size, h, bias=False, quant_config=quant_config,
                                                prefix=f"{prefix}.lambda_proj")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, d, w = hidden_states.shape[0], self.d, self.width
        q, k, v = self.project(positions, hidden_states)
        out = self.attn(pad_heads(q, self.heads, d, w), pad_heads(k, self.kv_heads, d, w),
                        pad_heads(v, self.kv_heads, d, w))  # [T, 2h * W]
        out = out.view(tokens, self.heads // 2, 2, w)[..., :d].float()  # [T, h, pair, d]
        gate, _ = self.lambda_proj(hidden_states)  # [T, h]
        heads = torch.addcmul(out[:, :, 0], torch.sigmoid(gate.float())[..., None], out[:, :, 1], value=-1)
        output, _ = self.o_proj(heads.to(hidden_states.dtype).view(tokens, -1))  # [T, hidden]
        return output


class DiffStandardAttention(DiffAttentionBase):
    """Llama attention of a hybrid stack: h dv / d heads of width d (h_kv dv / d kv heads)."""

    def __init__(self, config, prefix: str, cache_config, quant_config, width: int):
        widen, d = config.value_head_dim // config.head_dim, config.head_dim
        h, h_kv = config.num_attention_heads * widen, config.num_key_value_heads * widen
        shapes = {"q_heads": h, "o_cols": h * d, "attn_heads": h, "kv_heads": h_kv}
        super().__init__(config, prefix, cache_config, quant_config, shapes, width, [h * d, h_kv * d, h_kv * d])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, d, w = hidden_states.shape[0], self.d, self.width
        q, k, v = self.project(positions, hidden_states)
        out = self.attn(pad_heads(q, self.heads, d, w), pad_heads(k, self.kv_heads, d, w),
                        pad_heads(v, self.kv_heads, d, w))  # [T, h' * W]
        if w != d:
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
    attention = DiffV2Attention if config.diff_version == 2 else DiffAttention
    return attention(config, prefix, cache_config, quant_config, widths[kind])


class ShardedPolyNorm(PolyNorm):
    """PolyNorm on one tensor-parallel rank's slice of the MLP width: the mean square of each power is the sum of
    every rank's sums of squares (an all-reduce) over the whole `width`, so each rank normalises as one process."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def normalized(self, u: torch.Tensor) -> torch.Tensor:
        squares = tensor_model_parallel_all_reduce(u.pow(2).sum(-1, keepdim=True))  # [T, 1], over all ranks
        return u * torch.rsqrt(squares / self.width + self.eps)


class PolyNormMLP(nn.Module):
    """`down(PolyNorm(gate x) * up x)` with vLLM's fused gate/up GEMM; PolyNorm is the model's own module
    (modeling_diff.py, fp32), whose norms span the whole intermediate dim: under tensor parallelism each rank
    all-reduces the norms' statistics (`ShardedPolyNorm`)."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=config.mlp_bias, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        sharded = get_tensor_model_parallel_world_size() > 1
        self.act_fn = ShardedPolyNorm(config.intermediate_size) if sharded else PolyNorm()
        for parameter in self.act_fn.parameters():
            parameter.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)  # [T, intermediate / ranks] each
        out, _ = self.down_proj(self.act_fn(gate) * up)
        return out


class DiffDecoderLayer(LlamaDecoderLayer):
    """vLLM's Llama decoder layer; with `hidden_act="poly_norm"` its MLP is `PolyNormMLP` (vLLM's Llama MLP takes
    silu only, so the layer is built with silu and its MLP replaced)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None, **kwargs):
        config = config or vllm_config.model_config.hf_config
        poly_norm = config.hidden_act == POLY_NORM
        built = copy.copy(config)
        if poly_norm:
            built.hidden_act = "silu"
        super().__init__(vllm_config, prefix, built, **kwargs)
        if poly_norm:
            self.mlp = PolyNormMLP(config, self.get_quant_config(vllm_config), f"{prefix}.mlp")


class DiffModel(LlamaModel):
    """vLLM's Llama body, its token embeddings multiplied by `embedding_multiplier` as transformers' model does
    (a float32 scalar cast to the embeddings' dtype, then the product)."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = super().embed_input_ids(input_ids)
        multiplier = getattr(self.config, "embedding_multiplier", 1.0)
        return embeds if multiplier == 1.0 else embeds * torch.tensor(multiplier).to(embeds.dtype)


class DiffForCausalLM(LlamaForCausalLM):
    """vLLM's Llama decoder (pre-RMSNorm, SwiGLU, vocab-parallel embedding and head) with differential attention."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    supports_lora = False  # MERGE_ADVICE; the config hook (`serving.register`) refuses it before the engine starts

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
        layer = functools.partial(DiffDecoderLayer, attn_layer_type=attention)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type: type[nn.Module] = LlamaDecoderLayer):
        return DiffModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load our safetensors names: q/k/v into the fused qkv_proj in the rows order each layer
        kind wants, gate/up into vLLM's fused gate_up_proj (the layers of this pipeline stage only); then each
        attention layer's derived values."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if is_pp_missing_parameter(name, self):  # a layer of another pipeline stage
                continue
            module_name, projection, leaf = (name.rsplit(".", 2) + ["", ""])[:3]
            if projection in QKV_SHARDS and f"{module_name}.qkv_proj.{leaf}" in params:
                target = f"{module_name}.qkv_proj.{leaf}"
                rows = self.get_submodule(module_name).shard_rows(projection, weight)
                params[target].weight_loader(params[target], rows, QKV_SHARDS[projection])
            elif shard := next(((name.replace(ours, fused), index) for ours, (fused, index) in STACKED.items()
                                if ours in name), None):
                target = shard[0]
                if target not in params:
                    raise unexpected_weight(name)
                params[target].weight_loader(params[target], weight, shard[1])
            elif name in params:
                target = name
                getattr(params[name], "weight_loader", default_weight_loader)(params[name], weight)
            else:
                raise unexpected_weight(name)
            loaded.add(target)
        for module in self.modules():
            if isinstance(module, DiffAttentionBase):
                module.after_loading()
        return loaded
