"""Checkpoint conversion into the Differential Transformer (Ye et al., arXiv 2410.05258) layout of docs/design.md §2.

Two paths:

- `convert_llama_family`: Llama, Mistral and Qwen2 checkpoints become a function-preserving DIFF model. Each source
  head becomes branch 1 of a differential head, branch 2 gets a copy of its q/k rows, and lambda starts at exactly 0:

      lambda = exp(<lq1, lk1>) - exp(<lq2, lk2>) + lambda_init,   lq1 = lq2, lk1 = lk2 != 0, lambda_init = 0

  so A1 - lambda A2 = A1 while d lambda / d lq1 = exp(<lq1, lk1>) lk1 != 0: lambda learns from the first step.
  With `use_subln=False` and `value_head_dim = head_dim` the head output is the source head's output. Layers not
  listed in `layers` stay "standard" attention with the source weights copied 1:1.
- `import_diffllama`: transformers' DiffLlama (heads j and j + H/2 form pair j, the 2d value is the concatenation
  of kv heads m and m + H_kv/2, gain-free head RMSNorm) is a row permutation of our layout.

These are tools, not Hub code: `modeling_diff.py` does not import this module.
"""

import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from ..configuration_diff import DiffConfig
from ..modeling_diff import DiffForCausalLM
from .safe_write import staged_folder, target_problem, tensor_bytes
from .target import copy_tokenizer, load_target

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED = (*LLAMA_FAMILY, "diffllama")
MOTIF_OPTIONS = ("ignore_fields", "expand_noise_heads")  # `convert_motif`'s options
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "hidden_act", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "rope_parameters",
)


def check_supported(config: PreTrainedConfig) -> None:
    if config.model_type not in SUPPORTED:
        raise ValueError(
            f"cannot convert model_type '{config.model_type}' ({type(config).__name__}): supported are "
            f"{', '.join(SUPPORTED)} (Llama-style pre-RMSNorm decoders with rotate_half RoPE and SwiGLU), and "
            "local Motif-2 folders"
        )


def check_sliding_window(config: PreTrainedConfig, allow_sliding_window: bool) -> None:
    """Our attention is global; a window shorter than the context changes outputs beyond `sliding_window` tokens."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    uses_window = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if not uses_window or window >= config.max_position_embeddings:
        return
    message = (
        f"{config.model_type} uses sliding_window={window} < max_position_embeddings="
        f"{config.max_position_embeddings}; the converted model attends globally, so its outputs equal the source's "
        f"only for sequences of at most {window} tokens"
    )
    if not allow_sliding_window:
        raise ValueError(f"{message}. Pass allow_sliding_window=True (CLI: --allow-sliding-window) to convert anyway")
    warnings.warn(message, stacklevel=3)


def resolve_layers(layers: Iterable[int] | None, num_layers: int) -> list[int]:
    chosen = sorted(set(range(num_layers) if layers is None else layers))
    if any(i < 0 or i >= num_layers for i in chosen):
        raise ValueError(f"layers {chosen} out of range for a model with {num_layers} layers")
    return chosen


def shared_fields(config: PreTrainedConfig) -> dict:
    fields = {name: getattr(config, name) for name in SHARED_FIELDS}
    fields["mlp_bias"] = getattr(config, "mlp_bias", False)
    fields["embedding_multiplier"] = 1.0  # the sources' embeddings are unscaled: logits stay equal
    return fields


def llama_family_config(source: PreTrainedModel, layers: list[int]) -> DiffConfig:
    """Same shapes as the source; each source head is branch 1 of one differential head (dv = d)."""
    config = source.config
    attn = source.model.layers[0].self_attn
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    types = ["differential" if i in layers else "standard" for i in range(config.num_hidden_layers)]
    return DiffConfig(
        **shared_fields(config),
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        value_head_dim=head_dim,
        attention_bias=attn.q_proj.bias is not None,
        attention_out_bias=attn.o_proj.bias is not None,
        lambda_init=0.0,
        use_subln=False,
        attention_types=types,
    )


def zero_lambda_vectors(head_dim: int, std: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """lq1 = lq2 and lk1 = lk2, random non-zero: lambda is exactly 0 and its gradient is not."""
    lq, lk = (torch.randn(head_dim, generator=generator) * std for _ in range(2))
    return {"q1": lq, "k1": lk, "q2": lq.clone(), "k2": lk.clone()}


def duplicate_branch(state: dict, prefix: str, lambdas: dict[str, torch.Tensor]) -> None:
    """In place: q/k rows (and biases) [branch 1 | branch 2 = copy], plus the lambda vectors of the layer."""
    for proj in ("q_proj", "k_proj"):
        for kind in ("weight", "bias"):
            key = f"{prefix}.{proj}.{kind}"
            if key in state:
                state[key] = torch.cat([state[key], state[key]], dim=0)
    dtype = state[f"{prefix}.q_proj.weight"].dtype
    state.update({f"{prefix}.lambda_params.{name}": value.to(dtype) for name, value in lambdas.items()})


def convert_llama_family(
    source: PreTrainedModel,
    layers: Iterable[int] | None = None,
    allow_sliding_window: bool = False,
    lambda_std_dev: float = 0.1,
    seed: int = 0,
) -> DiffForCausalLM:
    """A function-preserving `DiffForCausalLM` from a Llama/Mistral/Qwen2 `*ForCausalLM` (see module docstring).

    `layers` (0-based) become differential; the others stay standard attention. Default: all layers.
    """
    check_supported(source.config)
    if source.config.model_type not in LLAMA_FAMILY:
        raise ValueError(f"convert_llama_family takes {LLAMA_FAMILY}; use import_diffllama for DiffLlama")
    check_sliding_window(source.config, allow_sliding_window)
    chosen = resolve_layers(layers, source.config.num_hidden_layers)
    config = llama_family_config(source, chosen)
    state = dict(source.state_dict())
    generator = torch.Generator().manual_seed(seed)
    for i in chosen:
        lambdas = zero_lambda_vectors(config.head_dim, lambda_std_dev, generator)
        duplicate_branch(state, f"model.layers.{i}.self_attn", lambdas)
    return build_target(config, state, source)


def diffllama_config(config: PreTrainedConfig) -> DiffConfig:
    """DiffLlama's H heads of dim d are H/2 differential heads (value 2d); its kv heads pair up the same way."""
    return DiffConfig(
        **shared_fields(config),
        num_attention_heads=config.num_attention_heads // 2,
        num_key_value_heads=config.num_key_value_heads // 2,
        head_dim=config.head_dim,
        value_head_dim=2 * config.head_dim,
        attention_bias=config.attention_bias,
        attention_out_bias=config.attention_bias,
        lambda_init=None,  # DiffLlama uses the paper schedule 0.8 - 0.6 exp(-0.3 layer_idx)
        lambda_std_dev=config.lambda_std_dev,
        use_subln=True,
    )


def diffllama_value_order(num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Row order of our v_proj: kv head m is DiffLlama's kv heads (m, m + H_kv/2) side by side."""
    half = num_kv_heads // 2
    heads = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()


def import_diffllama(source: PreTrainedModel) -> DiffForCausalLM:
    """`DiffLlamaForCausalLM` -> `DiffForCausalLM` with identical outputs.

    q_proj, k_proj and o_proj already follow our "halves" order (DiffLlama head j + H/2 is branch 2 of head j and
    kv head m + H_kv/2 its branch-2 key); v_proj rows are permuted; the gain-free head norm becomes SubLN with gain 1.
    """
    check_supported(source.config)
    config = diffllama_config(source.config)
    order = diffllama_value_order(source.config.num_key_value_heads, source.config.head_dim)
    state = {}
    for key, value in source.state_dict().items():
        prefix, _, name = key.rpartition(".")
        if name.startswith("lambda_"):
            key = f"{prefix}.lambda_params.{name.removeprefix('lambda_')}"
        elif prefix.endswith("v_proj"):
            value = value[order]
        state[key] = value
    for i in range(config.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.subln.weight"] = torch.ones(2 * config.head_dim)
    return build_target(config, state, source)


def build_target(config: DiffConfig, state: dict, source: PreTrainedModel) -> DiffForCausalLM:
    model = load_target(config, state, next(source.parameters()).dtype)
    model.generation_config = source.generation_config
    return model


def convert(source: PreTrainedModel, **options) -> DiffForCausalLM:
    """Dispatch on `model_type`: Llama family -> `convert_llama_family(**options)`, DiffLlama -> `import_diffllama`."""
    check_supported(source.config)
    if source.config.model_type == "diffllama":
        return import_diffllama(source)
    return convert_llama_family(source, **options)


def convert_checkpoint(src: str, out: str, dtype: str = "auto", overwrite: bool = False,
                       **options) -> DiffForCausalLM:
    """Load `src` (folder or Hub id), convert, save model, generation config and tokenizer files to `out`. A local
    Motif folder goes to `motif.convert_motif` (its options: `MOTIF_OPTIONS`).

    `out` is written whole or not at all (`safe_write.staged_folder`): a missing or empty folder, or with
    `overwrite` a saved model, replaced whole (none of its files stays beside the new weights); never `src` or a
    folder inside or around it, nor a folder of other files."""
    from .motif import convert_motif, is_motif_folder

    inputs = (Path(src),) if Path(src).expanduser().exists() else ()
    if problem := target_problem(Path(out), overwrite, inputs):
        raise ValueError(problem)
    if Path(src).is_dir() and is_motif_folder(src):
        if set(options) - set(MOTIF_OPTIONS):
            raise ValueError(f"{', '.join(sorted(set(options) - set(MOTIF_OPTIONS)))} do(es) not apply to Motif-2 "
                             "checkpoints, which convert whole (every layer is differential already)")
        with staged_folder(Path(out), replace=overwrite) as staging:
            return convert_motif(src, staging, dtype, **options)
    if found := set(options) & set(MOTIF_OPTIONS):
        raise ValueError(f"{', '.join(sorted(found))} appl(ies) to Motif-2 checkpoints only")
    check_supported(AutoConfig.from_pretrained(src))
    source = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    model = convert(source, **options)
    needed = tensor_bytes(model.state_dict().values())
    with staged_folder(Path(out), replace=overwrite, needed=needed) as staging:
        model.save_pretrained(staging)
        copied = copy_tokenizer(src, str(staging)) if Path(src).is_dir() else []
    if not copied:
        warnings.warn(f"no tokenizer files found in {src}; save the source tokenizer into {out} yourself", stacklevel=2)
    return model


def added_parameters(model: DiffForCausalLM) -> int:
    """Parameters `convert` added: per converted Llama-family layer the branch-2 q/k rows (and biases) plus 4d lambda
    values; per imported DiffLlama layer (the only conversion with SubLN) the SubLN gain, which DiffLlama lacks."""
    config = model.config
    layers = config.attention_types.count("differential")
    if config.use_subln:
        return config.value_head_dim * layers
    d, hidden = config.head_dim, config.hidden_size
    heads = config.num_attention_heads + config.num_key_value_heads
    return (heads * d * (hidden + int(config.attention_bias)) + 4 * d) * layers


__all__ = ["convert", "convert_llama_family", "import_diffllama", "convert_checkpoint", "added_parameters"]
