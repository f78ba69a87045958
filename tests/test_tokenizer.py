"""Tokenizers (issue #4): byte-level BPE trained locally and the word-level task tokenizer round-trip through
save_pretrained / AutoTokenizer."""

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from diff_transformer.data import KeyValueTask
from diff_transformer.tokenization_diff import SPECIAL_TOKENS, build_word_tokenizer, train_bpe_tokenizer

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
    assert bpe("<|user|>hi</s>")["input_ids"][0] == ids[4], "extra special token was split"
    assert bpe.padding_side == "left"


def test_bpe_round_trip_through_auto_tokenizer(bpe, tmp_path):
    bpe.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in [*CORPUS[:3], UNSEEN]:
        ids = bpe(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids, text
        assert loaded.decode(ids) == text, "byte-level BPE must decode losslessly"
    assert loaded.get_vocab() == bpe.get_vocab()
    assert loaded.special_tokens_map == bpe.special_tokens_map
    assert (loaded.padding_side, loaded.model_max_length) == ("left", 128)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "<|user|>hi</s><|assistant|>hello</s>"
    batch = loaded(["a", "a longer line"], padding=True)["input_ids"]
    assert batch[0][0] == loaded.pad_token_id, "batches must be left-padded"


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
    assert loaded.decode(loaded(text)["input_ids"]) == " " + text  # words carry GPT-2's leading space
    assert len(loaded) == len(SPECIAL_TOKENS) + len(task.vocabulary())
    assert build_word_tokenizer(["zz"])("zz qq")["input_ids"] == [4, loaded.unk_token_id]


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="needs `files`"):
        train_bpe_tokenizer()
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train_bpe_tokenizer(files=[tmp_path / "missing.txt"])
