"""Head widths of the vLLM mapping of a DIFF Transformer (arXiv 2410.05258) config, and the checks that refuse what
would serve wrong tokens. Needs no vLLM, so `diff-transformer serve` checks a folder before it starts a server."""

from ..configuration_diff import rope_parameter_sets, unsupported_fields
from ..saved_folder import check_model_type

# The head sizes vLLM 0.32's CPU attention (CPU_ATTN) computes; it takes no other and ignores `head_size_v`.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# What was verified (tests/vllm_serving, vLLM's CPU build, one process per rank): tensor parallelism over 2 ranks
# and pipeline parallelism over 2 stages, each alone; other sizes and both at once are refused until tested.
VERIFIED_TP_SIZES = (1, 2)
VERIFIED_PP_SIZES = (1, 2)
# vLLM 0.32's CUDA attention backends in its order of preference (platforms/cuda.py, below SM100), and the head
# widths and dtypes each declares it takes (`supports_head_size`, `supported_dtypes` in v1/attention/backends/).
# FlashAttention 4 (Blackwell) also takes widths up to 512; FlashInfer needs its package, Hopper+ for some paths.
GPU_BACKENDS = {
    "FLASH_ATTN": (lambda width: width % 8 == 0 and width <= 256, ("float16", "bfloat16")),
    "FLASHINFER": (lambda width: width in (64, 128, 256, 512), ("float16", "bfloat16")),
    "TRITON_ATTN": (lambda width: width >= 32, ("float16", "bfloat16", "float32")),
    "FLEX_ATTENTION": (lambda width: True, ("float16", "bfloat16", "float32")),
}
# parameter-name endings of quantized checkpoints (GPTQ / AWQ, bitsandbytes, compressed-tensors / FP8)
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".absmax", ".quant_map", ".quant_state",
                      ".nested_absmax", ".weight_scale", ".weight_scale_inv", ".input_scale", ".weight_zero_point",
                      ".weight_packed", ".weight_shape", ".SCB", ".weight_format")
QUANTIZED_ADVICE = ("the DIFF vLLM model serves unquantized weights only (its differential attention has no "
                    "quantized kernel here): serve the unquantized folder (fp32 / bf16 / fp16), or dequantize and "
                    "save_pretrained it again")
MERGE_ADVICE = ("vLLM's LoRA cannot apply the modules_to_save (lambda_params, subln) that the package's PEFT defaults "
                "train: merge the adapter first, PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()"
                ".save_pretrained(FOLDER) (and the tokenizer), then serve FOLDER (docs/serving.md)")


def natural_widths(config) -> dict[str, int]:
    """Per layer kind, the width of the paged attention heads before any padding for the kernel:
    V1 max(2d, dv) (packed keys (k1 | k2) and v in one head size), V2 d, standard d, or, in a hybrid
    stack with V1 layers, the width that stores the same bytes per token as a V1 layer (vLLM pages all layers
    alike). What each layer caches is `config.layer_cache`."""
    differential, standard = config.layer_cache("differential"), config.layer_cache("standard")
    width = max(differential.key_dim, differential.value_dim)
    if config.diff_version == 2:
        return {"differential": width, "standard": width}
    has_v1 = "differential" in config.attention_types
    return {"differential": width,
            "standard": differential.kv_heads * width // standard.kv_heads if has_v1 else standard.key_dim}


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
    return {kind: 2 * config.layer_cache(kind).kv_heads * widths[kind] for kind in set(config.attention_types)}


def unimplemented_fields(fields: dict) -> list[str]:
    """The config.json fields (`fields`: the file's dict) that vLLM would apply other than transformers' DIFF model,
    so that vLLM would answer with other tokens, without an error: those the model does not implement
    (`unsupported_fields`: a sliding window, which vLLM masks and the model does not; a RoPE `partial_rotary_factor`
    below 1, which vLLM applies and the model does not) and `longrope` (see below)."""
    found = [field.split(" (")[0] for field in unsupported_fields(fields)]
    # longrope: vLLM switches a whole batch to the long factors when any request in it is past the original context
    # (a short prompt batched with a long one gets other tokens); transformers decides per sequence
    found += [f"{where}rope_type=longrope" for where, params in rope_parameter_sets(fields)
              if params.get("rope_type", params.get("type")) == "longrope"]
    return found


def check_fields(fields: dict) -> None:
    """Refuse a config.json (as a dict) whose fields vLLM would serve differently from transformers' DIFF model,
    or that holds quantized weights."""
    if found := unimplemented_fields(fields):
        raise ValueError(f"config.json sets {', '.join(found)}, which vLLM would apply and transformers' DIFF model "
                         "does not implement (vLLM's tokens would differ from the model's); remove the field(s) "
                         "from config.json, or train and serve the model without them")
    if quantization := fields.get("quantization_config"):
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ValueError(f"config.json has a quantization_config ({method}): {QUANTIZED_ADVICE}")


def gpu_widths(config) -> dict[str, int]:
    """Per layer kind present in the stack, the head width on a GPU (no padding: the CPU kernel's sizes do not
    apply)."""
    return {kind: width for kind, width in natural_widths(config).items() if kind in config.attention_types}


def gpu_backends(widths: dict[str, int], dtype: str) -> list[str]:
    """vLLM's CUDA attention backends (GPU_BACKENDS, preferred first) that take every head width in `widths` in
    `dtype` ("float16", "bfloat16", "float32")."""
    return [name for name, (takes, dtypes) in GPU_BACKENDS.items()
            if dtype in dtypes and all(takes(width) for width in widths.values())]


def gpu_backend_note(widths: dict[str, int], dtype: str, selected: str | None = None) -> str | None:
    """None when vLLM's first choice, FlashAttention, runs these heads (or the backend `selected` takes them);
    otherwise one line saying which backend vLLM will pick instead. Raises `ValueError` when `selected` (vLLM's
    --attention-backend) cannot run them."""
    fits = gpu_backends(widths, dtype)
    shown = ", ".join(f"{kind} {width}" for kind, width in sorted(widths.items()))
    if selected is not None:
        if selected.upper() in GPU_BACKENDS and selected.upper() not in fits:
            raise ValueError(f"--attention-backend {selected} cannot run this model's heads ({shown} wide, {dtype}); "
                             f"backends that can: {', '.join(fits)}")
        return None
    if fits[0] == "FLASH_ATTN":
        return None
    return (f"heads {shown} wide in {dtype}: vLLM's FlashAttention takes widths divisible by 8 up to 256 in "
            f"float16 / bfloat16 only, so vLLM will run {fits[0]} (slower; pass --attention-backend to choose "
            f"among {', '.join(fits)}); head_dim 16-128 with bf16 keeps FlashAttention")


def check_parallelism(config, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Refuse parallel sizes not verified (`VERIFIED_TP_SIZES`, `VERIFIED_PP_SIZES`, not both above 1), and a
    tensor-parallel size that does not divide the kv heads (each rank holds whole kv heads with their query heads;
    vLLM's replication of kv heads over more ranks is not written for differential layers)."""
    sizes = f"tensor_parallel_size={tensor_parallel_size}, pipeline_parallel_size={pipeline_parallel_size}"
    if (tensor_parallel_size not in VERIFIED_TP_SIZES or pipeline_parallel_size not in VERIFIED_PP_SIZES
            or min(tensor_parallel_size, pipeline_parallel_size) > 1):
        tp, pp = (" or ".join(map(str, verified)) for verified in (VERIFIED_TP_SIZES, VERIFIED_PP_SIZES))
        raise ValueError(f"{sizes}: DIFF models under vLLM are verified with tensor_parallel_size {tp}, or "
                         f"pipeline_parallel_size {pp}, not both above 1 (docs/serving.md); serve with one of those")
    if config.num_key_value_heads % tensor_parallel_size:
        raise ValueError(f"{sizes}: tensor parallelism needs num_key_value_heads ({config.num_key_value_heads}) "
                         "divisible by tensor_parallel_size, each rank holding whole kv heads; serve with a "
                         f"tensor_parallel_size that divides {config.num_key_value_heads}")


def check_pipeline_mode(pipeline_parallel_size: int, enforce_eager: bool, cpu: bool) -> None:
    """Refuse pipeline parallelism in eager mode on vLLM's CPU build: vLLM 0.32's CPU runner allocates a later
    stage's input buffers only while warming up the compiled model, so its first step fails (a Llama too)."""
    if cpu and enforce_eager and pipeline_parallel_size > 1:
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} with enforce_eager on vLLM's CPU build: "
                         "vLLM 0.32 fails there on its first step (its CPU runner sets up a later stage's inputs only "
                         "when compiling); drop --enforce-eager / enforce_eager=True")


def check_servable(config, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                   cpu: bool = True) -> dict[str, int]:
    """Raise a one-line `ValueError` naming the fix for a config this mapping would serve wrongly or untested;
    return the head widths per layer kind."""
    check_model_type({"model_type": getattr(config, "model_type", None)}, getattr(config, "name_or_path", "") or
                     "this config")
    check_fields(config.to_dict())
    check_parallelism(config, tensor_parallel_size, pipeline_parallel_size)
    if config.hidden_act not in ("silu", "poly_norm"):
        raise ValueError(f"hidden_act={config.hidden_act!r}: the DIFF vLLM model computes silu and poly_norm MLPs "
                         "only")
    widths = layer_widths(config, CPU_HEAD_SIZES if cpu else None)
    sizes = kv_bytes_per_token(config, widths)
    if len(set(sizes.values())) > 1:
        raise ValueError(f"this hybrid stack caches {sizes} K/V values per token per layer kind, and vLLM pages "
                         "every layer alike; serve it on a GPU or use head_dim >= 32 with value_head_dim = 2 head_dim")
    return widths


def unexpected_weight(name: str) -> ValueError:
    """The error for a checkpoint weight the served model has no parameter for, with the advice that fits its kind:
    quantized, a PEFT adapter's, or weights that do not fit config.json."""
    if name.endswith(QUANTIZED_SUFFIXES):
        advice = f"it looks quantized: {QUANTIZED_ADVICE}"
    elif "lora_" in name or name.startswith("base_model.model."):
        advice = f"it is a PEFT adapter weight: {MERGE_ADVICE}"
    else:
        advice = ("the folder's weights do not fit its config.json (another architecture, or a config.json edited "
                  "after saving: compare num_hidden_layers, attention_types, diff_version, attention_bias)")
    return ValueError(f"unexpected weight {name!r} in the folder: {advice}")
