"""Checks of a Differential Transformer's (arXiv 2410.05258) forward arguments that turn silent failures into errors:
the cache passed under a name the layers ignore, and token ids outside the input embedding."""

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import LlamaModel
from transformers.utils import is_torchdynamo_compiling

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
