"""The command line at work: each command's parser and runner, `train` then `generate`.

`train` saves a folder that reloads through the Auto classes and `generate` continues a prompt with it, on the built-in
retrieval task and on a user's text file. Short runs: these check the plumbing of the README's main job, not how well it
learns. What the commands refuse: test_cli_inputs.py."""

import json
import math
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from diff_transformer import DiffForCausalLM
from diff_transformer_cli import COMMANDS, PARSERS, build_parser, main, runner


def greedy_continuation(folder: Path, prompt: str, new_tokens: int) -> str:
    """The prompt continued by plain greedy argmax decoding of the saved folder, without `pipeline` or `generate`,
    up to and including `</s>` (the folder's generation config stops there)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    start = ids.shape[1]
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
            if ids[0, -1] == tokenizer.eos_token_id:
                break
    # as pipeline's return_full_text joins them, special tokens skipped
    return prompt + tokenizer.decode(ids[0, start:], skip_special_tokens=True)


def generated_line(output: str) -> str:
    """The text after the last "generated: ", which may span lines; print's closing newline dropped."""
    return output.rsplit("generated: ", 1)[1].removesuffix("\n")


def test_each_command_has_one_parser_and_one_runner():
    """PARSERS and COMMANDS are the tables of commands: each parser adds one subcommand, which runs the function
    COMMANDS names for it."""
    names = list(build_parser()._subparsers._group_actions[0].choices)
    assert len(names) == len(PARSERS) == len(set(names)) and names == list(COMMANDS), (names, list(COMMANDS))
    for name in names:
        assert callable(runner(name)) and runner(name).__name__ == COMMANDS[name].rpartition(":")[2], name


def test_train_default_task_then_generate(tmp_path, capsys):
    folder = tmp_path / "tiny"
    main(["train", "--max-steps", "30", "--examples", "500", "--output", str(folder), "--bf16"])  # bf16 on CPU
    output = capsys.readouterr().out
    assert "reloaded through AutoModelForCausalLM: DiffForCausalLM" in output, output
    assert "using 1 CPU thread (auto for a 0.10M-parameter model" in output, output
    quarters = re.findall(r"^step (\d+)/30: loss \d+\.\d{4}$", output, flags=re.MULTILINE)
    # a few lines, not every log: off a terminal (as here) the first log's too, to show that training started
    assert quarters == ["1", "8", "15", "23", "30"] and "{'loss'" not in output, output
    accuracy = re.search(r"^retrieval accuracy on held-out prompts: ([01]\.\d{3})$", output, flags=re.MULTILINE)
    assert accuracy, output
    stored = json.loads((folder / "eval_results.json").read_text())["results"]
    assert [(r["metric"], round(r["value"], 3)) for r in stored] == [("accuracy", float(accuracy.group(1)))]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(model, DiffForCausalLM)
    # the built-in task's recipe (benchmarks/RESULTS.md, per seed): unscaled embeddings, written to config.json
    assert model.config.embedding_multiplier == 1.0
    assert json.loads((folder / "config.json").read_text())["embedding_multiplier"] == 1.0

    prompt = "k3 v7 k9 v2 ? k9"
    main(["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "2"])
    got = generated_line(capsys.readouterr().out)
    assert got == greedy_continuation(folder, prompt, 2), got


def test_train_text_file_then_generate(shakespeare, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(shakespeare.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    folder = tmp_path / "text"
    main(["train", "--data", str(corpus), "--max-steps", "10", "--block-size", "32", "--vocab-size", "300",
          "--output", str(folder), "--max-new-tokens", "4"])
    output = capsys.readouterr().out
    assert "reloaded through AutoModelForCausalLM: DiffForCausalLM" in output, output
    assert len(AutoTokenizer.from_pretrained(folder)) == 300
    # on text, the package's default initialisation: embeddings x sqrt(hidden)
    assert json.loads((folder / "config.json").read_text())["embedding_multiplier"] == math.sqrt(64)

    main(["generate", str(folder), "--prompt", "ROMEO:", "--max-new-tokens", "4"])
    got = generated_line(capsys.readouterr().out)
    assert got == greedy_continuation(folder, "ROMEO:", 4), got


def test_embedding_multiplier_option_round_trips(tmp_path, capsys):
    """--embedding-multiplier reaches the model's forward through config.json, and training_args.json records it."""
    folder = tmp_path / "scaled"
    main(["train", "--max-steps", "2", "--examples", "64", "--output", str(folder), "--embedding-multiplier", "2.5"])
    capsys.readouterr()
    assert json.loads((folder / "config.json").read_text())["embedding_multiplier"] == 2.5
    assert json.loads((folder / "training_args.json").read_text())["options"]["embedding_multiplier"] == 2.5
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[1, 2, 3]])
    # the first layer reads 2.5 x the embedding rows (an independent lookup of the saved matrix)
    torch.testing.assert_close(model.get_input_embeddings()(ids), 2.5 * model.model.embed_tokens.weight[ids])
