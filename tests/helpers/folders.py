"""Tiny saved folders: a DIFF model and tokenizer, as the generation and Hub tests load it, and a Llama one, as
`convert` reads it."""

from pathlib import Path

import torch
from helpers import tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

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


def save_llama(path: Path, tokenizer) -> Path:
    """A tiny random LlamaForCausalLM (one layer, 32 wide, a 512-token context) with `tokenizer`, saved together."""
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=512)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
