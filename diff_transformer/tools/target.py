"""What every converter into the Differential Transformer (arXiv 2410.05258) ends with, shared by `convert.py` (Llama
family, DiffLlama) and `motif.py` (Motif-2): the DIFF model loaded with the converted weights, and the source's
tokenizer files copied beside it."""

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..configuration_diff import DiffConfig
from ..modeling_diff import DiffForCausalLM

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


def load_target(config: DiffConfig, state: dict, dtype: torch.dtype,
                check: Callable[[dict, DiffForCausalLM], None] | None = None) -> DiffForCausalLM:
    """A `DiffForCausalLM` of `config` in `dtype` holding `state` (all of its weights; `check(state, model)` may
    refuse them first), in eval mode."""
    model = DiffForCausalLM._from_config(config, dtype=dtype)
    if check is not None:
        check(state, model)
    model.load_state_dict(state, strict=True)
    return model.eval()


def copy_tokenizer(src: str, out: str) -> list[str]:
    """Copy the tokenizer files that exist in a local source folder; return their names."""
    copied = [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]
    for name in copied:
        shutil.copy2(Path(src) / name, Path(out) / name)
    return copied
