"""A newcomer's mistakes get a clear answer (issue #18): the command line answers in one line naming the fix, with
exit status 2 and no traceback; the library raises ValueError / FileNotFoundError with the same messages."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.utils import logging as transformers_logging

from diff_transformer import DiffForCausalLM, capture_branch_attentions
from diff_transformer.tools.data import KeyValueTask, text_file_dataset
from diff_transformer.tools.evaluation import (
    CITIES,
    FILLER,
    NeedleSettings,
    activation_outliers,
    attention_noise,
    build_needle_prompt,
    needle,
)
from diff_transformer.tools.tokenizer import train_bpe_tokenizer
from diff_transformer_cli import main

ROOT = Path(__file__).resolve().parents[1]


def save_diff(path: Path, tokenizer) -> Path:
    DiffForCausalLM(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=512)).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """diff (English BPE tokenizer), word (the synthetic task's word-level tokenizer), no-tokenizer, gpt2, llama,
    and a binary file."""
    root = tmp_path_factory.mktemp("mistakes")
    texts = list(FILLER) * 20 + [needle(c, str(1000 + i)) for i, c in enumerate(CITIES)] * 3
    english = train_bpe_tokenizer(texts=texts + [f"What is the magic number of {c}?" for c in CITIES], vocab_size=400)
    save_diff(root / "diff", english)
    save_diff(root / "word", KeyValueTask().tokenizer())
    DiffForCausalLM(tiny_config()).save_pretrained(root / "no-tokenizer")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(english))).save_pretrained(root / "gpt2")
    english.save_pretrained(root / "gpt2")
    LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2)).save_pretrained(root / "llama")
    (root / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    return root


CLI_MISTAKES = {  # name: (arguments, a fragment of the one-line answer); {d} is the folders fixture
    "mistyped-generate": (["generate", "{d}/typo", "--prompt", "x"], "no such folder: {d}/typo"),
    "mistyped-eval-needle": (["eval-needle", "{d}/typo"], "no such folder: {d}/typo"),
    "mistyped-convert": (["convert", "{d}/typo", "{d}/out"], "no such folder: {d}/typo"),
    "no-tokenizer": (["generate", "{d}/no-tokenizer", "--prompt", "x"], "has no tokenizer (tokenizer.json"),
    "gpt2-generate": (["generate", "{d}/gpt2", "--prompt", "x"], "holds a 'gpt2' model, not a DIFF Transformer"),
    "minutes": (["train", "--minutes", "-1"], "argument --minutes: '-1' must be a finite number > 0"),
    "max-steps": (["train", "--max-steps", "0"], "argument --max-steps: '0' must be a whole number >= 1"),
    "binary-data": (["train", "--data", "{d}/binary.bin"], "binary.bin is not UTF-8 text (byte 0x89 at offset 0)"),
    "missing-data": (["train", "--data", "{d}/nope.txt"], "no such file: {d}/nope.txt"),
    "heads": (["train", "--hidden-size", "60", "--heads", "4"], "--hidden-size (60) must be a multiple of 2 * --heads"),
    "pairs": (["train", "--pairs", "20", "--keys", "16"], "--pairs (20) cannot exceed --keys (16)"),
    "backend": (["train", "--attn-implementation", "flash"], "invalid choice: 'flash'"),
    "lengths": (["eval-needle", "{d}/diff", "--lengths", "0"], "argument --lengths: '0' must be a whole number >= 1"),
    "depths": (["eval-needle", "{d}/diff", "--depths", "150"], "'150' must be a percentage between 0 and 100"),
    "needles": (["eval-needle", "{d}/diff", "--needles", "50"], f"needles must be between 1 and {len(CITIES)}"),
    "queries": (["eval-needle", "{d}/diff", "--needles", "2", "--queries", "3"],
                "queries must be between 1 and needles"),
    "samples": (["eval-needle", "{d}/diff", "--samples", "0"], "argument --samples: '0' must be a whole number >= 1"),
    "word-tokenizer": (["eval-needle", "{d}/word", "--lengths", "100"], "the tokenizer cannot encode the needle text"),
    "short-prompt": (["eval-needle", "{d}/diff", "--lengths", "20"], "a 20-token prompt cannot hold 6 needles"),
    "outliers-length": (["outliers", "{d}/diff", "--length", "0"], "argument --length: '0' must be a whole number"),
    "outliers-top-k": (["outliers", "{d}/diff", "--top-k", "0"], "argument --top-k: '0' must be a whole number >= 1"),
    "noise-baseline": (["attention-noise", "{d}/diff", "--baseline", "{d}/typo"], "no such folder: {d}/typo"),
    "layers-word": (["convert", "{d}/llama", "{d}/out", "--layers", "one"], "'one': give 0-based layers as a range"),
    "layers-range": (["convert", "{d}/llama", "{d}/out", "--layers", "0-9"], "out of range for a model with 2 layers"),
    "convert-gpt2": (["convert", "{d}/gpt2", "{d}/out"], "cannot convert model_type 'gpt2'"),
}


@pytest.mark.parametrize("name", CLI_MISTAKES)
def test_cli_answers_in_one_line(folders, capsys, name):
    arguments, fragment = CLI_MISTAKES[name]
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(d=folders) for a in arguments])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    answer = err.strip().splitlines()[-1]  # loading bars of a model may come first
    assert answer.startswith(f"diff-transformer {arguments[0]}: error: "), err
    assert fragment.format(d=folders) in answer and "Traceback" not in err, err


def test_debug_shows_the_traceback(folders):
    with pytest.raises(ValueError, match="cannot convert model_type 'gpt2'"):
        main(["convert", str(folders / "gpt2"), str(folders / "out"), "--debug"])


def test_help_shows_defaults_and_backends(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "(default: 10000)" in text and "diff_flash" in text and "(default: runs/diff-tiny)" in text


def test_tables_without_matplotlib_and_progress(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    main(["eval-needle", str(folders / "diff"), "--lengths", "100", "--depths", "0", "50", "--needles", "2",
          "--queries", "1", "--samples", "2", "--output", str(tmp_path / "needle")])
    captured = capsys.readouterr()
    assert "| 100 | " in captured.out and "matplotlib is not installed, so no" in captured.out, captured.out
    assert "4/4" in captured.err, "eval-needle shows prompts done of the total"
    assert (tmp_path / "needle.md").is_file() and not (tmp_path / "needle.png").exists()


def test_needle_settings_and_prompts():
    for fields, message in [({"needles": 50}, f"needles must be between 1 and {len(CITIES)}"),
                            ({"needles": 2, "queries": 3}, "queries must be between 1 and needles"),
                            ({"samples": 0}, "samples and digits must be >= 1"), ({"lengths": [0]}, "lengths must be"),
                            ({"depths": [150]}, "depths are percentages")]:
        with pytest.raises(ValueError, match=message):
            NeedleSettings(**fields)
    with pytest.raises(ValueError, match="the tokenizer cannot encode the needle text"):
        build_needle_prompt(KeyValueTask().tokenizer(), 100, 50, NeedleSettings(), random.Random(0))


def test_attention_maps_need_eager(folders):
    model = DiffForCausalLM.from_pretrained(folders / "diff")  # sdpa
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        with capture_branch_attentions(model):
            pass
    settings = NeedleSettings(needles=2, queries=1)
    tokenizer = AutoTokenizer.from_pretrained(folders / "diff")
    prompt = build_needle_prompt(tokenizer, 100, 50, settings, random.Random(0))
    with pytest.raises(ValueError, match="attention_noise reads attention maps.*'sdpa'"):
        attention_noise(model, tokenizer, prompt)
    for top_k, ids, message in [(0, torch.ones(1, 5, dtype=torch.long), "top_k must be at least 1"),
                                (3, torch.ones(1, 0, dtype=torch.long), "input_ids is empty")]:
        with pytest.raises(ValueError, match=message):
            activation_outliers(model, ids, top_k)


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


@pytest.mark.slow
def test_console_script_answers_fast_without_hub(tmp_path):
    """The installed command, online settings (no HF_HUB_OFFLINE): a typo is answered at once, in one line."""
    (tmp_path / "runs").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["PYTHONPATH"] = str(ROOT)
    start = time.monotonic()
    command = [sys.executable, "-m", "diff_transformer_cli", "generate", "runs/typo", "--prompt", "x"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "diff-transformer generate: error: argument model: no such folder: runs/typo" in result.stderr
    assert time.monotonic() - start < 30, "answered only after waiting for the Hub"
