"""Uploading to the Hub: `diff-transformer upload` and `python hub_upload.py`, the same command.

--dry-run prepares a folder that loads without the package, with the defaults clients expect and a valid model card;
docs/ecosystem.md's and the card's client calls run as written; clear errors for bad input. `python hub_upload.py`
from a checkout is `diff-transformer upload`: the same parser and help, answered before torch or transformers is
imported."""


import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import file_hashes
from helpers.folders import save_tiny_folder
from helpers.without_package import client_results, run_without_package

from diff_transformer.peft_defaults import LORA_TARGET_MODULES
from diff_transformer.tools import hub_upload
from diff_transformer_cli import main

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 32


def run_upload(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    command = [sys.executable, "-m", "diff_transformer_cli", "upload", *args]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def upload_exit_code(args: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["upload", *args])
    return exit_info.value.code


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = save_tiny_folder(tmp_path_factory.mktemp("hub") / "model")
    for name in ("modeling_diff.py", "configuration_diff.py"):
        (folder / name).unlink()  # the script must put the code back
    config = json.loads((folder / "config.json").read_text())
    config.pop("auto_map")
    config["base_model"] = "meta-llama/Llama-3.2-1B"  # what a converter records
    config["use_cache"] = False  # as Trainer.save_model wrote it in older releases of this package
    config["max_position_embeddings"] = CONTEXT  # a short context keeps generation with the folder's defaults short
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").unlink()
    torch.save({"output_dir": "runs/x"}, folder / "training_args.bin")  # as Trainer.save_model writes it
    (folder / "notes.py").write_text("print('a script of the user, no model code')\n")
    result = run_upload(folder.name, "someone/diff-tiny", "--dry-run", cwd=folder.parent)  # relative, as in docs/
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, result


def test_dry_run_writes_code_and_auto_map(prepared):
    folder, result = prepared
    assert "dry run" in result.stdout, result.stdout
    # the check's success in the user's words: the class it loads as, not the check's marker or a module path
    assert re.search(r"; it loads with trust_remote_code=True as DiffForCausalLM\n", result.stdout), result.stdout
    assert "REMOTE_OK" not in result.stdout and "transformers_modules" not in result.stdout, result.stdout
    assert "custom code" not in result.stdout + result.stderr, "a trust_remote_code prompt leaked into the output"
    for name in ("modeling_diff.py", "configuration_diff.py", "kernel_diff_flash.py", "kernel_tiled.py"):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_diff.DiffForCausalLM"
    assert config["use_cache"] is True, "use_cache=False must not reach the Hub"


def test_dry_run_writes_generation_defaults(prepared):
    folder = prepared[0]
    generation = json.loads((folder / "generation_config.json").read_text())
    expected = {"bos_token_id": 1, "pad_token_id": 0, "max_new_tokens": CONTEXT // 2}  # tiny_config has no eos
    assert {key: generation.get(key) for key in expected} == expected, generation


def test_model_card_metadata(prepared):
    text = (prepared[0] / "README.md").read_text()
    assert text.startswith("---\n")
    metadata = yaml.safe_load(text.split("---\n")[1])
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert metadata["license"] == "mit" and "diff-transformer" in metadata["tags"]
    assert metadata["base_model"] == "meta-llama/Llama-3.2-1B"
    assert "trust_remote_code=True" in text and "| `hidden_size` | `64` |" in text
    assert "model-index" not in metadata and "Nothing measured on this folder" in text  # nothing invented


def test_model_index_from_the_folders_stored_evaluation(tmp_path):
    """eval_results.json (what `diff-transformer train` measured) becomes the card's model-index, which
    huggingface_hub parses back to the stored value."""
    from huggingface_hub.repocard_data import model_index_to_eval_results

    folder = save_tiny_folder(tmp_path / "model")
    stored = {"task": "text-generation", "dataset": "diff-transformer key/value retrieval (built-in, synthetic)",
              "dataset_config": "16 keys, 2 pairs", "split": "held-out prompts", "metric": "accuracy",
              "value": 0.985, "command": "diff-transformer train"}
    (folder / "eval_results.json").write_text(json.dumps({"results": [stored]}))
    result = run_upload(str(folder), "someone/diff-tiny", "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    text = (folder / "README.md").read_text()
    name, results = model_index_to_eval_results(yaml.safe_load(text.split("---\n")[1])["model-index"])
    assert name == "diff-tiny" and len(results) == 1
    assert (results[0].metric_type, results[0].metric_value, results[0].dataset_split) == (
        "accuracy", 0.985, "held-out prompts")
    assert ("| diff-transformer key/value retrieval (built-in, synthetic) | held-out prompts | accuracy | 0.985 |"
            in text)


def test_folder_loads_without_package(prepared, tmp_path):
    folder = prepared[0]
    batch = torch.tensor([[1, 5, 9, 12]])
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM, pipeline
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            torch.save(model(torch.tensor({batch.tolist()})).logits, {str(tmp_path / 'logits.pt')!r})
        out = pipeline("text-generation", model={str(folder)!r}, trust_remote_code=True)("k1 v2", max_new_tokens=3)
        print("REMOTE_OK", out[0]["generated_text"])
    """)
    output = run_without_package(script, tmp_path)
    assert "REMOTE_OK k1 v2" in output, output
    from diff_transformer import DiffForCausalLM

    with torch.no_grad():
        expected = DiffForCausalLM.from_pretrained(folder).eval()(batch).logits
    actual = torch.load(tmp_path / "logits.pt")
    assert torch.equal(actual, expected), f"max abs diff {(actual - expected).abs().max():.3e}"


def test_dry_run_folder_in_client_without_package(prepared, tmp_path):
    result = client_results(prepared[0], "k1 v2 ? k1", chat=False, tmp_path=tmp_path)
    assert result["tokenizer"].startswith("transformers.") and result["lora"] == sorted(LORA_TARGET_MODULES), result
    for generated in (result["generated"], result["greedy"]):
        assert len(result["prompt_ids"]) < len(generated) <= CONTEXT, f"{len(generated)} tokens, context {CONTEXT}"


# Appended to the documented calls: what they must have given.
DOCUMENTED_CALLS_CHECK = """
assert type(tokenizer).__module__.startswith("transformers."), f"tokenizer from custom code: {type(tokenizer)}"
wrapped = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")})
assert wrapped == sorted(%r), wrapped
print("CALLS_OK")
""" % LORA_TARGET_MODULES


def documented_calls(markdown: str, repo_id: str, folder: Path) -> str:
    """The python blocks of a markdown text that need no `diff_transformer`, pointed at a local folder."""
    blocks = re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)
    code = "\n".join(block for block in blocks if "diff_transformer" not in block)
    assert f'"{repo_id}"' in code, f"no client calls for {repo_id} in:\n{markdown}"
    return code.replace(f'"{repo_id}"', repr(str(folder)))


def test_readme_and_model_card_calls_run_without_package(prepared, tmp_path):
    folder = prepared[0]
    section = (ROOT / "docs" / "ecosystem.md").read_text().split("\n## Publishing to the Hub\n")[1].split("\n## ")[0]
    readme = documented_calls(section, "my-user/diff-tiny", folder) + DOCUMENTED_CALLS_CHECK
    card = documented_calls((folder / "README.md").read_text(), "someone/diff-tiny", folder) + DOCUMENTED_CALLS_CHECK
    output = run_without_package(readme + card, tmp_path)
    assert output.count("CALLS_OK") == 2, output


def test_pickled_files_left_out(prepared, monkeypatch):
    """A pickled file runs code when loaded: the upload leaves it out, and says so."""
    folder, result = prepared
    assert ("diff-transformer upload: warning: not uploading training_args.bin: pickled files run code when loaded, "
            "and the model needs none of them") in result.stderr, result.stderr
    calls = []

    class Hub:  # stands in for the Hub's API (no network here); the upload's own code runs as written
        def __init__(self, token):
            pass

        def create_repo(self, *args, **kwargs):
            pass

        def upload_folder(self, **kwargs):
            calls.append(kwargs)
            return type("Commit", (), {"commit_url": "https://hf.co/someone/x/commit/0"})()

    monkeypatch.setattr(hub_upload, "HfApi", Hub)
    hub_upload.upload(folder, "someone/x", private=False, token="token")
    uploaded = set(calls[0]["allow_patterns"])
    assert hub_upload.pickled_files(folder) == ["training_args.bin"]
    code = {source.name for source in hub_upload.code_files()}
    expected = code | {"config.json", "generation_config.json", "README.md", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json", "weights_sha256.json"}
    assert expected <= uploaded and not uploaded & {"training_args.bin", "notes.py"}, uploaded
    assert uploaded - expected <= {"special_tokens_map.json", "chat_template.jinja"}, uploaded - expected


def test_other_python_files_left_out(prepared):
    """A .py file of the user's that is not the package's model code is neither run nor uploaded (before: uploaded
    beside the model code), and the dry run says so; the card names the code it asks readers to trust."""
    folder, result = prepared
    assert ("diff-transformer upload: note: not uploading notes.py: only the package's code, the weights, tokenizer, "
            "configs and card are published") in result.stderr, result.stderr
    assert "notes.py" not in hub_upload.published_files(folder)
    card = (folder / "README.md").read_text()
    assert "`modeling_diff.py`" in card and "notes.py" not in card, card


# A planted module: imported, it writes the user's HF_TOKEN into the file {marker}.
EVIL = """
import os
from pathlib import Path
Path({marker!r}).write_text(str(os.environ.get("HF_TOKEN")))
from transformers import PreTrainedTokenizerFast, PreTrainedModel
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilModel(PreTrainedModel):
    pass
"""
PLANTED = {  # file: the auto_map entry added to it
    "tokenizer_config.json": {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]},
    "config.json": {"AutoModelForMaskedLM": "evil.EvilModel"},
}


@pytest.mark.parametrize("where", PLANTED)
def test_folder_code_never_runs(tmp_path, where):
    """An auto_map in the folder naming its own evil.py: refused in one line before any work, evil.py never imported
    (the token never reaches the marker file), the folder unchanged. Before: the loadability check imported the
    tokenizer's module in a child with the user's HF_TOKEN, and a config.json entry was uploaded with evil.py."""
    folder = save_tiny_folder(tmp_path / "model")
    marker = tmp_path / "stolen-token"
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    settings = json.loads((folder / where).read_text())
    settings["auto_map"] = {**settings.get("auto_map", {}), **PLANTED[where]}
    (folder / where).write_text(json.dumps(settings))
    before = file_hashes(folder)
    result = run_upload(str(folder), "someone/x", "--dry-run", env={"HF_TOKEN": "hf_planted_secret"})
    assert not marker.exists(), f"the folder's code ran and wrote {marker.read_text()!r}"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr[-3000:]
    entry = next(iter(PLANTED[where].items()))
    assert result.stderr.strip().splitlines() == [
        f"diff-transformer upload: error: {folder} names code that is not the diff_transformer package's ({where}: "
        f"auto_map {entry[0]}={entry[1]!r}); upload publishes only the package's model code and runs none from the "
        "folder: remove those entries (a DIFF model and its tokenizer need none) (--debug shows the traceback)"
    ], result.stderr
    assert file_hashes(folder) == before, "the folder was changed"


def test_check_runs_without_secrets(monkeypatch, tmp_path):
    """The loadability check's interpreter inherits no variable that may hold a credential, runs offline, and finds no
    token saved by `hf auth login` (its home and Hub cache are the scratch folder)."""
    secrets = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_PAT_TOKEN",
               "DB_PASSWORD")
    for name in secrets:
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = hub_upload.check_environment(str(tmp_path))
    assert not set(secrets) & set(env), sorted(set(secrets) & set(env))
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == os.environ["PATH"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["HOME"] == env["HF_HOME"] == str(tmp_path)


def test_pickled_weights_refused(tmp_path):
    """A folder whose weights are only a pickled pytorch_model.bin (which passed --dry-run silently): refused in one
    line before anything is written."""
    folder = save_tiny_folder(tmp_path / "model")
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    before = sorted(path.name for path in folder.iterdir())
    result = run_upload(str(folder), "someone/x", "--dry-run")
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert line.startswith(f"diff-transformer upload: error: {folder} has no safetensors weights (only the pickled "
                           "pytorch_model.bin, which run code when loaded); load the model and save it again"), line
    assert sorted(path.name for path in folder.iterdir()) == before, "the folder was changed"


@pytest.mark.parametrize(
    "case, fragment",
    [("missing", "does not exist"), ("no_tokenizer", "has no tokenizer"), ("bad_repo", "must look like"),
     ("no_token", "no Hugging Face token")],
)
def test_clear_errors(prepared, tmp_path, monkeypatch, capsys, case, fragment):
    monkeypatch.setattr(hub_upload, "get_token", lambda: None)
    folder = prepared[0]
    if case == "no_tokenizer":
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "config.json").write_text((prepared[0] / "config.json").read_text())
    args = {
        "missing": [str(tmp_path / "nope"), "someone/x", "--dry-run"],
        "no_tokenizer": [str(folder), "someone/x", "--dry-run"],
        "bad_repo": [str(folder), "not a repo id", "--dry-run"],
        "no_token": [str(folder), "someone/x"],
    }[case]
    assert upload_exit_code(args) == 2
    assert fragment in capsys.readouterr().err


def test_failed_check_leaves_the_folder_unchanged(tmp_path, monkeypatch, capsys):
    folder = save_tiny_folder(tmp_path / "model")
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    def failing_check(staged, label):
        assert (staged / "README.md").is_file() and staged != folder, "the check must see the prepared copy"
        raise hub_upload.UploadError(f"{label} would not load with trust_remote_code=True (left unchanged)")

    monkeypatch.setattr(hub_upload, "check_remote_loading", failing_check)
    assert upload_exit_code([str(folder), "someone/x", "--dry-run"]) == 2
    assert "would not load with trust_remote_code=True (left unchanged)" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", *command], cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


def imported(result: subprocess.CompletedProcess) -> set[str]:
    """Top-level names of the modules `-X importtime` saw imported."""
    return {line.rpartition("|")[2].strip().split(".")[0] for line in result.stderr.splitlines()
            if line.startswith("import time:")}


def test_help_is_the_upload_commands_without_torch():
    script = run("hub_upload.py", "--help")
    assert script.returncode == 0, script.stderr[-2000:]
    command = run("-m", "diff_transformer_cli", "upload", "--help")
    assert script.stdout == command.stdout
    assert "model_dir" in script.stdout and "--dry-run" in script.stdout
    assert not imported(script) & {"torch", "transformers", "huggingface_hub"}, sorted(imported(script))


def test_missing_arguments_fail_in_one_line_without_torch():
    result = run("hub_upload.py", "some-folder")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert errors == ["diff-transformer upload: error: the following arguments are required: repo_id "
                      "(see diff-transformer upload --help)"], errors
    assert "torch" not in imported(result)
