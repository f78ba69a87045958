"""Differential Transformer (arXiv 2410.05258) layers on transformers' paged cache, the cache of its continuous
batching (`model.generate_batch`, `model.init_continuous_batching`, `transformers serve --continuous-batching`).

The paged cache stores, per token and layer, keys and values of ONE shape [num_key_value_heads, head_dim], read from
the model config and the same for every layer. DIFF layers cache other shapes: a V1 layer packed keys (k1 | k2)
[h_kv, 2d] and values [h_kv, dv], a standard layer of a hybrid stack [h_kv dv / d, d], a V2 layer [h_kv, d]. The
cache is therefore built with `paged_cache_heads(config)` heads of d per token (the widest layer's keys or values),
and each layer writes its keys and values as such rows, zero-padded where narrower, and reads them back in its own
shape (`paged_update`). The attention itself then runs on the gathered keys and values, as on any other cache, under
transformers' packed-batch mask.

Continuous batching runs the DIFF kernels of `sdpa` and `eager` (`paged|eager`); other backends are refused by
`check_continuous_batching` before the manager accepts a request.
"""

import copy
import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import ContinuousBatchingConfig, PreTrainedConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.models.llama.modeling_llama import LlamaAttention

from .config_checks import unvalidated_copy

PAGED_EAGER = "paged|eager"  # transformers' eager backend on the paged cache; the DIFF layers run their eager kernels
BATCHING_BACKENDS = ("sdpa", "eager", PAGED_EAGER)  # the backends whose DIFF kernels read a packed batch's mask
# Whether this transformers release hands the cache its forward kwargs (read and write indices) in `update`, the
# protocol these layers follow; older releases update the cache inside their paged attention functions instead.
UPDATE_TAKES_KWARGS = "kwargs" in inspect.signature(PagedAttentionCache.update).parameters
# Whether Llama's attention (the standard layers of hybrid stacks) takes the cache as `cache` and updates it with
# its kwargs; where it does not, transformers' paged|eager function updates the cache itself, from a kwarg these
# layers do not receive.
LLAMA_TAKES_CACHE = "cache" in inspect.signature(LlamaAttention.forward).parameters


def is_paged(cache: object) -> bool:
    return isinstance(cache, PagedAttentionCache)


def paged_cache_heads(config: PreTrainedConfig) -> int:
    """d-wide heads per token and layer of the paged cache: enough for every layer's keys and values
    (`DiffConfig.layer_cache`)."""
    return -(-config.widest_cached_row() // config.head_dim)


def to_rows(x: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """[B, H, T, w] -> [B, heads, T, d]: each token's H w elements as `heads` rows of d, zero-padded."""
    batch, _, length, _ = x.shape
    flat = x.transpose(1, 2).reshape(batch, length, -1)  # [B, T, H w]
    flat = F.pad(flat, (0, heads * d - flat.shape[-1]))  # [B, T, heads d]
    return flat.view(batch, length, heads, d).transpose(1, 2)


def from_rows(x: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """[B, rows, S, d] -> [B, heads, S, width]: the first heads * width elements of each token's rows."""
    batch, _, length, _ = x.shape
    flat = x.transpose(1, 2).reshape(batch, length, -1)[..., : heads * width]  # [B, S, heads width]
    return flat.view(batch, length, heads, width).transpose(1, 2)


def paged_update(cache: PagedAttentionCache, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                 config: PreTrainedConfig, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a layer's keys k [1, H_k, T, w_k] and values v [1, H_v, T, w_v] to the paged cache and return all the
    batch's keys and values in the same layout ([1, H_k, S, w_k], [1, H_v, S, w_v]). `kwargs` are the forward's:
    the cache reads its indices there and leaves what the attention needs (transformers' protocol)."""
    heads, d = paged_cache_heads(config), config.head_dim
    if k.shape[1] == v.shape[1] == heads and k.shape[-1] == v.shape[-1] == d:
        return cache.update(k, v, layer_idx, kwargs=kwargs)
    keys, values = cache.update(to_rows(k, heads, d), to_rows(v, heads, d), layer_idx, kwargs=kwargs)
    return from_rows(keys, k.shape[1], k.shape[-1]), from_rows(values, v.shape[1], v.shape[-1])


class PagedLayerCache:
    """The paged cache as transformers' Llama attention (a hybrid stack's standard layers) calls it, with
    `paged_update` mapping that layer's keys and values to the cache's rows. `kwargs` are the layer's forward
    kwargs, for releases whose Llama attention does not pass its own to `update`."""

    def __init__(self, cache: PagedAttentionCache, config: PreTrainedConfig, kwargs: dict):
        self.cache, self.config, self.kwargs = cache, config, kwargs

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, kwargs: dict | None = None):
        return paged_update(self.cache, k, v, layer_idx, self.config, self.kwargs if kwargs is None else kwargs)


def check_continuous_batching(config: PreTrainedConfig, batching_config=None):
    """Refuse what DIFF layers cannot run under continuous batching, before the manager accepts a request (the
    manager would otherwise fail every request inside its thread and return empty outputs). Returns the batching
    config to use: the caller's (or a default one) with `auto_switch_to_flash` off, since the flash kernels read the
    paged cache in its own shape."""
    if not UPDATE_TAKES_KWARGS:
        raise NotImplementedError(
            "continuous batching of DIFF models needs a transformers release whose paged cache takes the forward's "
            "kwargs in `update`; upgrade transformers, or generate with `model.generate`"
        )
    backend = config._attn_implementation
    if backend not in BATCHING_BACKENDS:
        raise ValueError(
            f"continuous batching runs DIFF layers with attn_implementation 'sdpa' or '{PAGED_EAGER}', not "
            f"'{backend}'; load the model with attn_implementation=\"sdpa\" or call "
            "model.set_attn_implementation(\"sdpa\") first (plain `generate` runs every backend)"
        )
    if backend == PAGED_EAGER and "standard" in config.attention_types and not LLAMA_TAKES_CACHE:
        raise ValueError(
            f"the standard layers of this hybrid stack cannot run '{PAGED_EAGER}' under this transformers release's "
            "continuous batching; load the model with attn_implementation=\"sdpa\", or upgrade transformers"
        )
    batching_config = copy.copy(batching_config) if batching_config is not None else ContinuousBatchingConfig()
    batching_config.auto_switch_to_flash = False
    return batching_config


@contextmanager
def paged_cache_view(model) -> Iterator[None]:
    """While the batching manager builds its cache: `model.config` is a copy whose `num_key_value_heads` is
    `paged_cache_heads` (the paged cache reads its row shape there). The model's own config is left untouched."""
    config = model.config
    model.config = unvalidated_copy(config, num_key_value_heads=paged_cache_heads(config))
    try:
        yield
    finally:
        model.config = config


def with_paged_cache_view(model, manager):
    """`manager` (transformers' batching manager), building its cache and batch processor under
    `paged_cache_view` whenever it does (warm-up, start, restart)."""
    create = manager._create_batch_processor
    if getattr(create, "paged_cache_view", False):  # a cached manager, already set up
        return manager

    @functools.wraps(create)
    def create_batch_processor():
        with paged_cache_view(model):
            return create()

    create_batch_processor.paged_cache_view = True
    manager._create_batch_processor = create_batch_processor
    return manager


class ContinuousBatchingMixin:
    """A causal LM's `init_continuous_batching`, the manager behind `generate_batch` and `transformers serve
    --continuous-batching`, with its paged cache laid out for DIFF layers; a backend the layers cannot run under
    batching is refused here, before any request."""

    @torch.no_grad()
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        continuous_batching_config = check_continuous_batching(self.config, continuous_batching_config)
        if continuous_batching_config.num_blocks is None and workload_hints is not None:
            continuous_batching_config.num_blocks = workload_blocks(
                workload_hints, continuous_batching_config.page_size, self.config.max_position_embeddings)
        manager = super().init_continuous_batching(generation_config, continuous_batching_config, workload_hints)
        return with_paged_cache_view(self, manager)


def workload_blocks(hints, page_size: int, context: int) -> int | None:
    """Cache blocks (`page_size` tokens each) enough for every request of a known workload (`generate_batch`'s
    hints: its prompts, their number and max_new_tokens) to be resident at once: each needs its prompt and new tokens,
    at most the context, where no max_new_tokens is known. None (transformers sizes the cache from the free memory:
    on a CPU most of the RAM, 12 GB for a 3M-parameter model) where the hints tell nothing."""
    requests, prompt = getattr(hints, "num_requests", 0), getattr(hints, "max_prompt_length", 0)
    generated = getattr(hints, "max_generated_length", 0)
    if requests <= 0 or prompt <= 0:
        return None
    tokens = min(prompt + generated, context) if generated > 0 else context
    return requests * -(-tokens // page_size)


__all__ = ["ContinuousBatchingMixin", "check_continuous_batching", "paged_update", "PagedLayerCache",
           "with_paged_cache_view", "workload_blocks"]
