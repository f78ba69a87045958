"""Tokenizers and training text: the tokenizers the package builds, and the text files and task it trains on.

Byte-level BPE trained locally and the word-level task tokenizer round-trip through save_pretrained / AutoTokenizer as
transformers' built-in class, put <s> first, and carry an optional chat template; a binary file, a tokenizer's
length warning and an impossible task are answered clearly."""

import json
from pathlib import Path

import pytest
from helpers import saved_folders
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from diff_transformer.tools.data import KeyValueTask, encode_example, text_file_dataset
from diff_transformer.tools.evaluation import FILLER
from diff_transformer.tokenization_diff import CHAT_TEMPLATE as BUILTIN_CHAT_TEMPLATE
from diff_transformer.tokenization_diff import (
    CHAT_TOKENS,
    SPECIAL_TOKENS,
    build_word_tokenizer,
    train_bpe_tokenizer,
)

CORPUS = [
    "First Citizen: Before we proceed any further, hear me speak.",
    "All: Speak, speak. You are all resolved rather to die than to famish?",
    "Ünïcödé, émoji 🙂 and tabs\tsurvive byte-level BPE.",
] * 20
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
EXTRA = ["<|user|>", "<|assistant|>"]
UNSEEN = "Completely unseen: Zürich 東京 ∑ 42!"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(CORPUS), encoding="utf-8")
    return train_bpe_tokenizer(
        files=[path], vocab_size=400, chat_template=CHAT_TEMPLATE, extra_special_tokens=EXTRA, model_max_length=128
    )


def test_bpe_vocab_and_special_tokens(bpe):
    assert isinstance(bpe, PreTrainedTokenizerFast)
    assert 256 + len(SPECIAL_TOKENS) + len(EXTRA) < len(bpe) <= 400, len(bpe)
    ids = [bpe.convert_tokens_to_ids(t) for t in [*SPECIAL_TOKENS.values(), *EXTRA]]
    assert ids == list(range(len(SPECIAL_TOKENS) + len(EXTRA))), ids
    assert bpe("<|user|>hi</s>")["input_ids"][:2] == [bpe.bos_token_id, ids[4]], "extra special token was split"
    assert bpe.padding_side == "left"


def test_bos_first_unless_special_tokens_are_off(bpe):
    ids = bpe(UNSEEN)["input_ids"]
    assert ids[0] == bpe.bos_token_id and ids[1:] == bpe(UNSEEN, add_special_tokens=False)["input_ids"], ids
    assert bpe.bos_token_id not in ids[1:] and bpe.eos_token_id not in ids, "only <s>, once, at the start"


def test_bpe_round_trip_through_auto_tokenizer(bpe, tmp_path):
    bpe.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in [*CORPUS[:3], UNSEEN]:
        ids = bpe(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids, text
        assert loaded.decode(ids) == bpe.bos_token + text, "byte-level BPE must decode losslessly"
    assert loaded.get_vocab() == bpe.get_vocab()
    assert loaded.special_tokens_map == bpe.special_tokens_map
    assert (loaded.padding_side, loaded.model_max_length) == ("left", 128)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "<|user|>hi</s><|assistant|>hello</s>"
    batch = loaded(["a", "a longer line"], padding=True)["input_ids"]
    assert batch[0][0] == loaded.pad_token_id, "batches must be left-padded"


def test_saved_as_builtin_class_without_custom_code(bpe, tmp_path):
    bpe.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend" and "auto_map" not in config, config
    post_processor = json.loads((tmp_path / "tokenizer.json").read_text())["post_processor"]
    assert post_processor["type"] == "TemplateProcessing", post_processor
    loaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert loaded(UNSEEN)["input_ids"] == bpe(UNSEEN)["input_ids"]


def test_bpe_from_texts_matches_files(bpe):
    from_texts = train_bpe_tokenizer(texts=["\n".join(CORPUS)], vocab_size=400, extra_special_tokens=EXTRA)
    assert from_texts(UNSEEN)["input_ids"] == bpe(UNSEEN)["input_ids"]


def test_word_tokenizer_round_trip(tmp_path):
    task = KeyValueTask()
    tokenizer = task.tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = " ".join(task.texts(1)[0].split())
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.unk_token_id not in loaded(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == " " + text  # GPT-2's leading space
    assert len(loaded) == len(SPECIAL_TOKENS) + len(task.vocabulary())
    assert build_word_tokenizer(["zz"])("zz qq")["input_ids"] == [loaded.bos_token_id, 4, loaded.unk_token_id]


def test_word_tokenizer_chat_template_matches_training(tmp_path):
    task = KeyValueTask()
    task.tokenizer(chat=True).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == BUILTIN_CHAT_TEMPLATE
    roles = [loaded.convert_tokens_to_ids(t) for t in CHAT_TOKENS]
    assert roles == [4, 5, 6], roles
    messages = [{"role": "user", "content": "k1 v2 ? k1"}, {"role": "assistant", "content": "v2"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "<s><|user|>k1 v2 ? k1</s><|assistant|>v2</s>"
    tokens = ["<s>", "<|user|>", "Ġk1", "Ġv2", "Ġ?", "Ġk1", "</s>", "<|assistant|>"]
    ids = [loaded.convert_tokens_to_ids(t) for t in tokens]
    assert encode_example(loaded, "k1 v2 ? k1") == ids, "generation prompt"
    assert encode_example(loaded, "k1 v2 ? k1", "v2") == [*ids, loaded.convert_tokens_to_ids("Ġv2"), 2], "training"


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="needs `files`"):
        train_bpe_tokenizer()
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train_bpe_tokenizer(files=[tmp_path / "missing.txt"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """binary.bin, a binary file (helpers.saved_folders)."""
    return saved_folders(tmp_path_factory.mktemp("mistakes"), ("binary.bin",))


def test_data_mistakes(folders, tmp_path, capfd):
    with pytest.raises(ValueError, match="binary.bin is not UTF-8 text"):
        text_file_dataset(folders / "binary.bin", None, 8)
    with pytest.raises(ValueError, match=r"not UTF-8 text: \['.*binary.bin'\]"):
        train_bpe_tokenizer(files=[folders / "binary.bin"], vocab_size=300)
    with pytest.raises(ValueError, match=r"num_pairs \(20\) <= num_keys \(16\)"):
        KeyValueTask(num_pairs=20)
    corpus = tmp_path / "long.txt"
    corpus.write_text(" ".join(FILLER) * 400, encoding="utf-8")
    tokenizer = train_bpe_tokenizer(texts=FILLER, vocab_size=300)
    transformers_logging.set_verbosity_warning()
    try:
        blocks = text_file_dataset(corpus, tokenizer, 64)
    finally:
        transformers_logging.set_verbosity_error()
    assert len(blocks) > 10 and "indexing errors" not in capfd.readouterr().err

