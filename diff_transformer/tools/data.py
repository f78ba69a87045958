"""Training data that needs no download: a synthetic key/value retrieval task, and plain text files."""

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from ..saved_folder import read_text_file
from ..tokenization_diff import CHAT_TEMPLATE, CHAT_TOKENS, build_word_tokenizer


@dataclass
class KeyValueTask:
    """Sequences `k12 v3 k40 v7 ... ? k40 v7`: a list of key/value pairs, then a query key whose value must be
    retrieved from context — the in-context retrieval the DIFF paper evaluates (§3.4), in miniature."""

    num_keys: int = 16
    num_values: int = 16
    num_pairs: int = 2

    def __post_init__(self):
        if not 1 <= self.num_pairs <= self.num_keys or self.num_values < 1:
            raise ValueError(f"KeyValueTask needs 1 <= num_pairs ({self.num_pairs}) <= num_keys ({self.num_keys}) "
                             f"and num_values >= 1 (got {self.num_values}): the pairs of a sequence use distinct keys")

    def vocabulary(self) -> list[str]:
        return [f"k{i}" for i in range(self.num_keys)] + [f"v{i}" for i in range(self.num_values)] + ["?"]

    def tokenizer(self, chat: bool = False) -> PreTrainedTokenizerFast:
        """The task's word-level tokenizer; `chat=True` adds the built-in chat template and its role tokens."""
        if not chat:
            return build_word_tokenizer(self.vocabulary())
        return build_word_tokenizer(self.vocabulary(), chat_template=CHAT_TEMPLATE, extra_special_tokens=CHAT_TOKENS)

    def example(self, rng: random.Random) -> tuple[str, str]:
        """Return (prompt ending in the query key, answer value)."""
        keys = rng.sample(range(self.num_keys), self.num_pairs)
        values = [rng.randrange(self.num_values) for _ in keys]
        query = rng.randrange(self.num_pairs)
        context = " ".join(f"k{k} v{v}" for k, v in zip(keys, values))
        return f"{context} ? k{keys[query]}", f"v{values[query]}"

    def texts(self, count: int, seed: int = 0) -> list[str]:
        rng = random.Random(seed)
        return [" ".join(self.example(rng)) for _ in range(count)]


def encode_example(tokenizer: PreTrainedTokenizerFast, prompt: str, answer: str | None = None) -> list[int]:
    """Token ids of a task example as the model trains on it (`answer` given: `<s> prompt answer`) or is prompted
    (`answer=None`: `<s> prompt`); the closing demo of `train` generates as many tokens as the answer has. No `</s>`
    after the answer: the README's default run learns less reliably with it (benchmarks/HISTORY.md). A tokenizer
    with a chat template formats it as a user turn and an assistant turn, exactly as `apply_chat_template` (and so
    `pipeline` with chat messages) does at inference."""
    if tokenizer.chat_template is None:
        return tokenizer(prompt if answer is None else f"{prompt} {answer}")["input_ids"]
    messages = [{"role": "user", "content": prompt}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=answer is None)["input_ids"])


class TokenBlocks(torch.utils.data.Dataset):
    """Fixed-length causal-LM blocks (input_ids = labels) for `Trainer`."""

    def __init__(self, token_ids: list[list[int]]):
        self.blocks = token_ids

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.blocks[index])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def task_dataset(task: KeyValueTask, tokenizer: PreTrainedTokenizerFast, count: int, seed: int) -> TokenBlocks:
    rng = random.Random(seed)
    return TokenBlocks([encode_example(tokenizer, *task.example(rng)) for _ in range(count)])


def text_file_dataset(path: str | Path, tokenizer: PreTrainedTokenizerFast, block_size: int) -> TokenBlocks:
    """Tokenize a whole text file and cut it into blocks of `<s>` and `block_size - 1` tokens (the tail is dropped):
    every training sequence starts as the tokenizer starts every text."""
    # verbose=False: the file is one long sequence on purpose; it is cut into blocks below
    ids = tokenizer(read_text_file(path), add_special_tokens=False, verbose=False)["input_ids"]
    step = block_size - 1
    if len(ids) < step:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than the {step} of one block of {block_size} (a block "
                         f"starts with <s>); give a longer text, or a block size of at most {len(ids) + 1} "
                         "(--block-size)")
    bos = [tokenizer.bos_token_id]
    return TokenBlocks([bos + ids[i : i + step] for i in range(0, len(ids) - step + 1, step)])


def retrieval_accuracy(model, tokenizer, task: KeyValueTask, count: int = 200, seed: int = 12345) -> float:
    """Share of held-out prompts whose greedy next token is the right value."""
    rng = random.Random(seed)
    examples = [task.example(rng) for _ in range(count)]
    prompts = [encode_example(tokenizer, prompt) for prompt, _ in examples]
    answers = torch.tensor([tokenizer(a, add_special_tokens=False)["input_ids"][0] for _, a in examples])
    with torch.no_grad():
        logits = model(torch.tensor(prompts, device=model.device)).logits[:, -1]
    return (logits.argmax(-1).cpu() == answers).float().mean().item()
