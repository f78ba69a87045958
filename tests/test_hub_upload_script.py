"""`python hub_upload.py` from a checkout is `diff-transformer upload`: the same parser and help, answered before
torch or transformers is imported."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
