"""Head widths of the vLLM mapping of a DIFF Transformer (arXiv 2410.05258) config, and the checks that refuse what
would serve wrong tokens. Needs no vLLM, so `diff-transformer serve` checks a folder before it starts a server."""

# The head sizes vLLM 0.32's CPU attention (CPU_ATTN) computes; it takes no other and ignores `head_size_v`.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# What was verified (tests/vllm): one process. Tensor and pipeline parallelism are refused until tested.
VERIFIED_TP_SIZES = (1,)


def natural_widths(config) -> dict[str, int]:
    """Per layer kind, the width of the paged attention heads before any padding for the kernel:
    V1 max(2d, dv) (packed keys (k1 | k2) and v in one head size), V2 d, standard d, or 2d where dv = d in a hybrid
    stack with V1 layers, so that both kinds store the same bytes per token (vLLM pages all layers alike)."""
    d, dv = config.head_dim, config.value_head_dim
    if config.diff_version == 2:
        return {"differential": d, "standard": d}
    differential = max(2 * d, dv)
    has_v1 = "differential" in config.attention_types
    return {"differential": differential, "standard": differential * d // dv if has_v1 else d}


def kernel_width(width: int, head_sizes: tuple[int, ...] | None) -> int:
    """The smallest head size the attention kernel takes that holds `width` (zero columns are exact padding)."""
    if head_sizes is None:
        return width
    fits = [size for size in head_sizes if size >= width]
    if not fits:
        raise ValueError(f"heads {width} wide exceed the largest head size of vLLM's CPU attention "
                         f"({max(head_sizes)}); serve this model on a GPU")
    return min(fits)


def layer_widths(config, head_sizes: tuple[int, ...] | None = None) -> dict[str, int]:
    """Per layer kind, the head width of its `Attention` call, padded up to a size the kernel takes."""
    return {kind: kernel_width(width, head_sizes) for kind, width in natural_widths(config).items()}


def kv_bytes_per_token(config, widths: dict[str, int]) -> dict[str, int]:
    """Per layer kind present in the stack, K and V elements cached per token (vLLM needs them equal)."""
    widen = config.value_head_dim // config.head_dim if config.diff_version == 1 else 1
    heads = {"differential": config.num_key_value_heads, "standard": config.num_key_value_heads * widen}
    return {kind: 2 * heads[kind] * widths[kind] for kind in set(config.attention_types)}


def check_servable(config, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                   cpu: bool = True) -> dict[str, int]:
    """Raise a one-line `ValueError` naming the fix for a config this mapping would serve wrongly or untested;
    return the head widths per layer kind."""
    if getattr(config, "model_type", None) != "diff_transformer":
        raise ValueError(f"not a DIFF Transformer config (model_type {getattr(config, 'model_type', None)!r}); "
                         "serve it with plain vLLM")
    if tensor_parallel_size not in VERIFIED_TP_SIZES or pipeline_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}, pipeline_parallel_size="
                         f"{pipeline_parallel_size}: only one process is verified for DIFF models under vLLM "
                         "(docs/serving.md); serve with tensor_parallel_size=1 and pipeline_parallel_size=1")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: vLLM's Llama MLP computes silu only")
    widths = layer_widths(config, CPU_HEAD_SIZES if cpu else None)
    sizes = kv_bytes_per_token(config, widths)
    if len(set(sizes.values())) > 1:
        raise ValueError(f"this hybrid stack caches {sizes} K/V values per token per layer kind, and vLLM pages "
                         "every layer alike; serve it on a GPU or use head_dim >= 32 with value_head_dim = 2 head_dim")
    return widths
