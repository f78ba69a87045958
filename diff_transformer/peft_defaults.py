"""PEFT support for `model_type="diff_transformer"`: default targets, so `LoraConfig()` works without
`target_modules`, and prefix tuning's virtual-token cache in the shapes DIFF layers cache.

LoRA targets every attention and MLP projection. Other PEFT methods reuse their Llama defaults, since the
module names follow Llama. No default adapts the differential parameters (V1's lambda vectors and SubLN gain, which
are not Linear layers, and V2's per-token lambda projection): train them with any method through
`modules_to_save=DIFF_TRAINABLE_MODULES`.

Prefix tuning (and CARTRIDGE, which shares its cache) gives every layer `num_virtual_tokens` cached keys and values.
peft sizes them as `num_key_value_heads` heads of `head_dim`, which is a DIFF V2 layer's cache but not a V1 layer's
(packed keys k1 | k2, 2d wide, and values `value_head_dim` wide) nor a hybrid stack's standard layer's
(h_kv dv / d heads of d). So for this model type peft provisions `num_key_value_heads` heads of
`prefix_head_width(config)` (the widest per-kv-head key or value of any layer), and each layer's share of the prefix
takes that layer's shape on its first cache update (`PrefixCache`).

peft looks all of this up by `model.config.model_type` in its module-level tables and consults nothing on the
model itself, so `modeling_diff.py` registers them when it is imported. That covers the package, a folder loaded with
`trust_remote_code=True` (this file ships beside the model code) and tools that never import the package.
"""

import functools

import torch
from transformers.cache_utils import DynamicCache

from .configuration_diff import DiffConfig

try:
    import peft.peft_model as peft_model
    from peft.utils import constants
except ImportError:  # peft is optional: without it there is nothing to register
    constants = peft_model = None

LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DIFF_TRAINABLE_MODULES = ["lambda_params", "subln", "lambda_proj"]  # V1 lambda and SubLN; V2's lambda projection
PREFIX_TYPES = ("PREFIX_TUNING", "CARTRIDGE")  # the methods that hand the model a virtual-token cache


def target_module_mappings() -> dict[str, dict]:
    """peft's per-method `TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING` dictionaries, by name."""
    if constants is None:
        return {}
    return {
        name: mapping
        for name, mapping in vars(constants).items()
        if name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MODULES_MAPPING")
        and isinstance(mapping, dict)
    }


def prefix_head_width(config: DiffConfig) -> int:
    """Per kv head, the widest key or value any layer caches (`DiffConfig.layer_cache`): 2d packed keys (and dv
    values) in a V1 layer, d in a V2 layer, dv in a standard layer of a hybrid stack (its h_kv dv / d heads of d,
    grouped by kv head)."""
    return config.widest_cached_row() // config.num_key_value_heads


def fit_prefix(prefix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """One layer's prefix keys (or values) [B, H, N, D] as provisioned, in the shape of the states the layer caches,
    `like` [B, H', T, D'] with H' = g H and g D' <= D: each provisioned head splits into g heads of D'."""
    batch, heads, length, width = prefix.shape
    new_heads, new_width = like.shape[1], like.shape[-1]
    if (heads, width) == (new_heads, new_width):
        return prefix
    group = new_heads // heads
    if new_heads % heads or group * new_width > width:
        raise ValueError(
            f"the prefix-tuning cache holds {heads} heads of {width} per layer, which cannot feed a layer caching "
            f"{new_heads} heads of {new_width}: prefix tuning needs every kv head of a layer in one process (not a "
            "tensor-parallel shard)"
        )
    prefix = prefix[..., : group * new_width].reshape(batch, heads, length, group, new_width)
    return prefix.transpose(2, 3).reshape(batch, new_heads, length, new_width)  # [B, H', N, D']


class PrefixCache(DynamicCache):
    """A `DynamicCache` holding peft's virtual-token prefix: `num_key_value_heads` heads of `prefix_head_width` per
    layer, until the layer's first update gives them the shape of the keys and values it caches (`fit_prefix`)."""

    def __init__(self, layer_prefixes: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(layer_prefixes)
        self.unfitted = set(range(len(layer_prefixes)))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx in getattr(self, "unfitted", ()):  # absent while DynamicCache.__init__ fills the layers
            layer = self.layers[layer_idx]
            layer.keys, layer.values = fit_prefix(layer.keys, key_states), fit_prefix(layer.values, value_states)
            self.unfitted.discard(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def prefix_cache(past_key_values: tuple[torch.Tensor, ...]) -> PrefixCache:
    """peft's prefix post-processing hook: per layer [2, B, h_kv, N, D] (keys, values) -> a `PrefixCache`."""
    return PrefixCache([(layer[0], layer[1]) for layer in past_key_values])


def with_prefix_geometry(prepare):
    """Wrap peft's `_prepare_prompt_learning_config`, which sizes a prefix as `num_key_value_heads` x `head_dim`,
    so that for DIFF configs it provisions `num_key_value_heads` x `prefix_head_width`."""
    if getattr(prepare, "diff_prefix_geometry", False):
        return prepare

    @functools.wraps(prepare)
    def prepare_prompt_learning_config(peft_config, model_config):
        derived_encoder = getattr(peft_config, "encoder_hidden_size", None) is None
        peft_config = prepare(peft_config, model_config)
        if getattr(model_config, "model_type", None) == DiffConfig.model_type and peft_config.peft_type in PREFIX_TYPES:
            heads = model_config.num_key_value_heads
            peft_config.num_attention_heads = heads
            peft_config.token_dim = heads * prefix_head_width(model_config)
            if derived_encoder:  # peft's default: as wide as the prefix
                peft_config.encoder_hidden_size = peft_config.token_dim
        return peft_config

    prepare_prompt_learning_config.diff_prefix_geometry = True
    return prepare_prompt_learning_config


def with_prefix_handover(prepare):
    """Wrap `PeftModelForCausalLM.prepare_inputs_for_generation`, which injects the prefix as `past_key_values`:
    where transformers names the generation cache `cache` (5.2x), the model would take that (empty) cache and ignore
    the prefix. For DIFF models the prefix becomes the generation cache at the first step and is dropped after."""
    if getattr(prepare, "diff_prefix_handover", False):
        return prepare

    @functools.wraps(prepare)
    def prepare_inputs_for_generation(self, *args, **kwargs):
        model_kwargs = prepare(self, *args, **kwargs)
        if getattr(self.config, "model_type", None) == DiffConfig.model_type and model_kwargs.get("cache") is not None:
            prefix = model_kwargs.pop("past_key_values", None)
            if prefix is not None and not model_kwargs["cache"].get_seq_length():
                model_kwargs["cache"] = prefix
        return model_kwargs

    prepare_inputs_for_generation.diff_prefix_handover = True
    return prepare_inputs_for_generation


def register_peft_defaults(model_type: str = DiffConfig.model_type) -> None:
    """Put the defaults in peft's tables (a no-op without peft; registering twice changes nothing)."""
    for name, mapping in target_module_mappings().items():
        if name == "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING":
            mapping[model_type] = list(LORA_TARGET_MODULES)
        elif "llama" in mapping:
            mapping.setdefault(model_type, mapping["llama"])
    if constants is not None and hasattr(peft_model, "_prepare_prompt_learning_config"):
        constants.TRANSFORMERS_MODELS_TO_PREFIX_TUNING_POSTPROCESS_MAPPING.setdefault(model_type, prefix_cache)
        peft_model._prepare_prompt_learning_config = with_prefix_geometry(peft_model._prepare_prompt_learning_config)
        causal_lm = peft_model.PeftModelForCausalLM
        causal_lm.prepare_inputs_for_generation = with_prefix_handover(causal_lm.prepare_inputs_for_generation)


__all__ = ["LORA_TARGET_MODULES", "DIFF_TRAINABLE_MODULES", "PrefixCache", "register_peft_defaults"]
