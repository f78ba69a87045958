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
differential kernel that `select_kernel` (attention_kernels.py) names for the backend and inputs. Shape names are
those of kernel_common.py.
"""

import functools
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Unpack

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.auto import AutoModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.utils import TransformersKwargs, is_torchdynamo_compiling

from .attention_kernels import (
    BRANCH_MAPS,
    DIFF_FLASH,
    DIFF_KERNELS,
    eager_v2_attention,
    select_kernel,
    triton_available,
)
from .configuration_diff import POLY_NORM, DiffConfig, check_local_path
from .diff_tensor_parallel import BRANCH_HALVES, check_tp_size
from .folder_defaults import match_weight_file_modes, saved_folder_defaults
from .kernel_common import upcast
from .paged_cache import (
    PAGED_EAGER,
    PagedLayerCache,
    check_continuous_batching,
    is_paged,
    paged_update,
    with_paged_cache_view,
)
from .peft_defaults import register_peft_defaults

register_peft_defaults()  # with the model code, so LoraConfig() needs no target_modules under trust_remote_code too

# The name under which the installed transformers passes the cache to forwards (`cache`, or `past_key_values` in
# the releases before the rename); the modules read it from their keyword arguments under that name.
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
CACHE_NAMES = ("cache", "past_key_values")


def check_cache_argument(kwargs: dict) -> None:
    """In place: a cache passed as `cache` where transformers still names it `past_key_values` gets that name; a
    cache under any other name would be ignored by every layer, each decode step seeing no context: an error."""
    if CACHE_KWARG != "cache" and "cache" in kwargs:
        if kwargs.get(CACHE_KWARG) is not None:
            raise ValueError(f"got the cache as both `cache` and `{CACHE_KWARG}`; pass it once")
        kwargs[CACHE_KWARG] = kwargs.pop("cache")
    for name, value in kwargs.items():
        if name not in CACHE_NAMES and (isinstance(value, Cache) or name in ("past_key_value", "layer_past", "past")):
            raise TypeError(f"{name}={type(value).__name__} is not a cache argument of this model, which would ignore "
                            f"it; pass the cache as `{CACHE_KWARG}`")


def compute_lambda(q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor, lambda_init: float):
    """Paper eq. (1): lambda = exp(<lq1, lk1>) - exp(<lq2, lk2>) + lambda_init, in fp32 (float64 for float64)."""
    return torch.exp(torch.dot(upcast(q1), upcast(k1))) - torch.exp(torch.dot(upcast(q2), upcast(k2))) + lambda_init


class SubLN(LlamaRMSNorm):
    """Llama's RMSNorm over one head's output [..., dv] (paper §2.1 GroupNorm), in fp32 or, for float64 inputs,
    float64 (LlamaRMSNorm computes in fp32 whatever the input)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = upcast(hidden_states)
        return self.weight * (hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True)
                                                         + self.variance_epsilon))


POLY_NORM_EPS = 1e-6  # PolyNorm's epsilon in Motif-2 (and arXiv 2411.03884)


class PolyNorm(nn.Module):
    """PolyNorm (arXiv 2411.03884), the gate activation of `hidden_act="poly_norm"`:
    `weight[0] N(z^3) + weight[1] N(z^2) + weight[2] N(z) + bias`, `N(u) = u / sqrt(mean(u^2) + eps)` over the last
    dim, computed in fp32 (float64 for float64 inputs)."""

    def __init__(self, eps: float = POLY_NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((3,), 1 / 3))
        self.bias = nn.Parameter(torch.zeros(1))

    def normalized(self, u: torch.Tensor) -> torch.Tensor:
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = upcast(x)
        w = self.weight.to(z.dtype)
        out = w[0] * self.normalized(z**3) + w[1] * self.normalized(z**2) + w[2] * self.normalized(z)
        return (out + self.bias.to(z.dtype)).to(x.dtype)


def build_mlp(config: DiffConfig) -> LlamaMLP:
    """Llama's gated MLP, `down(act(gate x) * up x)`; with `hidden_act="poly_norm"` its activation is `PolyNorm`."""
    if config.hidden_act != POLY_NORM:
        return LlamaMLP(config)
    mlp = LlamaMLP(LlamaConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                               mlp_bias=config.mlp_bias, hidden_act="silu"))
    mlp.config, mlp.act_fn = config, PolyNorm()
    return mlp


class DiffLambda(nn.Module):
    """The re-parameterised lambda of one layer: four d-sized vectors shared by all heads."""

    def __init__(self, head_dim: int, lambda_init: float, std: float):
        super().__init__()
        self.lambda_init = lambda_init
        self.std = std
        self.q1 = nn.Parameter(torch.zeros(head_dim))
        self.k1 = nn.Parameter(torch.zeros(head_dim))
        self.q2 = nn.Parameter(torch.zeros(head_dim))
        self.k2 = nn.Parameter(torch.zeros(head_dim))
        self.frozen: torch.Tensor | None = None  # set only inside `frozen_lambdas`
        self.frozen_depth = 0  # how many `frozen_lambdas` blocks are open on this module

    def forward(self) -> torch.Tensor:
        if self.frozen is not None:
            return self.frozen
        return compute_lambda(self.q1, self.k1, self.q2, self.k2, self.lambda_init)

    def extra_repr(self) -> str:  # not lambda_init, which differs per layer: print(model) folds like Llama's
        return f"head_dim={self.q1.numel()}"


FREEZE_LOCK = threading.Lock()


@contextmanager
def frozen_lambdas(model: nn.Module) -> Iterator[None]:
    """Compute each layer's lambda once for the block instead of once per layer and forward.

    For `generate`, where the weights are fixed: a batch-1 CPU decode step is bound by per-op overhead, and lambda
    costs 6 ops per layer and step. Not a cache keyed on the parameters: in-place writes through `.data` (DeepSpeed,
    EMA code) leave no trace on them, so only a block that cannot change the weights may skip the recomputation.
    Blocks are counted, not stacked: inner or overlapping blocks (assisted generation; `generate` called from several
    threads) share the first block's values, and the last one to close releases them, whatever the order.
    """
    modules = [m for m in model.modules() if isinstance(m, DiffLambda)]
    with FREEZE_LOCK, torch.no_grad():
        for module in modules:
            if module.frozen_depth == 0:
                module.frozen = module()
            module.frozen_depth += 1
    try:
        yield
    finally:
        with FREEZE_LOCK:
            for module in modules:
                module.frozen_depth -= 1
                if module.frozen_depth == 0:
                    module.frozen = None


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
    k_proj rows likewise for the kv heads, v_proj h_kv heads of width dv."""

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
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, 2 * self.num_key_value_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, self.num_key_value_heads * dv, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * dv, hidden, bias=config.attention_out_bias)
        for proj in (self.q_proj, self.k_proj):
            setattr(proj, BRANCH_HALVES, True)  # tensor parallelism shards each branch's half (diff_tensor_parallel.py)
        lambda_init = config.layer_lambda_init(layer_idx)
        self.lambda_params = DiffLambda(d, lambda_init, config.lambda_std_dev)
        self.use_subln = config.use_subln
        self.subln = SubLN(dv, eps=config.subln_eps) if config.use_subln else nn.Identity()  # per head
        self.set_lambda_init(lambda_init)

    def set_lambda_init(self, value: float) -> None:
        """lambda_init enters lambda and, with SubLN, the output scale 1 - lambda_init."""
        self.lambda_params.lambda_init = value
        self.output_scale = 1.0 - value if self.use_subln else 1.0

    def project(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        """Project and rotate: q [B, 2h, T, d], k [B, h_kv, T, 2d] (k1 | k2 per kv head), v [B, h_kv, T, dv].

        Head counts come from the projections' outputs: under tensor parallelism a rank holds h / n heads."""
        batch, length, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)  # [B, 2h, T, d]
        k = self.k_proj(hidden_states).view(batch, length, -1, d).transpose(1, 2)  # [B, 2h_kv, T, d]
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k = k.view(batch, 2, -1, length, d).permute(0, 2, 3, 1, 4).reshape(batch, -1, length, 2 * d)
        v = self.v_proj(hidden_states).view(batch, length, -1, self.value_head_dim).transpose(1, 2)  # [B, h_kv, T, dv]
        return q, k, v

    def attend(self, hidden_states, q, k, v, attention_mask, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(1 - lambda_init) SubLN((A1 - lambda A2) V) per head, [B, T, h, dv] fp32, by `select_kernel`'s kernel."""
        kernel = DIFF_KERNELS[select_kernel(self.config._attn_implementation, q, k, v)]
        out, attn_map = kernel(self, q, k, v, self.lambda_params(), attention_mask, self.scaling, **kwargs)
        return (self.subln(out) * self.output_scale if self.use_subln else out), attn_map


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
        widen = config.value_head_dim // config.head_dim
        heads = LlamaConfig(
            hidden_size=config.hidden_size, head_dim=config.head_dim, attention_dropout=0.0,
            num_attention_heads=config.num_attention_heads * widen,
            num_key_value_heads=config.num_key_value_heads * widen, attention_bias=config.attention_bias,
        )
        super().__init__(heads, layer_idx)
        self.config = config
        self.o_proj = nn.Linear(self.o_proj.in_features, config.hidden_size, bias=config.attention_out_bias)

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


class DiffPreTrainedModel(LlamaPreTrainedModel):
    config: DiffConfig
    config_class = DiffConfig
    _no_split_modules = ["DiffDecoderLayer"]
    _can_record_outputs = {"hidden_states": DiffDecoderLayer, "attentions": list(ATTENTION_CLASSES)}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loading; a missing local folder fails at once (not after a minute of Hub retries), and a
        truncated or corrupt safetensors file is reported with its folder and the fix (safetensors' own message
        names neither)."""
        if pretrained_model_name_or_path is not None:
            check_local_path(pretrained_model_name_or_path)
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            raise OSError(
                f"the safetensors weights in {pretrained_model_name_or_path} are truncated or corrupt ({error}); "
                "download them again, or re-save the model with model.save_pretrained"
            ) from error

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' saving; the folder gets the defaults clients expect (`saved_folder_defaults`: cache on,
        generation within the context) and weights as readable as its other files (`match_weight_file_modes`)."""
        with saved_folder_defaults(self):
            result = super().save_pretrained(save_directory, *args, **kwargs)
        match_weight_file_modes(save_directory)
        return result

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

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args, **kwargs) -> str:
        if attn_implementation == DIFF_FLASH:
            ok, reason = triton_available()
            if not ok:
                raise ValueError(f"attn_implementation='{DIFF_FLASH}' is unavailable: {reason}")
            return attn_implementation
        try:
            return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)
        except ValueError as error:  # transformers' list of its backends, which lacks ours
            if "not supported" not in str(error) or DIFF_FLASH in str(error):
                raise
            raise ValueError(f"{error} The DIFF Transformer adds `attn_implementation=\"{DIFF_FLASH}\"` (its fused "
                             "Triton kernel).") from None


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Out-of-range ids otherwise crash inside the embedding with an opaque index error (or a CUDA assert).

    The check reads the ids' range on the host, a device sync off the CPU; a one-token step on an accelerator (a
    decode step, whose token the model itself chose) skips it, so GPU decoding runs without host syncs.
    """
    if is_torchdynamo_compiling() or input_ids.numel() == 0:
        return
    if input_ids.device.type != "cpu" and input_ids.shape[-1] == 1:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"input_ids must lie in [0, {vocab_size}) (the input embedding's rows) but range over [{low}, {high}]; "
            "check the tokenizer matches the model or resize the embeddings with model.resize_token_embeddings"
        )


def embedding_rows(embedding: nn.Module) -> int:
    """The rows of an input embedding, also one an adapter wraps (peft's trainable tokens, LoRA on embeddings)."""
    return (embedding.get_base_layer() if hasattr(embedding, "get_base_layer") else embedding).num_embeddings


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
        self.layers = nn.ModuleList([DiffDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
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


class DiffForCausalLM(DiffPreTrainedModel, LlamaForCausalLM, GenerationMixin):  # named, as transformers' own
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
        """`GenerationMixin.generate`, with each layer's lambda computed once per call (`frozen_lambdas`)."""
        with frozen_lambdas(self):
            return super().generate(*args, **kwargs)

    @torch.no_grad()
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        """transformers' continuous batching manager (behind `generate_batch` and `transformers serve
        --continuous-batching`), with its paged cache laid out for DIFF layers (`paged_cache.py`); a backend the
        layers cannot run under batching is refused here, before any request."""
        continuous_batching_config = check_continuous_batching(self.config, continuous_batching_config)
        manager = super().init_continuous_batching(generation_config, continuous_batching_config, workload_hints)
        return with_paged_cache_view(self, manager)


class DiffTaskHead:
    """Base of the task heads, before transformers' generic head (`GenericFor...`), which builds the backbone with
    `AutoModel.from_config(config)`: AutoModel finds DiffModel by the config's class. A folder loaded with
    trust_remote_code=True imports configuration_diff.py twice (alone for AutoConfig, beside this file for the model
    code), so `config` may be of a DiffConfig class no Auto class knows, and the package may not be imported at all;
    the head registers it for DiffModel first."""

    def __init__(self, config: DiffConfig):
        AutoModel.register(type(config), DiffModel, exist_ok=True)
        super().__init__(config)


class DiffForSequenceClassification(DiffTaskHead, GenericForSequenceClassification, DiffPreTrainedModel): ...


class DiffForTokenClassification(DiffTaskHead, GenericForTokenClassification, DiffPreTrainedModel): ...


class DiffForQuestionAnswering(DiffTaskHead, GenericForQuestionAnswering, DiffPreTrainedModel): ...


def differential_layers(model: nn.Module) -> list[DiffAttention]:
    """The V1 differential attention modules of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, DiffAttention)]


@contextmanager
def capture_branch_attentions(model: nn.Module) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Collect (A1 [B, h, T, S], A2, lambda) of every differential layer, in layer order, during forwards of `model`
    inside the block. Only `eager` materialises the maps.

    The maps are released when the caller drops the yielded list; nothing is held between calls otherwise.
    """
    if differential_layers(model) and model.config._attn_implementation != "eager":
        raise ValueError(
            f"capture_branch_attentions needs the eager attention maps, but the model runs "
            f"'{model.config._attn_implementation}': load it with attn_implementation=\"eager\" or call "
            "model.set_attn_implementation(\"eager\") first"
        )
    maps: list = []
    token = BRANCH_MAPS.set(maps)
    try:
        yield maps
    finally:
        BRANCH_MAPS.reset(token)


def diff_flash_standard_attention(module: nn.Module, *args, **kwargs):
    """What `diff_flash` runs in layers without V1 differential attention (DIFF V2, standard layers of a hybrid
    stack): sdpa. Registered under our name so that transformers accepts `attn_implementation="diff_flash"`; any
    other model that asks for it gets this error instead of a silent substitute."""
    if not isinstance(module, ATTENTION_CLASSES):
        raise ValueError(
            f"attn_implementation='{DIFF_FLASH}' is the Differential Transformer's fused kernel and has no "
            f"meaning for {type(module).__name__}; use 'sdpa', 'eager' or another transformers backend"
        )
    return sdpa_attention_forward(module, *args, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(DIFF_FLASH, diff_flash_standard_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DIFF_FLASH, sdpa_mask)

__all__ = [
    "DiffPreTrainedModel",
    "DiffModel",
    "DiffForCausalLM",
    "DiffForSequenceClassification",
    "DiffForTokenClassification",
    "DiffForQuestionAnswering",
    "capture_branch_attentions",
]
