"""Tokenizers for DIFF Transformer models (arXiv 2410.05258): byte-level BPE trained on the user's text, or a
word-level vocabulary for synthetic tasks. Both return a standard `PreTrainedTokenizerFast` (saved as transformers'
built-in `TokenizersBackend`, no custom code) that puts `<s>` before every text, as the models are trained."""

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Every turn is `<|role|>content</s>`; a generation prompt opens the assistant's turn, so the model's `</s>` ends it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _wrap(
    tokenizer: Tokenizer, chat_template: str | None, model_max_length: int, extra_special_tokens: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    # padding_side goes through __init__ so that save_pretrained records it (decoder-only generation pads left);
    # add_bos_token makes transformers write a `<s> $A` post-processor into tokenizer.json
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        model_max_length=model_max_length,
        padding_side="left",
        add_bos_token=True,
        chat_template=chat_template,
        extra_special_tokens=list(extra_special_tokens),
        **SPECIAL_TOKENS,
    )


def train_bpe_tokenizer(
    files: Iterable[str | Path] | None = None,
    texts: Iterable[str] | None = None,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    chat_template: str | None = None,
    model_max_length: int = 4096,
    extra_special_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE on text files (or an iterable of strings); no download needed.

    `SPECIAL_TOKENS` get ids 0-3 and `extra_special_tokens` (e.g. chat-turn markers) the ids after them; neither
    is ever split. `chat_template` is a Jinja template stored with the tokenizer for `apply_chat_template`.
    Encoding puts `<s>` first (`add_special_tokens=False` leaves it out).
    """
    if files is None and texts is None:
        raise ValueError("train_bpe_tokenizer needs `files` (paths to text files) or `texts` (strings)")
    files = [str(f) for f in files or []]
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"tokenizer training files not found: {missing}")
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*SPECIAL_TOKENS.values(), *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),  # a bar redrawn in place floods a log file
    )
    if files:
        train_on_files(tokenizer, files, trainer)
    if texts is not None:
        tokenizer.train_from_iterator(texts, trainer)
    return _wrap(tokenizer, chat_template, model_max_length, extra_special_tokens)


def train_on_files(tokenizer: Tokenizer, files: list[str], trainer: trainers.Trainer) -> None:
    """`tokenizer.train`, naming the files that are not UTF-8 text (the tokenizers library names none)."""
    try:
        tokenizer.train(files, trainer)
    except Exception as error:
        if "UTF-8" not in str(error):
            raise
        binary = [f for f in files if not is_utf8(Path(f).read_bytes())]
        raise ValueError(f"not UTF-8 text: {binary}; give plain text files (convert each, naming its encoding after "
                         "-f: iconv -f LATIN1 -t UTF-8 FILE > FILE-utf8.txt)") from error


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def build_word_tokenizer(
    words: Iterable[str],
    model_max_length: int = 4096,
    chat_template: str | None = None,
    extra_special_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over a fixed vocabulary (special tokens get ids 0-3, then
    `extra_special_tokens`, then the words).

    Words are stored byte-level with their leading space ("Ġk1"), as in GPT-2, so a continuation decoded on its
    own (as `pipeline` does) keeps its separating space.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS.values(), *extra_special_tokens])}
    for word in words:
        vocab.setdefault(byte_level.pre_tokenize_str(word)[0][0], len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return _wrap(tokenizer, chat_template, model_max_length, extra_special_tokens)


def unknown_words(tokenizer: PreTrainedTokenizerFast, text: str) -> list[str]:
    """The pieces of `text` the tokenizer reads as its unknown token (once each, in order): words outside a
    word-level vocabulary, characters a BPE without byte fallback never saw. Empty for a byte-level BPE."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    pieces = (text[start:end] for token, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"])
              if token == unk)
    return list(dict.fromkeys(piece.strip() for piece in pieces if piece.strip() != tokenizer.unk_token))


def check_known_words(tokenizer: PreTrainedTokenizerFast, text: str, what: str, folder: str | None = None) -> None:
    """`ValueError` naming the words of `text` (`what`: "the prompt", "--prompt") the tokenizer does not know: the
    model would read each as one unknown token and answer something else, without a word said."""
    unknown = unknown_words(tokenizer, text)
    if unknown:
        whose = f"the tokenizer of {folder}" if folder else "the tokenizer"
        raise ValueError(f"{what} has words {whose} does not know: {', '.join(map(repr, unknown))} (each would be "
                         f"read as {tokenizer.unk_token}); leave them out, or use words of its vocabulary")


__all__ = [
    "train_bpe_tokenizer",
    "build_word_tokenizer",
    "unknown_words",
    "check_known_words",
    "SPECIAL_TOKENS",
    "CHAT_TOKENS",
    "CHAT_TEMPLATE",
]
