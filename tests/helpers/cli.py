"""The command line in a child process, as a user runs it: no standard input, offline, one thread; what the CLI tests
share (`run_cases` of several commands in one interpreter, the environment of a single `cli_process`, a write limit
that fails a save as a full disk does, and the sha256 of every file of a folder, to show a refused command wrote
nothing)."""

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs each case's arguments through the command line, in one fresh interpreter with no standard input (the cases of
# one run share its start-up): [exit status, stdout and stderr] per case, as JSON in the file named by argv[2].
RUN_CASES = """
import contextlib, io, json, sys, traceback
import diff_transformer_cli
results = []
for arguments in json.load(open(sys.argv[1])):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        try:
            diff_transformer_cli.main(arguments)
            code = 0
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            code, _ = 1, traceback.print_exc()
    results.append([code, err.getvalue()])
json.dump(results, open(sys.argv[2], "w"))
"""


def run_cases(cases: list[list[str]], folder: Path, root: Path = ROOT, timeout: int = 400,
              stdin: int = subprocess.DEVNULL, unset: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """`RUN_CASES` in `folder` with the code of `root` (the repository, or another checkout to compare with),
    without the environment variables `unset`."""
    (folder / "cases.json").write_text(json.dumps(cases))
    env = {**{k: v for k, v in os.environ.items() if k not in unset}, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", RUN_CASES, "cases.json", "results.json"], cwd=folder, env=env,
                            stdin=stdin, capture_output=True, text=True, timeout=timeout)
    assert (folder / "results.json").is_file(), result.stderr[-3000:]
    return [tuple(entry) for entry in json.loads((folder / "results.json").read_text())]


def cli_process_env(**extra: str) -> dict[str, str]:
    """The environment of a `diff-transformer` child process (this checkout's code, offline, unbuffered), plus
    `extra`."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", **extra}


def write_limit(size: int) -> Callable[[], None]:
    """A `preexec_fn` that limits a child process's files to `size` bytes (RLIMIT_FSIZE, with SIGXFSZ ignored): a
    write past it fails with EFBIG, as a full disk fails one with ENOSPC, on any filesystem and without
    privileges."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return limit


def file_hashes(folder: Path) -> dict[str, str]:
    """The sha256 of every file below `folder`, by relative path (hidden ones too)."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}
