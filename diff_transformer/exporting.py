"""Exporting the Differential Transformer (arXiv 2410.05258) for ExecuTorch with transformers' own recipe.

`torch.export` and `torch.onnx.export(dynamo=True)` need nothing from this module (README, "Exporting"). transformers'
ExecuTorch recipe (`TorchExportableModuleForDecoderOnlyLM`) allocates its static cache from the config as
num_key_value_heads x head_dim for keys and values, a shape that cannot hold a differential layer's packed keys
(2 head_dim wide); `executorch_module` re-allocates that cache with the model's shapes (`cache_shapes`) and leaves
the rest of the recipe (its forward, `export`, buffers and `generate`) as transformers wrote it.
"""

import torch
from transformers import GenerationConfig
from transformers.cache_utils import StaticLayer
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

from .modeling_diff import DiffForCausalLM, cache_shapes


def executorch_module(
    model: DiffForCausalLM, batch_size: int = 1, max_cache_len: int | None = None
) -> TorchExportableModuleForDecoderOnlyLM:
    """transformers' ExecuTorch recipe for `model`, with a static cache of `max_cache_len` tokens (default: the
    model's context) in the model's cache shapes. Sets `model.generation_config` to a static, cached one."""
    shapes = cache_shapes(model.config)
    if shapes is None:
        raise ValueError(
            "the ExecuTorch recipe needs keys and values of equal width in every layer; this model's V1 layers have "
            f"value_head_dim={model.config.value_head_dim} != 2 * head_dim={2 * model.config.head_dim}"
        )
    max_cache_len = max_cache_len or model.config.max_position_embeddings
    model.config.use_cache = True  # checked by the recipe under transformers < 5.24
    model.generation_config = GenerationConfig.from_dict(
        {**model.generation_config.to_dict(), "use_cache": True, "cache_implementation": "static",
         "cache_config": {"batch_size": batch_size, "max_cache_len": max_cache_len}}
    )
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch_size, max_cache_len=max_cache_len)
    reallocate_static_cache(recipe.model, batch_size, shapes, model.dtype, model.device)
    return recipe


def reallocate_static_cache(wrapper: torch.nn.Module, batch_size: int, shapes, dtype, device) -> None:
    """Replace each layer of the recipe's early-initialised static cache by one of the model's shape, and register
    its tensors under the buffer names the recipe exports (`key_cache_{i}`, `value_cache_{i}`, ...)."""
    for i, (heads, width) in enumerate(zip(*shapes)):
        layer = StaticLayer(wrapper.static_cache.layers[i].max_cache_len)
        layer.lazy_initialization(*[torch.zeros(batch_size, heads, 0, width, dtype=dtype, device=device)] * 2)
        wrapper.static_cache.layers[i] = layer
        wrapper.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        wrapper.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
        wrapper.register_buffer(f"cumulative_length_{i}", layer.cumulative_length, persistent=False)


__all__ = ["executorch_module"]
