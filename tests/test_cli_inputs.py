"""The command line's input checks: what each command refuses, before any work, in one line naming the fix.

A newcomer's mistakes (mistyped folders, a folder of another model, bad numbers, impossible evaluation settings) get
exit status 2 and no traceback; --debug shows it. Bad input is refused before the work starts: non-finite numbers,
output folders that cannot be written or hold a saved model, prompts and lengths beyond the model's context,
baselines whose tokenizer reads the evaluation text differently, a config.json that is not JSON, broken saved
folders, and what ran silently wrong before (a diverging run, unknown words, NaN weights). Help and argument errors
answer without importing torch. Also what `train` leaves behind: nothing on Ctrl-C, SIGTERM or a full disk; a folder
whose files share one mode, with its training settings recorded for the model card. (The commands' work:
test_cli.py.)"""

import importlib.util
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import saved_folders, tiny_config
from helpers.cli import cli_process_env, run_cases, write_limit
from helpers.folders import planted_pickle, save_llama
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from safetensors.torch import load_file, save_file

from diff_transformer import DiffForCausalLM
from diff_transformer.serving import server
from diff_transformer.tools import hub_upload
from diff_transformer.tools.commands import prompt_tail
from diff_transformer.tools.data import KeyValueTask
from diff_transformer.tools.evaluation import CITIES, FILLER, needle
from diff_transformer.saved_folder import TOKENIZER_FILES
from diff_transformer.tokenization_diff import train_bpe_tokenizer
from diff_transformer_cli import main

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 96  # tokens of the DIFF model's context: room for a 2-needle prompt, short of the defaults' lengths
LONG_PROMPT = " ".join(FILLER * 8)


def english_tokenizer(vocab_size: int):
    texts = list(FILLER) * 20 + [needle(c, str(1000 + i)) for i, c in enumerate(CITIES)] * 3
    return train_bpe_tokenizer(texts=texts + [f"What is the magic number of {c}?" for c in CITIES],
                               vocab_size=vocab_size)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """diff (English BPE tokenizer, a CONTEXT-token context); baselines: same (its tokenizer), other (another BPE
    vocabulary), word (the synthetic task's word-level tokenizer); a file where a folder would go."""
    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    english = english_tokenizer(400)
    model = DiffForCausalLM(tiny_config(vocab_size=len(english), max_position_embeddings=CONTEXT))
    model.save_pretrained(root / "diff")
    english.save_pretrained(root / "diff")
    save_llama(root / "same", english)
    save_llama(root / "other", english_tokenizer(300))
    save_llama(root / "word", KeyValueTask().tokenizer())
    (root / "afile").write_text("not a folder\n")
    return root


def answer(arguments: list[str], capsys) -> str:
    """The one line `main(arguments)` answers with, after checking exit status 2 and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and err.endswith("\n"), err
    line = err.strip().splitlines()[-1]  # loading bars of a model may come first
    assert line.startswith(f"diff-transformer {arguments[0]}: error: "), err
    return line


MISTAKES = {  # name: (arguments, a fragment of the one-line answer); {d} is the folders fixture
    "lr-initials": (["train", "--lr", "0.01"], "train: error: unrecognized arguments: --lr 0.01; did you mean "
                                              "--learning-rate? (see diff-transformer train --help)"),
    "misspelt-option": (["generate", "{d}/diff", "--prompt", "x", "--max-new-tokns=3", "--smaple"],
                        "unrecognized arguments: --max-new-tokns=3 --smaple; did you mean --max-new-tokens for "
                        "--max-new-tokns, --sample for --smaple?"),
    "inf-learning-rate": (["train", "--learning-rate", "inf"], "--learning-rate: 'inf' must be a finite number > 0"),
    "nan-learning-rate": (["train", "--learning-rate", "nan"], "--learning-rate: 'nan' must be a finite number > 0"),
    "inf-minutes": (["train", "--minutes", "Infinity"], "--minutes: 'Infinity' must be a finite number > 0"),
    "nan-depth": (["eval-needle", "{d}/diff", "--depths", "nan"], "'nan' must be a percentage between 0 and 100"),
    "output-under-file": (["train", "--output", "{d}/afile/run"],
                          "--output {d}/afile/run: {d}/afile is a file, so no folder can be made there; choose"),
    "needle-output-under-file": (["eval-needle", "{d}/diff", "--lengths", "64", "--output", "{d}/afile/x/needle"],
                                 "--output {d}/afile/x/needle: {d}/afile is a file"),
    "noise-output-under-file": (["attention-noise", "{d}/diff", "--output", "{d}/afile/noise"],
                                "--output {d}/afile/noise: {d}/afile is a file"),
    "overwrite": (["train", "--output", "{d}/diff"],
                  "--output {d}/diff already holds a saved model (config.json); pass --overwrite to replace it"),
    "long-prompt": (["generate", "{d}/diff", "--prompt", LONG_PROMPT, "--max-new-tokens", "8"],
                    f"more than the context of {{d}}/diff ({CONTEXT} tokens, max_position_embeddings); shorten it, "
                    f"lower --max-new-tokens, or pass --truncate-prompt to keep its last {CONTEXT - 8} tokens"),
    "no-room-to-generate": (["generate", "{d}/diff", "--prompt", "x", "--max-new-tokens", str(CONTEXT)],
                            f"--max-new-tokens {CONTEXT} leaves no room for a prompt in the context of {{d}}/diff"),
    "needle-lengths": (["eval-needle", "{d}/diff", "--lengths", "64", "1024"],
                       f"--lengths 64 1024 asks for 1024 tokens, more than the context of {{d}}/diff ({CONTEXT} "
                       f"tokens, max_position_embeddings); use at most {CONTEXT}"),
    "noise-length": (["attention-noise", "{d}/diff", "--length", "1024", "--output", "{d}/noise"],
                     f"--length 1024 asks for 1024 tokens, more than the context of {{d}}/diff ({CONTEXT} tokens"),
    "outliers-length": (["outliers", "{d}/diff", "--length", "512"], "--length 512 asks for 512 tokens"),
    "noise-word-baseline": (["attention-noise", "{d}/diff", "--baseline", "{d}/word", "--length", "64", "--output",
                             "{d}/noise"], "the tokenizer of {d}/word cannot encode the needle text"),
    "outliers-word-baseline": (["outliers", "{d}/diff", "--baseline", "{d}/word", "--length", "64"],
                               "the tokenizer of {d}/word cannot encode the needle text"),
    "noise-other-baseline": (["attention-noise", "{d}/diff", "--baseline", "{d}/other", "--length", "64",
                              "--output", "{d}/noise"],
                             "the tokenizer of {d}/other encodes the evaluation text differently from {d}/diff's"),
    "outliers-other-baseline": (["outliers", "{d}/diff", "--baseline", "{d}/other", "--length", "64"],
                                "the tokenizer of {d}/other encodes the evaluation text differently"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_refused_in_one_line(folders, capsys, name):
    arguments, fragment = MISTAKES[name]
    line = answer([a.format(d=folders) for a in arguments], capsys)
    assert fragment.format(d=folders) in line, line
    assert not (folders / "noise.md").exists(), "refused before the evaluation ran"


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory) -> Path:
    """diff (English BPE tokenizer), word (the synthetic task's word-level tokenizer), no-tokenizer, gpt2, llama,
    and a binary file (helpers.saved_folders)."""
    return saved_folders(tmp_path_factory.mktemp("mistakes"))


CLI_MISTAKES = {  # name: (arguments, a fragment of the one-line answer); {d} is the mistakes fixture
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
    "embedding-multiplier": (["train", "--embedding-multiplier", "-2"],
                             "argument --embedding-multiplier: '-2': give a number > 0 (1.0: unscaled embeddings)"),
    "embedding-multiplier-word": (["train", "--embedding-multiplier", "root"], "or 'sqrt' (sqrt of --hidden-size)"),
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
def test_cli_answers_in_one_line(mistakes, capsys, name):
    arguments, fragment = CLI_MISTAKES[name]
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(d=mistakes) for a in arguments])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    answer = err.strip().splitlines()[-1]  # loading bars of a model may come first
    assert answer.startswith(f"diff-transformer {arguments[0]}: error: "), err
    assert fragment.format(d=mistakes) in answer and "Traceback" not in err, err


def test_debug_shows_the_traceback(mistakes):
    with pytest.raises(ValueError, match="cannot convert model_type 'gpt2'"):
        main(["convert", str(mistakes / "gpt2"), str(mistakes / "out"), "--debug"])


def test_help_shows_defaults_and_backends(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "(default: 10000)" in text and "diff_flash" in text and "(default: runs/diff-tiny)" in text



FAST = {  # name: arguments answered without importing torch or transformers
    "help": ["--help"],
    "train-help": ["train", "--help"],
    "serve-help": ["serve", "--help"],
    "no-command": [],
    "unknown-option": ["generate", "runs/x", "--prompt", "x", "--tokens", "3"],
    "missing-prompt": ["generate", "runs/x"],
    "inf-learning-rate": ["train", "--learning-rate", "inf"],
    "bad-layers": ["convert", "--layers", "3-1", "runs/x", "out"],
    "missing-folder": ["outliers", "no/such/folder/here"],
    "overwrite": ["train", "--output", "{saved}"],
    "empty-data": ["train", "--data", "empty.txt"],
    "data-folder": ["train", "--data", "saved"],
    "short-data": ["train", "--data", "short.txt", "--block-size", "64"],
    "no-model-type": ["generate", "typeless", "--prompt", "x"],
    "other-model-type": ["outliers", "llama"],
}


@pytest.mark.parametrize("name", FAST)
def test_help_and_argument_errors_import_no_torch(tmp_path, name):
    """`diff-transformer --help` and argument errors answer before torch and transformers are imported (~5 s of CPU
    on a 2-core machine), in a fresh interpreter."""
    for folder, config in (("saved", {}), ("typeless", {"vocab_size": 97}), ("llama", {"model_type": "llama"})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
        (tmp_path / folder / "tokenizer.json").write_text("{}")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("k1 v2 k3 v4\n")
    arguments = [a.format(saved=tmp_path / "saved") for a in FAST[name]]
    code = ("import sys, diff_transformer_cli\n"
            f"try:\n    diff_transformer_cli.main({arguments!r})\nexcept SystemExit as stop:\n"
            "    print('exit', stop.code, sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    expected = "exit 0 []" if "help" in name else "exit 2 []"
    assert result.stdout.strip().endswith(expected), (result.stdout[-500:], result.stderr[-500:])
    assert "Traceback" not in result.stderr, result.stderr


@pytest.fixture
def read_only_folder(tmp_path) -> Iterator[tuple[Path, str]]:
    """A folder nobody may write in, and the reason writing fails: mode 555, or for root (whom modes do not stop) the
    immutable attribute, where the filesystem has it."""
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        yield folder, "Permission denied"
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", folder], capture_output=True).returncode:
        pytest.skip("running as root on a filesystem without chattr +i: no folder is read-only to root")
    try:
        yield folder, "Operation not permitted"
    finally:
        subprocess.run(["chattr", "-i", folder], check=True)


def test_read_only_output_refused(read_only_folder, capsys):
    folder, reason = read_only_folder
    line = answer(["train", "--output", str(folder / "run")], capsys)
    assert f"cannot write in {folder} ({reason}); choose another --output" in line, line


def test_bad_config_json_names_file_and_position(folders, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(folders / "diff", broken)
    (broken / "config.json").write_text('{"model_type": "diff_transformer",\n  "vocab_size": 97,,\n}\n')
    position = "Expecting property name enclosed in double quotes at line 2 column 20"
    for arguments in (["generate", str(broken), "--prompt", "x"], ["eval-needle", str(broken)],
                      ["outliers", str(folders / "diff"), "--baseline", str(broken)]):
        line = answer(arguments, capsys)
        assert f"{broken / 'config.json'} is not valid JSON: {position}; fix it, or save the model again" in line, line
    line = answer(["upload", str(broken), "user/model", "--dry-run"], capsys)
    assert f"{broken / 'config.json'} is not valid JSON: {position}" in line, line


BROKEN_FOLDERS = {  # how a saved folder is broken: the start of the refusal, after the folder's name
    "no-config": " has no config.json, so it is no saved model folder; model.save_pretrained(",
    "config-not-json": "/config.json is not valid JSON: Expecting property name enclosed in double quotes at line 2 "
                       "column 1; fix it, or save the model again with save_pretrained",
    "no-tokenizer": f" has no tokenizer ({' / '.join(TOKENIZER_FILES)}); save the model's tokenizer there with ",
    "no-weights": " has no safetensors weights; load the model and save it again with model.save_pretrained(",
}


def broken_copy(source: Path, folder: Path, case: str) -> Path:
    shutil.copytree(source, folder)
    if case == "no-config":
        (folder / "config.json").unlink()
    elif case == "config-not-json":
        (folder / "config.json").write_text('{"model_type": "diff_transformer",\n')
    for name in TOKENIZER_FILES if case == "no-tokenizer" else ():
        (folder / name).unlink(missing_ok=True)  # tokenizer_config.json stays: settings, no vocabulary
    for path in folder.glob("*.safetensors") if case == "no-weights" else ():
        path.unlink()
    return folder


@pytest.mark.parametrize("case", BROKEN_FOLDERS)
def test_cli_serve_and_upload_refuse_the_same_broken_folders(folders, tmp_path, capsys, case):
    """The command line, `serve` and `upload` check a saved folder with the same functions
    (diff_transformer/saved_folder.py): each refuses the same broken folder in the same line naming the fix."""
    folder = broken_copy(folders / "diff", tmp_path / "model", case)
    line = answer(["generate", str(folder), "--prompt", "x"], capsys)
    with pytest.raises(ValueError) as served:
        server.check_folder(str(folder))
    with pytest.raises(hub_upload.UploadError) as uploaded:
        hub_upload.check_inputs(folder, "user/model")
    message = str(served.value)
    assert message.startswith(f"{folder}{BROKEN_FOLDERS[case]}") and "\n" not in message, message
    assert str(uploaded.value) == message and line.endswith(f"argument model: {message} (see diff-transformer "
                                                            "generate --help)"), (line, str(uploaded.value))


def test_folder_checks_import_no_torch(tmp_path):
    """The command line loads the folder checks without torch, transformers, safetensors or the package's
    __init__, from this checkout, as the module the package's code then shares."""
    code = ("import sys, diff_transformer_cli\n"
            "print(diff_transformer_cli.saved_folder.__file__)\n"
            "print(sys.modules['diff_transformer.saved_folder'] is diff_transformer_cli.saved_folder)\n"
            "print(sorted({'torch', 'transformers', 'safetensors', 'diff_transformer'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.stdout.split("\n")[:3] == [str(ROOT / "diff_transformer" / "saved_folder.py"), "True", "[]"], (
        result.stdout, result.stderr[-2000:])


def test_truncate_prompt_keeps_the_end_with_one_warning(folders, capsys):
    main(["generate", str(folders / "diff"), "--prompt", LONG_PROMPT, "--max-new-tokens", "8", "--truncate-prompt"])
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line.lower()]
    budget = CONTEXT - 8
    assert len(warnings) == 1 and re.fullmatch(
        rf"diff-transformer generate: warning: the prompt is \d+ tokens; kept its last \d+ \(--truncate-prompt\) so "
        rf"that it and --max-new-tokens 8 fit the context of {CONTEXT} tokens", warnings[0]), captured.err
    kept = int(re.search(r"kept its last (\d+)", warnings[0])[1])
    assert budget - 2 <= kept <= budget, warnings[0]
    tail = prompt_tail(AutoTokenizer.from_pretrained(folders / "diff"), LONG_PROMPT, budget)
    assert LONG_PROMPT.endswith(tail) and captured.out.split("generated: ", 1)[1].startswith(tail), captured.out


def test_outliers_tokenize_long_text_without_a_warning(folders, tmp_path, monkeypatch):
    """`outliers` tokenizes more filler text than the context and keeps --length tokens of it: no "Token indices
    sequence length is longer than ... will result in indexing errors" on a correct run (before: printed). In a
    fresh interpreter at transformers' default verbosity, as a user runs it."""
    folder = tmp_path / "diff"
    shutil.copytree(folders / "diff", folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": CONTEXT}))
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")
    [(code, output)] = run_cases([["outliers", str(folder), "--length", str(CONTEXT)]], tmp_path)
    assert code == 0 and "| diff | hidden_states |" in output, output
    assert "indexing errors" not in output and "sequence length is longer" not in output, output


def test_iconv_hint_converts_the_file(tmp_path):
    """The non-UTF-8 hint is a command that works as written (before: `iconv -t utf-8`, which needs `-f`)."""
    if shutil.which("iconv") is None:
        pytest.skip("no iconv on this machine")
    text = "Café, naïve, Zürich\n"
    (tmp_path / "latin.txt").write_bytes(text.encode("latin-1"))
    from diff_transformer.saved_folder import read_text_file

    with pytest.raises(ValueError) as error:
        read_text_file(tmp_path / "latin.txt")
    command = re.search(r"\(e\.g\. (iconv .*)\)$", str(error.value))[1]
    subprocess.run(command, shell=True, cwd=tmp_path, check=True, timeout=30, stdin=subprocess.DEVNULL)
    converted = tmp_path / "latin-utf8.txt"
    assert converted.read_text(encoding="utf-8") == text, converted.read_bytes()


def test_matching_baseline_runs(folders, capsys):
    main(["outliers", str(folders / "diff"), "--baseline", str(folders / "same"), "--length", "64"])
    assert "| baseline | hidden_states |" in capsys.readouterr().out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trained") / "runs" / "tiny"
    main(["train", "--max-steps", "2", "--examples", "64", "--output", str(folder), "--seed", "3"])
    return folder


PROMPT = "k3 v7 k9 v2 ? k9"


def edited_config(source: Path, folder: Path, edit) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def edited_weights(source: Path, folder: Path, edit) -> Path:
    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def edited_files(source: Path, folder: Path, edit) -> Path:
    shutil.copytree(source, folder)
    edit(folder)
    return folder


def pickled_llama(folder: Path) -> None:
    """A Llama folder whose weights are a pickle that runs code (`planted_pickle`) when loaded."""
    shutil.rmtree(folder)
    save_llama(folder, KeyValueTask().tokenizer())
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(planted_pickle(folder.parent / "pwned"))


def truncate_weights(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def set_nan(weights: dict) -> None:
    weights["model.layers.1.mlp.up_proj.weight"].view(-1)[5] = float("nan")


def flip_exponent_bit(weights: dict) -> None:
    """A flipped high exponent bit in one weight: finite, some 1e37."""
    weight = weights["model.layers.0.mlp.down_proj.weight"].view(-1)
    weight[7:8].view(torch.int32).bitwise_xor_(1 << 30)
    assert 1e30 < abs(weight[7].item()) < float("inf"), weight[7]


def swap_tensors(weights: dict) -> None:
    """Two tensors of one shape under each other's names: every shape and value plausible."""
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert weights[q].shape == weights[k].shape
    weights[q], weights[k] = weights[k], weights[q]


ROPE_HALF = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
BROKEN = {  # folder: how it is made from a trained one (config.json, or the weights)
    "rope": ("config", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": -999})),
    "window": ("config", lambda c: c.update(sliding_window=32)),
    "partial": ("config", lambda c: c.update(rope_parameters=ROPE_HALF)),
    "odd": ("config", lambda c: c.update(head_dim=7)),
    "misspelt": ("config", lambda c: c.update(num_heads=8)),
    "huge": ("config", lambda c: c.update(num_hidden_layers=100_000, attention_types=None)),
    "typeless": ("config", lambda c: c.pop("model_type")),
    "nan": ("weights", set_nan),
    "flipped": ("weights", flip_exponent_bit),
    "truncated": ("files", truncate_weights),
    "tokenizer-text": ("files", lambda folder: (folder / "tokenizer.json").write_text("{ not JSON")),
    "pickled": ("files", pickled_llama),
    "swapped": ("weights", swap_tensors),
    "shape": ("weights", lambda w: w.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)})),
}
SILENTLY_WRONG = {  # name: (arguments, a fragment of the one-line answer, where nothing may be written); {d}: folder
    "diverging-training": (["train", "--learning-rate", "1e9", "--max-steps", "50", "--examples", "256",
                            "--output", "{d}/runs/diverged"],
                           "training diverged at step ", "runs"),
    "unknown-words": (["generate", "{d}/model", "--prompt", "k3 v7 你好 😀 ? k9"],
                      "the prompt has words the tokenizer of {d}/model does not know: '你好', '😀' (each would be "
                      "read as <unk>)", None),
    "invalid-rope": (["generate", "{d}/rope", "--prompt", PROMPT],
                     "invalid rope_parameters {{'rope_type': 'linear', 'factor': -999, 'rope_theta': 10000.0}}: factor "
                     "field must be a float or int >= 1, got -999", None),
    "nan-weight": (["generate", "{d}/nan", "--prompt", PROMPT],
                   "{d}/nan has non-finite weights (NaN or inf): model.layers.1.mlp.up_proj.weight (1 of ", None),
    "truncated-weights": (["generate", "{d}/truncated", "--prompt", PROMPT],
                          "{d}/truncated/model.safetensors is truncated or corrupt (Error while deserializing header: "
                          "incomplete metadata, file not fully covered); copy or download the folder again", None),
    "tokenizer-not-json": (["generate", "{d}/tokenizer-text", "--prompt", PROMPT],
                           "{d}/tokenizer-text/tokenizer.json is not valid JSON: Expecting property name enclosed in "
                           "double quotes at line 1 column 3; the file is damaged", None),
    "pickled-weights": (["convert", "{d}/pickled", "{d}/runs/from-pickle"],
                        "refused to load the pickled weights {d}/pickled/pytorch_model.bin: they hold more than "
                        "tensors (torch.load with weights_only=True), and loading a pickle runs code its author chose; "
                        "do not pass weights_only=False: use the model's safetensors weights, or convert it to "
                        "safetensors with a tool you trust (--debug shows the traceback)", "pwned"),
    "flipped-bit": (["generate", "{d}/flipped", "--prompt", PROMPT],
                    "{d}/flipped has weights of absurd magnitude (above 1e+05; trained models stay below 1e3): "
                    "model.layers.0.mlp.down_proj.weight (|w| up to ", None),
    "swapped-tensors": (["generate", "{d}/swapped", "--prompt", PROMPT],
                        "the weights in {d}/swapped were damaged or replaced since they were saved (model.safetensors "
                        "is not the file save_pretrained wrote (its sha256 differs), by weights_sha256.json); copy or "
                        "download the folder again", None),
    "sliding-window": (["generate", "{d}/window", "--prompt", PROMPT],
                       "sliding_window=32 (the model attends to the whole context) is not supported; remove it from "
                       "config.json", None),
    "partial-rotary": (["generate", "{d}/partial", "--prompt", PROMPT],
                       "rope_parameters.partial_rotary_factor=0.5 (the model rotates every dimension of a head) is not "
                       "supported", None),
    "odd-head-dim": (["generate", "{d}/odd", "--prompt", PROMPT], "head_dim (7) must be even", None),
    "huge-config": (["generate", "{d}/huge", "--prompt", PROMPT],
                    "config.json of {d}/huge implies 4,728,002,432 parameters (num_hidden_layers=100000, "
                    "hidden_size=64, intermediate_size=160, vocab_size=37, num_attention_heads=4), but its weight "
                    "files hold 96,992: the fields do not describe these weights", None),
    "misspelt-field": (["generate", "{d}/misspelt", "--prompt", PROMPT],
                       "DiffConfig: unknown field 'num_heads' in config.json; did you mean 'num_noise_heads' or "
                       "'num_key_value_heads' or 'num_attention_heads'? (transformers would keep it as an unused "
                       "attribute); fix or remove it", None),
    "wrong-shape": (["generate", "{d}/shape", "--prompt", PROMPT],
                    "the weights in {d}/shape do not fit its config.json: model.layers.0.self_attn.q_proj.weight: "
                    "[32, 64] in model.safetensors, [64, 64] for config.json", None),
    "no-model-type": (["generate", "{d}/typeless", "--prompt", PROMPT],
                      '{d}/typeless/config.json has no "model_type"; restore "model_type": "diff_transformer" in it',
                      None),
    "no-model-type-baseline": (["outliers", "{d}/model", "--baseline", "{d}/typeless"],
                               'restore "model_type": "diff_transformer"', None),
    "empty-data": (["train", "--data", "{d}/empty.txt", "--output", "{d}/runs/empty"],
                   "--data: {d}/empty.txt is empty; give a text file with the text to train on", "runs"),
    "blank-data": (["train", "--data", "{d}/blank.txt", "--output", "{d}/runs/blank"],
                   "{d}/blank.txt holds only whitespace (3 characters)", "runs"),
    "data-folder": (["train", "--data", "{d}/model", "--output", "{d}/runs/folder"],
                    "--data: {d}/model is a folder, not a text file", "runs"),
    "short-data": (["train", "--data", "{d}/short.txt", "--output", "{d}/runs/short"],
                   "--data {d}/short.txt has 12 bytes, fewer than the 127 tokens of text in one block of --block-size "
                   "128; give a longer file or --block-size 13", "runs"),
    "block-size-without-data": (["train", "--max-steps", "5", "--block-size", "100000", "--output", "{d}/runs/bs"],
                                "--block-size applies to --data (the built-in task sets its own sequences and "
                                "vocabulary) only; drop --block-size", "runs"),
    "examples-with-data": (["train", "--data", "{d}/corpus.txt", "--examples", "10", "--output", "{d}/runs/ex"],
                           "--examples applies to the built-in task (--data trains on the file's text) only; drop "
                           "--examples", "runs"),
    "tiny-vocabulary": (["train", "--data", "{d}/corpus.txt", "--vocab-size", "10", "--output", "{d}/runs/vocab"],
                        "--vocab-size 10 is smaller than the tokenizer's fixed entries (256 bytes and 4 special "
                        "tokens); use --vocab-size 260 or more", "runs"),
    "tiny-chat-vocabulary": (["train", "--data", "{d}/corpus.txt", "--vocab-size", "262", "--chat-template",
                              "--output", "{d}/runs/chat"],
                             "(256 bytes and 7 special tokens); use --vocab-size 263 or more", "runs"),
    "block-size-one": (["train", "--data", "{d}/corpus.txt", "--block-size", "1", "--output", "{d}/runs/one"],
                       "--block-size 1 leaves no room for text: a block is <s> and --block-size - 1 tokens of the "
                       "file; use --block-size 2 or more", "runs"),
    "max-new-tokens-beyond-context": (["generate", "{d}/model", "--prompt", PROMPT, "--max-new-tokens", "100000"],
                                      "--max-new-tokens 100000 leaves no room for a prompt in the context of "
                                      "{d}/model (256 tokens, max_position_embeddings); use at most 249: the prompt "
                                      "takes 7 of its tokens", None),
    "adapter-only": (["generate", "{d}/adapter", "--prompt", PROMPT],
                     "argument model: {d}/adapter holds a PEFT adapter (adapter_config.json), not a model; merge it "
                     "into its base model ({d}/model) and save the result with its tokenizer: "
                     "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{d}/model'), "
                     "'{d}/adapter').merge_and_unload()."
                     "save_pretrained(OUT), then tokenizer.save_pretrained(OUT)", None),
    "resume-without-checkpoint": (["train", "--resume", "--output", "{d}/runs/none"],
                                  "--resume: --output {d}/runs/none holds no checkpoint (checkpoint-STEP folder) to "
                                  "continue from; drop --resume to start a new run", "runs"),
    "checkpoints-without-resume": (["train", "--output", "{d}/unfinished"],
                                   "--output {d}/unfinished holds checkpoints of an unfinished run (the last: "
                                   "checkpoint-12); pass --resume to continue it, or --overwrite to start a new run",
                                   None),
    "data-inside-output": (["train", "--data", "{d}/model/corpus.txt", "--output", "{d}/model", "--overwrite"],
                           "--output {d}/model holds the --data file {d}/model/corpus.txt, and the model replaces the "
                           "folder whole; choose another --output", None),
}


@pytest.fixture(scope="module")
def silently_wrong(trained, tmp_path_factory) -> tuple[Path, dict[str, tuple[int, str]]]:
    """Every SILENTLY_WRONG case, run once in a fresh interpreter with no standard input."""
    root = tmp_path_factory.mktemp("broken")
    shutil.copytree(trained, root / "model")
    for name, (part, edit) in BROKEN.items():
        {"config": edited_config, "weights": edited_weights, "files": edited_files}[part](trained, root / name, edit)
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text(" \n\n")
    (root / "short.txt").write_text("k1 v2 k3 v4\n")
    (root / "corpus.txt").write_text("\n".join(KeyValueTask().texts(100)) + "\n")
    shutil.copyfile(root / "corpus.txt", root / "model" / "corpus.txt")
    lora = get_peft_model(DiffForCausalLM.from_pretrained(root / "model"), LoraConfig(r=2))
    lora.save_pretrained(root / "adapter")  # the adapter only, with the base model's path
    for step in (3, 12):  # by step, not by name
        (root / "unfinished" / f"checkpoint-{step}").mkdir(parents=True)
    cases = [[a.format(d=root) for a in arguments] for arguments, _, _ in SILENTLY_WRONG.values()]
    return root, dict(zip(SILENTLY_WRONG, run_cases(cases, root)))


@pytest.mark.parametrize("name", SILENTLY_WRONG)
def test_silently_wrong_refused(silently_wrong, name):
    """What ran without a word (a NaN model saved, an answer from <unk>, a bad rope factor, NaN weights, an ignored
    window), what failed with a traceback or waited on stdin, and --data that is no text: exit status 2, one line
    naming the problem and the fix, nothing written."""
    root, results = silently_wrong
    _, fragment, written = SILENTLY_WRONG[name]
    code, err = results[name]
    line = err.strip().splitlines()[-1] if err.strip() else ""
    assert code == 2 and "Traceback" not in err and "[y/N]" not in err, (code, err[-3000:])
    assert line.startswith(f"diff-transformer {SILENTLY_WRONG[name][0][0]}: error: "), err[-3000:]
    assert fragment.format(d=root) in line, line
    if written is not None:
        assert not (root / written).exists(), list((root / written).rglob("*"))
    assert not list(root.glob(".*incomplete*")), "a staging folder was left behind"


def test_one_line_for_weights_of_the_wrong_shape(silently_wrong):
    """Weights that do not fit config.json: the one line only (before: after transformers' load report, seven lines
    with colour codes)."""
    code, err = silently_wrong[1]["wrong-shape"]
    assert code == 2 and len(err.strip().splitlines()) == 1 and "\x1b[" not in err, err


def test_adapter_hint_makes_a_model(silently_wrong, tmp_path, capsys):
    """The refusal of an adapter-only folder names the calls that make a model of it; made so, it generates."""
    root, _ = silently_wrong
    merged = tmp_path / "merged"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model"), root / "adapter") \
        .merge_and_unload().save_pretrained(merged)
    AutoTokenizer.from_pretrained(root / "model").save_pretrained(merged)
    main(["generate", str(merged), "--prompt", PROMPT, "--max-new-tokens", "2"])
    assert capsys.readouterr().out.split("generated: ", 1)[1].startswith(PROMPT)


def test_max_new_tokens_hint_is_the_most_that_fits(silently_wrong, capsys):
    """`generate --max-new-tokens 100000` names the most that fit with the prompt counted (before: the context less
    one, which a second refusal then answered); that number generates, one more is refused."""
    root, results = silently_wrong
    most = int(re.search(r"use at most (\d+): ", results["max-new-tokens-beyond-context"][1])[1])
    line = answer(["generate", str(root / "model"), "--prompt", PROMPT, "--max-new-tokens", str(most + 1)], capsys)
    assert f"the prompt is 7 tokens, and with --max-new-tokens {most + 1} needs 257, more than the context" in line
    main(["generate", str(root / "model"), "--prompt", PROMPT, "--max-new-tokens", str(most)])
    assert capsys.readouterr().out.split("generated: ", 1)[1].startswith(PROMPT)


def test_smallest_vocabulary_is_what_bpe_keeps(tmp_path):
    """The --vocab-size floor the command line names is the size a byte-level BPE tokenizer has before any merge:
    asked for it, the tokenizer has exactly that many entries, and asked for less, it has them anyway."""
    from diff_transformer.tokenization_diff import CHAT_TOKENS
    from diff_transformer_cli import smallest_vocabulary

    texts = KeyValueTask().texts(50)
    for chat in (False, True):
        smallest = smallest_vocabulary(chat)
        extra = {"extra_special_tokens": CHAT_TOKENS} if chat else {}
        assert len(train_bpe_tokenizer(texts=texts, vocab_size=smallest, **extra)) == smallest
        assert len(train_bpe_tokenizer(texts=texts, vocab_size=10, **extra)) == smallest
    assert (smallest_vocabulary(False), smallest_vocabulary(True)) == (260, 263)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA GPU the fused backends may run")
def test_backend_this_machine_lacks_refused_before_work(tmp_path):
    """--attn-implementation diff_flash / flash_attention_2 on a CPU: refused before the data is built (before: after
    43 s, and then a second refusal once triton was installed), naming the backend that runs here."""
    cases = [["train", "--attn-implementation", name, "--output", str(tmp_path / "runs" / name)]
             for name in ("diff_flash", "flash_attention_2")]
    triton = importlib.util.find_spec("triton") is not None
    reasons = ["no CUDA GPU" if triton else "triton is not installed (",
               "no CUDA GPU" if importlib.util.find_spec("flash_attn") else "the flash_attn package is not installed"]
    for (code, err), arguments, reason in zip(run_cases(cases, tmp_path, unset=("TRITON_INTERPRET",)), cases, reasons):
        line = err.strip().splitlines()[-1]
        assert code == 2 and "training sequences" not in err, err[-3000:]
        assert line.startswith(f"diff-transformer train: error: --attn-implementation {arguments[2]} cannot run on "
                               f"this machine ({reason}"), line
        assert line.endswith("; use --attn-implementation sdpa (see diff-transformer train --help)"), line
    assert not (tmp_path / "runs").exists()


def test_no_question_on_a_terminal(silently_wrong):
    """With a terminal on stdin, a folder without model_type made transformers ask `[y/N]` whether to run its code
    (twice, 36 s): `generate` and `convert` name the fix at once, while checking their arguments."""
    root, _ = silently_wrong
    leader, follower = pty.openpty()
    try:
        cases = [["generate", f"{root}/typeless", "--prompt", PROMPT], ["convert", f"{root}/typeless", f"{root}/out"]]
        results = run_cases(cases, root, stdin=follower)
    finally:
        os.close(follower)
        os.close(leader)
    for arguments, (code, err) in zip(cases, results):
        assert code == 2 and "[y/N]" not in err and "Traceback" not in err, (arguments, code, err[-3000:])
    for _, err in results:
        assert 'restore "model_type": "diff_transformer"' in err.strip().splitlines()[-1], err
    assert not (root / "out").exists()


def cli_process(arguments: list[str], cwd: Path, **options) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "diff_transformer_cli", *arguments], cwd=cwd, env=cli_process_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **options)


def test_failed_save_leaves_nothing(tmp_path):
    """The weights cannot be written (a full disk): one line naming the folder and the space it needs, and no folder
    that blocks the rerun or looks like a model (before: a traceback and a config.json without weights)."""
    process = cli_process(["train", "--max-steps", "2", "--examples", "64", "--output", "runs/full"], tmp_path,
                          preexec_fn=write_limit(50_000))  # config.json fits, the weights do not
    err, _ = process.communicate(timeout=300)
    assert process.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert re.search(r"\ndiff-transformer train: error: could not write runs/full: File too large; it needs about "
                     r"[\d.]+ KB and .* are free there; nothing was written: free some space, or choose another "
                     r"--output \(while saving; nothing saved\) \(--debug shows the traceback\)\n$", err), err
    assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))


def wait_for_line(process: subprocess.Popen, chunks: list[str], pattern: str, timeout: float = 300) -> None:
    """Until the child's output (read into `chunks` by a `read_stream` thread) has a line matching `pattern`."""
    deadline = time.monotonic() + timeout  # a loaded 2-core machine takes a minute or more to import torch
    while not re.search(pattern, "".join(chunks), flags=re.MULTILINE):
        assert process.poll() is None and time.monotonic() < deadline, "".join(chunks)[-3000:]
        time.sleep(0.1)


def interrupted_run(arguments: list[str], cwd: Path, after: str, signum: int) -> tuple[int, str]:
    """Exit status and output of `arguments`, sent `signum` once a line matches `after`."""
    process = cli_process(arguments, cwd)
    chunks: list[str] = []
    reader = threading.Thread(target=read_stream, args=(process.stdout, chunks), daemon=True)
    reader.start()
    try:
        wait_for_line(process, chunks, after)
        process.send_signal(signum)
        process.wait(timeout=120)
    finally:
        process.kill()
    reader.join(timeout=10)
    return process.returncode, "".join(chunks)


def logged_losses(output: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+)/\d+: loss (\d+\.\d+)$", output,
                                                                  flags=re.MULTILINE)}


# A run of 200 steps that logs every 10 (Trainer's logging_steps for it) and prints every log (--progress-seconds 0),
# checkpointing every 5 steps and keeping the last 2.
RESUMABLE = ["train", "--max-steps", "200", "--examples", "8000", "--seed", "1", "--progress-seconds", "0",
             "--save-steps", "5", "--save-total-limit", "2"]
# The resumed run's losses equal the uninterrupted run's to the 4 printed decimals (measured: no difference at any
# step); the bound allows 2 units of the last printed digit, for rounding on another CPU.
RESUME_TOLERANCE = 2e-4


def test_sigterm_saves_a_checkpoint_and_resume_matches(tmp_path, capsys):
    """`kill -TERM` mid-training: the step finishes, a checkpoint of it is saved (with the last --save-total-limit
    of the --save-steps ones), one line says where and how to continue (exit 143 = 128 + SIGTERM), and no model
    folder is written. `--resume` then continues with the same data order, optimizer, scheduler and RNG: each loss
    it logs equals the uninterrupted run's at the same step. Off a terminal progress comes as plain lines at every
    log with --progress-seconds 0 (before: one per quarter of the run, and nothing saved on a stop)."""
    main([*RESUMABLE, "--output", str(tmp_path / "runs" / "full")])
    full = logged_losses(capsys.readouterr().out)
    assert sorted(full) == list(range(10, 201, 10)), full

    code, output = interrupted_run([*RESUMABLE, "--output", "runs/r"], tmp_path, r"^step 20/200: loss", signal.SIGTERM)
    assert code == 143 and "Traceback" not in output and "\r" not in output, output[-3000:]
    stopped = re.search(r"\ndiff-transformer train: terminated \(SIGTERM\) at step (\d+) of 200; saved "
                        r"runs/r/checkpoint-(\d+): run the same command with --resume to continue from it\n$", output)
    assert stopped and stopped[1] == stopped[2], output[-3000:]
    step = int(stopped[1])
    kept = sorted({*range(5, step + 1, 5), step})[-2:]  # --save-steps 5, --save-total-limit 2, and the stop's
    assert sorted(p.name for p in (tmp_path / "runs" / "r").iterdir()) == [f"checkpoint-{k}" for k in kept]

    resumed = subprocess.run([sys.executable, "-m", "diff_transformer_cli", *RESUMABLE, "--output", "runs/r",
                              "--resume"], cwd=tmp_path, env=cli_process_env(), stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"trained steps {step + 1}-200 in " in resumed.stdout, resumed.stdout
    after = logged_losses(resumed.stdout)
    assert sorted(after) == [s for s in range(10, 201, 10) if s > step], after
    whole_windows = [s for s in after if s - 10 >= step]  # logs whose 10 steps all ran after the checkpoint
    differences = {s: abs(after[s] - full[s]) for s in whole_windows}
    assert max(differences.values()) <= RESUME_TOLERANCE, differences
    folder = tmp_path / "runs" / "r"
    assert (folder / "config.json").is_file() and not list(folder.glob("checkpoint-*")), sorted(folder.iterdir())
    assert json.loads((folder / "training_args.json").read_text())["resumed_from_step"] == step


def test_saved_folder_serves_generate_defaults(trained):
    """No demo setting in generation_config.json (it held max_length 8, so generate() with defaults failed on a
    4-pair prompt): the tokenizer's special tokens and the context; no pickled training_args.bin beside the model."""
    generation = json.loads((trained / "generation_config.json").read_text())
    config = json.loads((trained / "config.json").read_text())
    expected = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                "max_new_tokens": config["max_position_embeddings"] // 2}
    assert {key: generation.get(key) for key in expected} == expected, generation
    assert not (trained / "training_args.bin").exists(), sorted(p.name for p in trained.iterdir())
    tokenizer = AutoTokenizer.from_pretrained(trained)
    model = DiffForCausalLM.from_pretrained(trained).eval()
    ids = tokenizer("k1 v2 k3 v4 k5 v6 k7 v8 ? k3", return_tensors="pt")
    output = model.generate(**ids, do_sample=False)
    assert output.shape[1] > ids["input_ids"].shape[1], output


def test_overwrite_replaces_a_saved_model(trained, capsys):
    first = (trained / "model.safetensors").read_bytes()
    main(["train", "--max-steps", "2", "--examples", "64", "--output", str(trained), "--seed", "4", "--overwrite"])
    assert "saved to" in capsys.readouterr().out
    assert (trained / "model.safetensors").read_bytes() != first


def test_saved_files_share_one_mode(trained, tmp_path):
    umask = os.umask(0)  # read the umask (the test runs in one thread)
    os.umask(umask)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in trained.iterdir()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    previous = os.umask(0o027)
    try:
        DiffForCausalLM(tiny_config()).save_pretrained(tmp_path / "group")
    finally:
        os.umask(previous)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in (tmp_path / "group").iterdir()}
    assert set(modes.values()) == {oct(0o640)}, modes


def test_model_card_records_training(tmp_path):
    folder = tmp_path / "runs" / "tiny"  # its own run: `trained` is overwritten by another test
    main(["train", "--max-steps", "2", "--examples", "64", "--output", str(folder), "--seed", "4"])
    config = hub_upload.check_inputs(folder, "user/tiny")
    card = str(hub_upload.model_card(folder, "user/tiny", config, "mit"))
    assert ("Trained with `diff-transformer train` on the built-in synthetic key/value retrieval task: 2 optimizer "
            "steps, mean training loss ") in card, card
    assert "| `--learning-rate` | `0.005` |" in card and "| `--seed` | `4` |" in card, card
    DiffForCausalLM(tiny_config()).save_pretrained(tmp_path / "untrained")
    details = hub_upload.training_details(tmp_path / "untrained")
    assert details.startswith("How this model was trained (data, steps, settings) is unknown") and "Not " not in details


def read_stream(stream, chunks: list[str]) -> None:
    while line := stream.readline():  # off a terminal, progress comes in whole lines
        chunks.append(line)


@pytest.mark.slow
def test_ctrl_c_during_training(tmp_path):
    """A real SIGINT once training logs steps: one line, exit 130, a checkpoint to resume from and no model folder;
    a second SIGINT while the step finishes stops at once."""
    arguments = ["train", "--max-steps", "100000", "--examples", "256", "--seed", "0", "--output", "runs/made/here"]
    code, output = interrupted_run(arguments, tmp_path, r"step \d+/100000: loss", signal.SIGINT)
    assert code == 130 and "Traceback" not in output, output[-3000:]
    stopped = re.search(r"\ndiff-transformer train: interrupted at step (\d+) of 100000; saved "
                        r"runs/made/here/checkpoint-(\d+): run the same command with --resume", output)
    assert stopped and stopped[1] == stopped[2], output[-3000:]
    folder = tmp_path / "runs" / "made" / "here"
    assert [p.name for p in folder.iterdir()] == [f"checkpoint-{stopped[1]}"], "no model folder, no staging folder"
    assert not list(folder.parent.glob(".here.incomplete-*"))


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

