"""The tokenizer builders, under the name the tools import them by: they live in `tokenization_diff.py`."""

from ..tokenization_diff import (
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    SPECIAL_TOKENS,
    build_word_tokenizer,
    check_known_words,
    is_utf8,
    train_bpe_tokenizer,
    train_on_files,
    unknown_words,
)

__all__ = ["train_bpe_tokenizer", "build_word_tokenizer", "train_on_files", "is_utf8", "unknown_words",
           "check_known_words", "SPECIAL_TOKENS", "CHAT_TOKENS", "CHAT_TEMPLATE"]
