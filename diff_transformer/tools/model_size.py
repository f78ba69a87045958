"""What the command line checks of a saved folder's weights before it builds a model from it, from the safetensors
headers and config.json alone: the headers can be read, and the parameters the config implies are those the files
hold and fit in memory."""

import math
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open
from transformers import PreTrainedConfig

from ..configuration_diff import DiffConfig


def header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of a safetensors file, from its header; `ValueError` naming the file where it is
    truncated or corrupt (safetensors' own error names no file)."""
    try:
        with safe_open(file, "pt") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    except SafetensorError as error:
        raise ValueError(f"{file} is truncated or corrupt ({error}); copy or download the folder again, or save the "
                         "model again with save_pretrained") from None


def layer_parameters(config: DiffConfig, kind: str) -> int:
    """Weights of one decoder layer of a DiffConfig, biases left out: attention projections of the layer's `kind`
    (differential V1 / V2, or standard), lambda, SubLN, the MLP and the two norms."""
    hidden, h, h_kv, d, dv = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.value_head_dim)
    if kind == "standard":
        attention = hidden * (2 * h * dv + 2 * h_kv * dv)  # q, o: h dv / d heads of d; k, v: h_kv dv / d heads
    elif config.diff_version == 2:
        attention = hidden * (2 * h * d + 2 * h_kv * d + h * d + h)  # q, k, v, o, lambda_proj
    else:
        attention = hidden * (2 * h * d + 2 * h_kv * d + h_kv * dv + h * dv) + 4 * d + dv
    return attention + 3 * hidden * config.intermediate_size + 2 * hidden


def config_parameters(config: DiffConfig) -> int:
    """The parameters a DiffConfig implies, from its fields (no model is built): within a few percent (biases and
    PolyNorm's four weights left out)."""
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.hidden_size + sum(layer_parameters(config, kind) for kind in config.attention_types)


def memory_available() -> int:
    """Bytes of memory this process may still use: MemAvailable of /proc/meminfo, else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")


def check_model_size(folder: str, config: PreTrainedConfig, available: int | None = None) -> None:
    """Before a DIFF model is built from `folder` (whose config is `config`): `ValueError` where the config implies
    far more parameters than its weight files hold (a hand-edited `num_hidden_layers: 100000` would build for minutes
    toward hundreds of GB of random weights), or weights that need more memory than is `available` (default:
    `memory_available`)."""
    if getattr(config, "model_type", None) != "diff_transformer":
        return
    implied = config_parameters(config)
    shapes = [shape for file in sorted(Path(folder).glob("*.safetensors")) for shape in header_shapes(file).values()]
    held = sum(math.prod(shape) for shape in shapes)
    fields = ", ".join(f"{name}={getattr(config, name)}" for name in SIZE_FIELDS)
    if implied > 1.5 * held:
        raise ValueError(f"config.json of {folder} implies {implied:,} parameters ({fields}), but its weight files "
                         f"hold {held:,}: the fields do not describe these weights (a hand edit?); fix them, or save "
                         "the model and its config again together")
    needed = implied * (2 if str(config.dtype).removeprefix("torch.") in ("bfloat16", "float16") else 4)
    available = memory_available() if available is None else available
    if needed > available:
        raise ValueError(f"{folder} needs about {needed / 2**30:.1f} GiB of memory for its {implied:,} weights "
                         f"({fields}), more than the {available / 2**30:.1f} GiB available; free some memory or use "
                         "a machine with more")
