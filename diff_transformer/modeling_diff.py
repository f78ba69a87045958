"""Differential Transformer (Ye et al., "Differential Transformer", ICLR 2025, arXiv 2410.05258) as subclasses of
transformers' Llama classes: only the attention differs.

    A_b    = softmax(Q_b K_b^T / sqrt(d) + mask)                       b = 1, 2
    head_j = (A_1 - lambda A_2) V_j                                    V_j is `value_head_dim` (2d) wide
    out_j  = (1 - lambda_init) SubLN(head_j)
    lambda = exp(<lq1, lk1>) - exp(<lq2, lk2>) + lambda_init

The decoder layer, model and causal LM are Llama's with these attentions (`DiffAttention`; `DiffV2Attention` for DIFF
V2; `DiffStandardAttention`, Llama attention, for the standard layers of hybrid stacks), the lambda initialisation
and the cache shapes of `DiffConfig.per_layer_config`.

The attention of a layer projects q [B, 2h, T, d] (halves order), keys packed [B, h_kv, T, 2d] = (k1 | k2) and
v [B, h_kv, T, dv] (the packed layout of kernel_common.py), updates the cache with the packed keys, and runs the
differential kernel of its backend (`diff_attention`, attention_kernels.py). Shape names are those of kernel_common.py.

What is not the model lives beside it: lambda and its per-`generate` freezing (diff_lambda.py), the PolyNorm MLP
(poly_norm.py), argument checks (input_checks.py), saving and loading (folder_defaults.py), continuous batching
(paged_cache.py), the `diff_flash` backend and branch-map capture (attention_kernels.py).
"""

import functools
from typing import Unpack

import torch
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.utils import TransformersKwargs

from .attention_kernels import DiffFlashBackend, diff_attention, eager_v2_attention
from .config_checks import unvalidated_copy
from .configuration_diff import DiffConfig
from .decoder_layers import DecoderLayers
from .diff_lambda import DiffLambda, frozen_lambdas
from .diff_tensor_parallel import BRANCH_HALVES, check_tp_size
from .folder_defaults import SavedFolderMixin, callers_length
from .input_checks import CACHE_KWARG, check_cache_argument, check_token_ids, embedding_rows
from .kernel_common import upcast
from .paged_cache import PAGED_EAGER, ContinuousBatchingMixin, PagedLayerCache, is_paged, paged_update
from .poly_norm import PolyNorm, build_mlp
from .registration import register_backbone, register_model_code

register_model_code()  # here, so that a folder loaded with trust_remote_code (no package) makes the entries too


class SubLN(LlamaRMSNorm):
    """Llama's RMSNorm over one head's output [..., dv] (paper §2.1 GroupNorm), in fp32 or, for float64 inputs,
    float64 (LlamaRMSNorm computes in fp32 whatever the input)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = upcast(hidden_states)
        return self.weight * (hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True)
                                                         + self.variance_epsilon))


class DifferentialAttentionBase(nn.Module):
    """What V1 and V2 layers share: project, cache, `attend` (the subclass's differential heads [B, T, h, width],
    fp32), then o_proj."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        cache = kwargs.pop(CACHE_KWARG, None)
        q, k, v = self.project(hidden_states, position_embeddings)
        if is_paged(cache):  # continuous batching: the cache takes this forward's kwargs
            k, v = paged_update(cache, k, v, self.layer_idx, self.config, kwargs)
        elif cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, attn_map = self.attend(hidden_states, q, k, v, attention_mask, **kwargs)
        return self.o_proj(out.to(hidden_states.dtype).reshape(batch, length, -1)), attn_map


class DiffAttention(DifferentialAttentionBase):
    """Differential multi-head attention (paper §2.1). q_proj rows are [branch-1 sub-heads | branch-2 sub-heads],
    k_proj rows likewise for the kv heads, v_proj h_kv heads of width dv. With grouped noise heads (GDA,
    `num_noise_heads` g < h) branch 2 has g query heads, each serving h / g consecutive differential heads."""

    def __init__(self, config: DiffConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.value_head_dim = config.value_head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        hidden, d, dv = config.hidden_size, self.head_dim, self.value_head_dim
        self.num_noise_heads = config.num_noise_heads  # branch 2's query heads: h, or h / group with GDA
        self.q_proj = nn.Linear(hidden, (self.num_heads + self.num_noise_heads) * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, 2 * self.num_key_value_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * dv, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * dv, hidden, bias=config.attention_out_bias)
        for proj in (self.q_proj, self.k_proj):
            setattr(proj, BRANCH_HALVES, True)  # tensor parallelism shards each branch's half (diff_tensor_parallel.py)
        lambda_init = config.layer_lambda_init(layer_idx)
        self.lambda_params = DiffLambda(d, lambda_init, config.lambda_std_dev)
        self.use_subln = config.use_subln  # the one decision: SubLN with its (1 - lambda_init) scale, or neither
        self.subln = SubLN(dv, eps=config.subln_eps) if self.use_subln else nn.Identity()  # per head

    @property
    def output_scale(self) -> float:
        """The head outputs' scale: 1 - lambda_init with SubLN (paper §2.1), 1 without."""
        return 1.0 - self.lambda_params.lambda_init if self.use_subln else 1.0

    def set_lambda_init(self, value: float) -> None:
        """lambda_init enters lambda and, with SubLN, the output scale 1 - lambda_init."""
        self.lambda_params.lambda_init = value

    def project(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        """Project and rotate: q [B, h + g, T, d] (g = h without GDA), k [B, h_kv, T, 2d] (k1 | k2 per kv head),
        v [B, h_kv, T, dv].

        Head counts come from the projections' outputs: under tensor parallelism a rank holds h / n heads."""
        batch, length, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)  # [B, h + g, T, d]
        k = self.k_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)  # [B, 2h_kv, T, d]
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k = k.view(batch, 2, -1, length, d).permute(0, 2, 3, 1, 4).reshape(batch, -1, length, 2 * d)
        v = self.v_proj(hidden_states).view(batch, length, -1, self.value_head_dim).transpose(1, 2)  # [B, h_kv, T, dv]
        return q, k, v

    def attend(self, hidden_states, q, k, v, attention_mask, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(1 - lambda_init) SubLN((A1 - lambda A2) V) per head, [B, T, h, dv] fp32, by the backend's kernel."""
        out, attn_map = diff_attention(self, q, k, v, self.lambda_params(), attention_mask, self.scaling, **kwargs)
        return (self.subln(out) * self.output_scale if self.use_subln else out), attn_map  # no copy without SubLN


class DiffV2Attention(DifferentialAttentionBase):
    """DIFF V2: one attention call over 2h heads of dim d; head pair (2j, 2j+1) gives
    out_j = attn_2j - sigmoid(lambda_proj(x))_j attn_2j+1. No SubLN, no (1 - lambda_init)."""

    def __init__(self, config: DiffConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 2 * config.num_attention_heads // config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=config.attention_out_bias)
        self.lambda_proj = nn.Linear(hidden, self.num_heads, bias=False)

    def project(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        """Project and rotate: q [B, 2h, T, d], k and v [B, h_kv, T, d]."""
        shape = (*hidden_states.shape[:2], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [B, 2h, T, d]
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # [B, h_kv, T, d]
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)  # [B, h_kv, T, d]
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        return q, k, v

    def attend(self, hidden_states, q, k, v, attention_mask, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """attn_2j - gate_j attn_2j+1 per head, [B, T, h, d] fp32, in one attention call over the 2h heads."""
        gate = self.lambda_proj(hidden_states.to(self.lambda_proj.weight.dtype))  # fp32 in an fp16 load
        gate = torch.sigmoid(gate.float())  # [B, T, h]
        if self.config._attn_implementation in ("eager", PAGED_EAGER):
            return eager_v2_attention(self, q, k, v, gate, attention_mask, self.scaling)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, sdpa_attention_forward)
        attn, weights = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        attn = attn.view(*hidden_states.shape[:2], -1, 2, self.head_dim)  # [B, T, h, pair, d]
        return attn[..., 0, :].float() - gate[..., None] * attn[..., 1, :].float(), weights


class DiffStandardAttention(LlamaAttention):
    """Llama attention for hybrid stacks, with `h * dv / d` heads of dim d: the projection shapes of a differential
    layer when dv = 2d. Llama's `__init__` builds it from those head counts; its `config` stays the model's, whose
    backend `set_attn_implementation` switches."""

    def __init__(self, config: DiffConfig, layer_idx: int):
        cache = config.layer_cache("standard")
        widen = cache.kv_heads // config.num_key_value_heads
        super().__init__(unvalidated_copy(config, num_attention_heads=config.num_attention_heads * widen,
                                          num_key_value_heads=cache.kv_heads), layer_idx)
        self.config = config
        if config.attention_out_bias != config.attention_bias:  # Llama's o_proj has q/k/v's bias setting
            bias = self.o_proj.weight.new_zeros(config.hidden_size)
            self.o_proj.bias = nn.Parameter(bias) if config.attention_out_bias else None

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Llama's forward; on continuous batching's paged cache, whose rows may be wider than this layer's keys and
        values (`paged_cache.py`), through `PagedLayerCache`."""
        if is_paged(cache := kwargs.get(CACHE_KWARG)):
            kwargs[CACHE_KWARG] = PagedLayerCache(cache, self.config, kwargs)
        return super().forward(*args, **kwargs)


def build_attention(config: DiffConfig, layer_idx: int) -> nn.Module:
    if config.attention_types[layer_idx] == "standard":
        return DiffStandardAttention(config, layer_idx)
    if config.diff_version == 2:
        return DiffV2Attention(config, layer_idx)
    return DiffAttention(config, layer_idx)


ATTENTION_CLASSES = (DiffAttention, DiffV2Attention, DiffStandardAttention)


class DiffDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-RMSNorm block with a differential (or, in hybrid stacks, standard) attention."""

    def __init__(self, config: DiffConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # LlamaDecoderLayer's modules, without building its attention
        self.hidden_size = config.hidden_size
        self.self_attn = build_attention(config, layer_idx)
        self.mlp = build_mlp(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DiffPreTrainedModel(SavedFolderMixin, DiffFlashBackend, LlamaPreTrainedModel):
    config: DiffConfig
    config_class = DiffConfig
    _no_split_modules = ["DiffDecoderLayer"]
    _can_record_outputs = {"hidden_states": DiffDecoderLayer, "attentions": list(ATTENTION_CLASSES)}

    def post_init(self) -> None:
        """transformers' post_init; a DIFF V2 model keeps its per-token lambda gate (h outputs) out of quantization
        (a quantizer's CPU kernels may need widths in multiples of 32, and the gate's error would scale the second
        map) and in fp32 when loaded in fp16: `_keep_in_fp32_modules`, set only where the model has the module."""
        if self.config.diff_version == 2:
            self._keep_in_fp32_modules = ["lambda_proj"]
        super().post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, DiffLambda):
            for param in (module.q1, module.k1, module.q2, module.k2):
                init.normal_(param, mean=0.0, std=module.std)
        elif isinstance(module, Gemma3TextScaledWordEmbedding):  # a buffer, not saved: from the config
            init.constant_(module.embed_scale, module.scalar_embed_scale)
        elif isinstance(module, PolyNorm):
            init.constant_(module.weight, 1 / 3)
            init.zeros_(module.bias)

    @classmethod
    def maybe_distribute_model(cls, model: "DiffPreTrainedModel", distributed_config, *args):
        """transformers' sharding, once `check_tp_size` has found that every rank gets whole heads."""
        check_tp_size(model.config, getattr(distributed_config, "tp_size", None) or 1)
        return super().maybe_distribute_model(model, distributed_config, *args)


class DiffModel(DiffPreTrainedModel, LlamaModel):
    def __init__(self, config: DiffConfig):
        PreTrainedModel.__init__(self, config)  # LlamaModel's modules, with DIFF decoder layers
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        # token embeddings x config.embedding_multiplier, in the module so that inputs_embeds built with
        # get_input_embeddings() (assisted decoding, peft's embedding adapters) are scaled alike
        self.embed_tokens = Gemma3TextScaledWordEmbedding(
            config.vocab_size, config.hidden_size, self.padding_idx, embed_scale=config.embedding_multiplier
        )
        self.layers = DecoderLayers([DiffDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    # LlamaModel's forward (and signature), after two checks that turn silent failures into errors: the cache's
    # argument name (`check_cache_argument`) and token ids outside the embedding (`check_token_ids`).
    @functools.wraps(LlamaModel.forward)
    def forward(self, input_ids: torch.LongTensor | None = None, *args, **kwargs) -> BaseModelOutputWithPast:
        check_cache_argument(kwargs)
        if input_ids is not None:
            check_token_ids(input_ids, embedding_rows(self.embed_tokens))  # not config.vocab_size: resizing
        return super().forward(input_ids, *args, **kwargs)


# GenerationMixin named, as transformers' own causal LMs do
class DiffForCausalLM(ContinuousBatchingMixin, DiffPreTrainedModel, LlamaForCausalLM, GenerationMixin):
    def __init__(self, config: DiffConfig):
        PreTrainedModel.__init__(self, config)  # LlamaForCausalLM's modules, with a DiffModel
        self.model = DiffModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _get_static_cache_init_shape(self) -> tuple[list[int], list[int]] | None:
        """Shapes for `generate`'s early static-cache allocation (chunked prefill), read per layer from
        `DiffConfig.per_layer_config`; each of n tensor-parallel ranks holds 1/n of every layer's kv heads. None
        (allocation by the first forward) for layers spread over devices or keys and values of different widths,
        as transformers does."""
        layers = self.config.per_layer_config
        if len(set(getattr(self, "hf_device_map", {0: None}).values())) > 1 or any(
            getattr(layer, "qk_head_dim", None) for layer in layers
        ):
            return None
        ranks = getattr(self, "_tp_size", None) or 1
        return [layer.num_key_value_heads // ranks for layer in layers], [layer.head_dim for layer in layers]

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, with each layer's lambda computed once per call (`frozen_lambdas`), and a
        caller's own `max_length` in force over the folder's default `max_new_tokens` (`callers_length`)."""
        with frozen_lambdas(self), callers_length(self, args, kwargs):
            return super().generate(*args, **kwargs)


class DiffTaskHead:
    """Base of the task heads, before transformers' generic head (`GenericFor...`), which builds the backbone with
    `AutoModel.from_config(config)`: AutoModel finds DiffModel by the config's class. A folder loaded with
    trust_remote_code=True imports configuration_diff.py twice (alone for AutoConfig, beside this file for the model
    code), so `config` may be of a DiffConfig class no Auto class knows, and the package may not be imported at all;
    the head registers it for DiffModel first (`register_backbone`, listed in registration.py)."""

    def __init__(self, config: DiffConfig):
        register_backbone(type(config), DiffModel)
        super().__init__(config)


class DiffForSequenceClassification(DiffTaskHead, GenericForSequenceClassification, DiffPreTrainedModel): ...


class DiffForTokenClassification(DiffTaskHead, GenericForTokenClassification, DiffPreTrainedModel): ...


class DiffForQuestionAnswering(DiffTaskHead, GenericForQuestionAnswering, DiffPreTrainedModel): ...


def differential_layers(model: nn.Module) -> list[DiffAttention]:
    """The V1 differential attention modules of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, DiffAttention)]


__all__ = [
    "DiffPreTrainedModel",
    "DiffModel",
    "DiffForCausalLM",
    "DiffForSequenceClassification",
    "DiffForTokenClassification",
    "DiffForQuestionAnswering",
]
