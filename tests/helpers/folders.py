"""A tiny saved folder: model and tokenizer, as the generation and Hub tests load it."""

from pathlib import Path

import torch
from helpers import tiny_config

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.data import KeyValueTask
from diff_transformer.tokenization_diff import train_bpe_tokenizer


def save_tiny_folder(path: Path) -> Path:
    """A tiny DiffForCausalLM and a byte-level BPE tokenizer, saved together (also used by the Hub tests)."""
    tokenizer = train_bpe_tokenizer(texts=KeyValueTask().texts(200), vocab_size=300)
    config = tiny_config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=None, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sha256s(folder: Path) -> dict[str, str]:
    """The sha256 of every file under `folder`, by its path relative to it: what a refused command must leave as it
    was."""
    import hashlib

    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(Path(folder).rglob("*")) if path.is_file()}


class PlantedPickle:
    """Unpickled, writes the file `marker`: a pickle that runs code, as a hostile pytorch_model.bin does."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def planted_pickle(marker: Path) -> bytes:
    """Weights pickled with a `PlantedPickle` among them."""
    import pickle

    return pickle.dumps({"weight": PlantedPickle(marker)})
