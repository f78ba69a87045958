"""The one way the commands write (`diff_transformer/tools/safe_write.py`): a folder or file is complete or absent,
never over a user's without --overwrite, never into an input; a full disk is one line and leaves nothing; what a
killed writer leaves is cleared by the next run. Checkpoints are written the same way, with the tokenizer and the
run's options; `--resume` takes the newest complete one and continues only the same run.

The faults are real: a child process kills itself (SIGKILL) at a chosen point of a save (the test-only hook
`DIFF_TRANSFORMER_TEST_KILL_AT`), and a file size limit (RLIMIT_FSIZE) fails a write as a full disk does."""

import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers.cli import cli_process_env, file_hashes, run_cases, write_limit
from helpers.folders import save_llama, save_tiny_folder
from safetensors.torch import save_file
from transformers import AutoConfig

from diff_transformer.tools.data import KeyValueTask
from diff_transformer.tools.safe_write import (
    HOST,
    TEST_KILL,
    WriteError,
    checkpoint_problem,
    remove_stale,
    staged_folder,
    target_problem,
    write_file,
    write_text,
)

TIMEOUT = 600  # seconds for a child process: a loaded 2-core machine takes a minute or more to import torch
# A tiny run with a checkpoint every 2 of its 6 steps (the last 2 kept), quick enough for several processes
RUN = ["train", "--max-steps", "6", "--examples", "64", "--hidden-size", "32", "--save-steps", "2", "--seed", "1",
       "--progress-seconds", "0"]


def siblings(folder: Path) -> list[str]:
    """The staging and set-aside folders and files of writers in `folder`."""
    return sorted(path.name for path in folder.iterdir() if re.search(r"\.(incomplete|replaced)-\d+", path.name))


def dead_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.DEVNULL)
    child.wait()
    return child.pid


@contextmanager
def file_size_limit(size: int) -> Iterator[None]:
    """This process's writes past `size` bytes fail with EFBIG, as on a full disk (SIGXFSZ ignored)."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


def cli(arguments: list[str], cwd: Path, kill_at: str | None = None, **options) -> subprocess.CompletedProcess:
    """`diff-transformer ARGUMENTS` in a child process with no standard input, showing transformers' warnings as a
    user sees them (the tests' own setting hides them); with `kill_at` ("POINT:NAME") it kills itself there."""
    env = cli_process_env(TRANSFORMERS_VERBOSITY="warning", **({TEST_KILL: kill_at} if kill_at else {}))
    return subprocess.run([sys.executable, "-m", "diff_transformer_cli", *arguments], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT, **options)


def error_line(result: subprocess.CompletedProcess, command: str) -> str:
    """The one error line of a refused command (exit status 2, no traceback)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"diff-transformer {command}: error: "), result.stderr[-3000:]
    return lines[0]


# --- the module itself ---


def test_staged_folder_is_complete_or_absent(tmp_path):
    target = tmp_path / "out"
    with staged_folder(target) as staging:
        (staging / "a.txt").write_text("new")
        assert not target.exists() and staging.parent == tmp_path and staging.name.startswith(".out.incomplete-")
        assert staging.stat().st_mode & 0o777 == 0o700, "the staging folder is private while written"
    assert sorted(os.listdir(target)) == ["a.txt"] and siblings(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask, oct(target.stat().st_mode)

    with pytest.raises(ValueError, match="stopped"), staged_folder(target, replace=True) as staging:
        (staging / "b.txt").write_text("half")
        raise ValueError("stopped")
    assert sorted(os.listdir(target)) == ["a.txt"] and siblings(tmp_path) == [], "an error keeps the old folder"

    with pytest.raises(FileExistsError), staged_folder(target) as staging:
        (staging / "b.txt").write_text("new")
    assert sorted(os.listdir(target)) == ["a.txt"] and siblings(tmp_path) == [], "replaced only where allowed"

    with staged_folder(target, replace=True) as staging:
        (staging / "b.txt").write_text("new")
    assert sorted(os.listdir(target)) == ["b.txt"] and siblings(tmp_path) == [], "replaced whole"


@pytest.mark.parametrize("writer", ["safetensors", "torch.save", "open"])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, writer):
    """A write past the limit in each writer the commands use: a `WriteError` naming the folder, the reason and
    about the space needed (the 400 kB tensor at least), and no staging folder; the old folder stays."""
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.txt").write_text("old")
    tensor = torch.zeros(100_000)
    write = {"safetensors": lambda folder: save_file({"w": tensor}, folder / "w.safetensors"),
             "torch.save": lambda folder: torch.save({"w": tensor}, folder / "w.pt"),
             "open": lambda folder: (folder / "w.bin").write_bytes(bytes(400_000))}[writer]
    with pytest.raises(WriteError) as raised, file_size_limit(50_000), staged_folder(
            target, replace=True, needed=400_000, hint="choose another OUT") as staging:
        write(staging)
    message = str(raised.value)
    assert re.fullmatch(rf"could not write {target}: .+; it needs about 400\.0 KB and .+ are free there; nothing was "
                        r"written: choose another OUT", message), message
    assert ("File too large" in message) != (writer == "torch.save"), message  # torch's writer does not say why
    assert os.listdir(target) == ["old.txt"] and siblings(tmp_path) == []


def test_write_file_is_whole_or_absent(tmp_path):
    path = tmp_path / "report.md"
    write_text(path, "first\n")
    with pytest.raises(WriteError, match=f"could not write {path}: File too large"), file_size_limit(10):
        write_text(path, "x" * 100)
    assert path.read_text() == "first\n" and siblings(tmp_path) == []
    assert write_file(tmp_path / "plot.png", lambda staged: False) is False, "a writer that writes nothing"
    assert sorted(os.listdir(tmp_path)) == ["report.md"]


def test_remove_stale_clears_only_dead_writers(tmp_path):
    """Staging folders of dead processes go (of this machine, or named by an older version without one); a folder
    set aside by one goes where its replacement arrived, and comes back where it did not; a live process's are kept
    (this one's), as are another machine's (a shared filesystem) and other files."""
    dead, other_host = dead_pid(), "0" * 8 if HOST != "0" * 8 else "1" * 8
    kept = [f".e.incomplete-{os.getpid()}.{HOST}-x4", f".f.incomplete-{dead}.{other_host}-x5", ".hidden", "c"]
    for name in (f".a.incomplete-{dead}.{HOST}-x1", f".b.incomplete-{dead}", f".c.replaced-{dead}.{HOST}-x2",
                 f".d.replaced-{dead}-x3", *kept):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    done = remove_stale(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "d"]), done
    assert (tmp_path / "d" / "f").read_text() == f".d.replaced-{dead}-x3", "the old folder is back in place"
    assert (tmp_path / "c" / "f").read_text() == "c", "the new folder stays"
    assert f"restored {tmp_path / 'd'}" in done and len(done) == 4, done


def complete_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "trainer_state.json").write_text('{"global_step": 2}')
    save_file({"w": torch.zeros(1000)}, folder / "model.safetensors")
    torch.save({"state": torch.zeros(1000)}, folder / "optimizer.pt")
    return folder


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_checkpoint_problem_finds_what_a_kill_or_a_full_disk_cuts(tmp_path):
    assert checkpoint_problem(complete_checkpoint(tmp_path / "ok")) is None
    for name, damage, expected in [
        ("weights", lambda f: truncate(f / "model.safetensors"), r"model\.safetensors is truncated \(\d+ bytes of "
                                                                 r"\d+\)"),
        ("header", lambda f: truncate(f / "model.safetensors", 0.01), r"model\.safetensors is truncated \(\d+ bytes, "
                                                                      r"its header alone needs \d+\)"),
        ("optimizer", lambda f: truncate(f / "optimizer.pt"), r"optimizer\.pt is truncated or damaged"),
        ("state", lambda f: (f / "trainer_state.json").unlink(), r"it has no trainer_state\.json"),
        ("json", lambda f: truncate(f / "trainer_state.json"), r"its trainer_state\.json is not valid JSON"),
    ]:
        folder = complete_checkpoint(tmp_path / name)
        damage(folder)
        assert re.fullmatch(expected, checkpoint_problem(folder) or ""), (name, checkpoint_problem(folder))


def test_target_problem(tmp_path):
    source = save_tiny_folder(tmp_path / "src")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert target_problem(tmp_path / "new", False, (source,)) is None
    assert "is the input" in target_problem(source, True, (source,))
    assert "overlaps the input" in target_problem(source / "sub", True, (source,))
    assert "overlaps the input" in target_problem(tmp_path, True, (source,))
    assert "already holds a saved model (config.json); pass --overwrite" in target_problem(source, False)
    assert target_problem(source, True) is None
    assert "choose a new or empty folder" in target_problem(tmp_path / "other", True)


# --- convert: cases 1, 2 and 4 of the commands' faults ---


@pytest.fixture
def convert_folders(tmp_path) -> Path:
    """llama (a source), model (a trained DIFF folder with its training record and scores), notes (a folder of a
    user's files), nest (a model folder holding the source)."""
    tokenizer = KeyValueTask().tokenizer()
    save_llama(tmp_path / "llama", tokenizer)
    model = save_tiny_folder(tmp_path / "model")
    (model / "training_args.json").write_text('{"steps": 10000}\n')
    (model / "eval_results.json").write_text('{"results": [{"metric": "accuracy", "value": 1.0}]}\n')
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    save_llama(tmp_path / "nest" / "llama", tokenizer)
    save_tiny_folder(tmp_path / "nest")
    return tmp_path


CONVERT_REFUSED = {  # arguments: a fragment of the one line
    ("{d}/llama", "{d}/model"): "OUT {d}/model already holds a saved model (config.json); pass --overwrite to replace "
                                "it (the whole folder), or choose another folder",
    ("{d}/llama", "{d}/notes", "--overwrite"): "OUT {d}/notes is a folder with other files and no saved model; "
                                               "choose a new or empty folder",
    ("{d}/llama", "{d}/llama"): "OUT {d}/llama is the input {d}/llama: a command never writes into what it reads",
    ("{d}/llama", "{d}/llama/out"): "OUT {d}/llama/out overlaps the input {d}/llama",
    ("{d}/nest/llama", "{d}/nest", "--overwrite"): "OUT {d}/nest overlaps the input {d}/nest/llama",
}


def test_convert_refuses_to_mix_overwrite_or_write_its_input(convert_folders):
    """convert onto a trained model (before: replaced, its scores kept beside the new weights), onto a user's
    folder (before: mixed in), into its own input (before: replaced, then "the same file"): one line each, before
    any work, every file as it was. With --overwrite a model folder is replaced whole: none of its old files stay."""
    root = convert_folders
    before = file_hashes(root)
    cases = [["convert", *(a.format(d=root) for a in arguments)] for arguments in CONVERT_REFUSED]
    results = run_cases([*cases, ["convert", f"{root}/llama", f"{root}/model", "--overwrite"]], root)
    for (code, err), case, fragment in zip(results, cases, CONVERT_REFUSED.values()):
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (case, err[-3000:])
        assert fragment.format(d=root) in err, (case, err)
    code, err = results[-1]
    assert code == 0, err[-3000:]
    after = file_hashes(root)
    assert {k: v for k, v in after.items() if not k.startswith("model/") and k not in ("cases.json", "results.json")} \
        == {k: v for k, v in before.items() if not k.startswith("model/")}, "a refused command wrote"
    names = sorted(os.listdir(root / "model"))
    assert "training_args.json" not in names and "eval_results.json" not in names, names
    assert AutoConfig.from_pretrained(root / "model").attention_types == ["differential"], "the converted Llama"
    assert siblings(root) == []


def test_convert_on_a_full_disk_keeps_the_old_model(convert_folders):
    """--overwrite onto a model folder when the weights do not fit: one line naming the folder and the space it
    needs, the old model's every file as it was (before: the new config.json beside the old weights)."""
    root = convert_folders
    before = file_hashes(root / "model")
    result = cli(["convert", "llama", "model", "--overwrite"], root, preexec_fn=write_limit(20_000))
    line = error_line(result, "convert")
    assert re.search(r"could not write model: File too large; it needs about [\d.]+ [KM]B and .* are free "
                     r"there; nothing was written: free some space, or choose another folder", line), line
    assert file_hashes(root / "model") == before and siblings(root) == []


# --- train: checkpoints complete or invisible, --resume of the same run (cases 3, 5, 7b and 14) ---


def test_full_disk_during_a_checkpoint_is_one_line(tmp_path):
    """The optimizer state of the first checkpoint does not fit: one line naming the checkpoint and the space it
    needs (before: a 44-line traceback and a half checkpoint that --resume took), nothing left."""
    result = cli([*RUN, "--output", "runs/f"], tmp_path, preexec_fn=write_limit(150_000))
    line = error_line(result, "train")
    assert re.search(r"error: could not write runs/f/checkpoint-2: torch could not write a file .*; it "
                     r"needs about [\d.]+ KB and .* are free there; nothing was written: free some space, or choose "
                     r"another --output \(at step 2 of 6; nothing saved\)", line), line
    assert not (tmp_path / "runs").exists(), sorted(tmp_path.rglob("*"))


@pytest.mark.slow
def test_kill_during_saves_then_resume(tmp_path):
    """kill -9 in a checkpoint's write (its tokenizer written, its record not): the half checkpoint is a staging
    folder, removed by the next run, which resumes from the complete one before it and says so. kill -9 in the final
    save, between setting the old folder (its checkpoints) aside and renaming the model in: the next run puts the old
    folder back and resumes from its last checkpoint, which holds the run's last step, so it trains no step more
    (before: "trained steps 7-7")."""
    runs = tmp_path / "runs"
    killed = cli([*RUN, "--output", "runs/r"], tmp_path, kill_at="partial:checkpoint-4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(os.listdir(runs / "r"))[1:] == ["checkpoint-2"] and siblings(runs / "r"), os.listdir(runs / "r")

    killed = cli([*RUN, "--output", "runs/r", "--resume"], tmp_path, kill_at="replaced:r")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert re.search(r"^diff-transformer train: removed runs/r/\.checkpoint-4\.incomplete-\d+\.[0-9a-f]{8}-\w+, left "
                     r"by a killed run$", killed.stdout, re.MULTILINE), killed.stdout
    assert "resuming from runs/r/checkpoint-2 (step 2)\n" in killed.stdout, killed.stdout
    assert "trained steps 3-6 in " in killed.stdout and "missing keys" not in killed.stdout + killed.stderr
    assert not (runs / "r").exists() and len(siblings(runs)) == 2, os.listdir(runs)

    resumed = cli([*RUN, "--output", "runs/r", "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "diff-transformer train: restored runs/r, left by a killed run" in resumed.stdout, resumed.stdout
    assert ("resuming from runs/r/checkpoint-6 (step 6)\nruns/r/checkpoint-6 holds the run's last step (6 of "
            "--max-steps 6): nothing left to train\n") in resumed.stdout, resumed.stdout
    assert "trained steps" not in resumed.stdout and siblings(runs) == [], os.listdir(runs)
    record = json.loads((runs / "r" / "training_args.json").read_text())
    assert record["steps"] == 6 and "resumed_from_step" not in record and math.isfinite(record["mean_training_loss"])


def cosine_rate(peak: float, step: int, steps: int) -> float:
    """The rate `train`'s schedule (cosine, no warm-up below 10 steps) gives the optimizer step `step` (1-based)."""
    return peak * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))


@pytest.mark.slow
def test_resume_continues_only_the_same_run(tmp_path):
    """--resume with another option is refused in one line naming both values, every file as it was (before: a new
    --learning-rate recorded but not used, another --hidden-size a 52-line traceback, --overwrite ignored). With
    --change learning-rate the new rate is the optimizer's from the next step (the schedule's factor times it) and is
    recorded, with the change, in training_args.json."""
    killed = cli([*RUN, "--output", "runs/r"], tmp_path, kill_at="written:checkpoint-4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoint = tmp_path / "runs" / "r" / "checkpoint-2"
    before = file_hashes(checkpoint)
    resume = [*RUN, "--output", "runs/r", "--resume"]
    refused = {
        "--learning-rate is 0.001 here but 0.005 in the run (runs/r/checkpoint-2); give the run's value to continue "
        "it, or add --change learning-rate to train on with the new one": [*resume, "--learning-rate", "0.001"],
        "--hidden-size is 64 here but 32 in the run (runs/r/checkpoint-2), and it cannot change on a resume": [
            *resume, "--hidden-size", "64", "--change", "learning-rate"],
        "--resume continues the run in --output and --overwrite starts a new one there; drop one of them": [
            *resume, "--overwrite"],
        "--change learning-rate applies to --resume only; drop it": [*RUN, "--output", "runs/new", "--change",
                                                                     "learning-rate"],
    }
    for (code, err), fragment in zip(run_cases(list(refused.values()), tmp_path), refused):
        line = err.strip().splitlines()[-1]
        assert code == 2 and "Traceback" not in err and line.startswith("diff-transformer train: error: "), err
        assert fragment in line, line
    assert file_hashes(checkpoint) == before and not (tmp_path / "runs" / "new").exists()

    changed = cli([*resume, "--learning-rate", "0.001", "--change", "learning-rate"], tmp_path, kill_at="written:r")
    assert changed.returncode == -signal.SIGKILL, changed.stderr[-3000:]
    assert "resuming from runs/r/checkpoint-2 (step 2)" in changed.stdout, changed.stdout
    history = json.loads((tmp_path / "runs" / "r" / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    rates = {entry["step"]: entry["learning_rate"] for entry in history if "learning_rate" in entry}
    expected = {step: cosine_rate(0.005 if step <= 2 else 0.001, step, 6) for step in range(1, 7)}
    assert rates.keys() == expected.keys(), rates
    assert all(math.isclose(rates[s], expected[s], rel_tol=1e-6) for s in rates), (rates, expected)

    finished = cli([*resume, "--learning-rate", "0.001", "--change", "learning-rate"], tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "r" / "training_args.json").read_text())
    assert record["options"]["learning_rate"] == 0.001, record
    assert record["changes"] == [{"option": "learning_rate", "from": 0.005, "to": 0.001, "at_step": 2}], record


@pytest.mark.slow
def test_checkpoints_of_a_text_run_hold_its_tokenizer_and_data(tmp_path, shakespeare):
    """A --data run's checkpoint generates (it holds the tokenizer; before: none), and records the file's sha256:
    --resume with another file is refused (before: the tokenizer was retrained under the trained embeddings). A
    truncated newest checkpoint is skipped, named, for the one before it; a lone truncated one is refused in one
    line naming its file (before: "could not save ... free some space")."""
    text = shakespeare.read_text(encoding="utf-8")
    (tmp_path / "corpus.txt").write_text(text[:8000], encoding="utf-8")
    (tmp_path / "other.txt").write_text(text[8000:16000], encoding="utf-8")
    run = ["train", "--data", "corpus.txt", "--max-steps", "2", "--save-steps", "1", "--block-size", "16",
           "--vocab-size", "300", "--hidden-size", "32", "--batch-size", "4", "--max-new-tokens", "2"]
    killed = cli([*run, "--output", "runs/t"], tmp_path, kill_at="written:t")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    runs = tmp_path / "runs"
    (runs / "u").mkdir()
    (runs / "t" / "checkpoint-2").rename(runs / "u" / "checkpoint-2")
    truncate(runs / "u" / "checkpoint-2" / "model.safetensors")
    (runs / "t" / "checkpoint-3").mkdir()  # a newest one that a kill left half-written by an older version
    (runs / "t" / "checkpoint-3" / "config.json").write_text("{}")
    before = {path: digest for path, digest in file_hashes(runs).items() if ".incomplete-" not in path}
    results = run_cases([
        ["generate", "runs/t/checkpoint-1", "--prompt", "ROMEO:", "--max-new-tokens", "2"],
        [*run, "--output", "runs/t", "--resume", "--data", "other.txt"],
        [*run, "--output", "runs/u", "--resume"],
    ], tmp_path)
    assert results[0][0] == 0 and "generated: ROMEO:" in results[0][1], results[0][1][-3000:]
    fragments = ["--resume: the file of --data other.txt is not the run's (corpus.txt, sha256 ",
                 "--resume: no checkpoint in --output runs/u is complete (runs/u/checkpoint-2: model.safetensors is "
                 "truncated ("]
    for (code, err), fragment in zip(results[1:], fragments):
        assert code == 2 and "Traceback" not in err and fragment in err.strip().splitlines()[-1], err[-3000:]
    assert file_hashes(runs) == before

    resumed = cli([*run, "--output", "runs/t", "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert ("skipping runs/t/checkpoint-3: it has no model.safetensors (incomplete)\nresuming from "
            "runs/t/checkpoint-1 (step 1)\n") in resumed.stdout, resumed.stdout
    assert "trained steps 2-2 in " in resumed.stdout, resumed.stdout


@pytest.mark.slow
def test_kill_as_a_checkpoint_write_starts_then_resume(tmp_path):
    """No hook: kill -9 the moment the second checkpoint's folder (or its staging folder) appears, as a user's kill
    lands mid-write. --resume continues from the first checkpoint, the one complete (before: it took the half one
    and refused, "Can't find a valid checkpoint")."""
    run = [*RUN, "--save-steps", "1", "--output", "runs/k"]
    folder = tmp_path / "runs" / "k"
    process = subprocess.Popen([sys.executable, "-m", "diff_transformer_cli", *run], cwd=tmp_path,
                               env=cli_process_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        while process.poll() is None:
            names = os.listdir(folder) if folder.is_dir() else []
            if any(re.search(r"checkpoint-2\b", name) for name in names):
                process.kill()
                break
        process.wait(timeout=TIMEOUT)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL, "the run ended before its second checkpoint"
    resumed = cli([*run, "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    found = re.search(r"^resuming from runs/k/checkpoint-([12]) \(step \1\)$", resumed.stdout, re.MULTILINE)
    assert found and f"trained steps {int(found[1]) + 1}-6 in " in resumed.stdout, resumed.stdout
    assert siblings(tmp_path / "runs") == [] and (folder / "config.json").is_file()
