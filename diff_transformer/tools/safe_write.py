"""The one way every command writes a folder or a file: complete or absent, never half-written, never over what a
user has without --overwrite, never into its own input.

A folder is written into a fresh private staging folder beside its target (`.NAME.incomplete-PID.HOST-XXXXXXXX`,
made by `tempfile.mkdtemp`: unpredictable, mode 0700 while written), its files and the folder are fsynced, and only
then is it renamed into place; an existing target (replaced only where the caller allows it) is first renamed aside
(`.NAME.replaced-PID.HOST-XXXXXXXX`) and deleted after. So at every moment the target is the old folder or the new
one. A process killed part-way leaves such a sibling; `remove_stale` deletes those of dead processes of this machine
on the next run (and puts an old folder that was renamed aside back where the new one never arrived). A write that
fails for lack of room (ENOSPC, EDQUOT, EFBIG, or the same error inside safetensors' or torch's writers) removes what
it wrote and becomes one `WriteError` line naming the target and the space it needs.

Standard library only: the command line checks targets and checkpoints with it before importing torch. Tooling,
not part of a saved folder.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STAGING, REPLACED = "incomplete", "replaced"
# `.NAME.incomplete-PID.HOST-XXXXXXXX` (and the `-PID` alone of older versions): what a writer leaves. HOST, a hash
# of the machine's name, keeps a run from taking a live run's folder on another machine (a shared filesystem) for a
# dead one's.
SIBLING = re.compile(rf"\.(?P<name>.+)\.(?P<kind>{STAGING}|{REPLACED})-(?P<pid>\d+)(\.(?P<host>[0-9a-f]{{8}}))?(-.*)?")
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # a full disk, a quota, a file size limit
# what torch's file writer raises when a write fails (it does not keep the OS error)
TORCH_WRITE_FAILED = r"PytorchStreamWriter|inline_container|file write failed|basic_ios::clear: iostream error"
# Test-only: "POINT:NAME" makes this process SIGKILL itself at POINT ("written", "replaced", "published", or a
# writer's own, such as "partial") of writing the folder or file NAME, so that tests can kill a real save where they
# choose. Inert unless set.
TEST_KILL = "DIFF_TRANSFORMER_TEST_KILL_AT"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "trainer_state.json")  # what resuming a checkpoint reads
RUN_RECORD = "training_run.json"  # in each checkpoint of `diff-transformer train`: the run's options and data


class WriteError(OSError):
    """A folder or file could not be written for lack of room, in one line; nothing of it was left behind."""


def kill_point(point: str, target: Path) -> None:
    """The test hook `TEST_KILL`: SIGKILL this process at `point` of writing `target`, where asked to."""
    if os.environ.get(TEST_KILL) == f"{point}:{target.name}":
        os.kill(os.getpid(), signal.SIGKILL)


def private_folder(target: Path, kind: str) -> Path:
    """A fresh, empty folder beside `target` that only this process can enter, named after it, this process and
    machine (`writer_id`) and a random part: `.NAME.KIND-PID.HOST-XXXXXXXX`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-{writer_id()}-", dir=target.parent))


def writer_id() -> str:
    """This process, as a staging name records it: PID.HOST."""
    return f"{os.getpid()}.{HOST}"


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(folder: Path) -> list[str]:
    """Clear what killed writers left in `folder` (siblings of their dead processes only): staging folders are
    deleted; a folder renamed aside is deleted where its replacement arrived, else renamed back. The names of what
    it deleted or restored."""
    if not folder.is_dir():
        return []
    done = []
    for entry in sorted(folder.iterdir()):
        match = SIBLING.fullmatch(entry.name)
        if match is None or match["host"] not in (None, HOST) or process_alive(int(match["pid"])):
            continue
        original = folder / match["name"]
        if match["kind"] == REPLACED and not original.exists():
            os.replace(entry, original)  # killed between its two renames: the old folder is the complete one
            done.append(f"restored {original}")
        else:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            done.append(f"removed {entry}")
    return done


def default_mode() -> int:
    """The mode a folder made now gets (0o777 less the umask)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o777 & ~umask


def sync_tree(folder: Path) -> None:
    """fsync every file below `folder`, then the folders, deepest first: what the rename publishes is on disk."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            sync_path(Path(root) / name)
        sync_path(Path(root))


def sync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(folder: Path, target: Path, replace: bool) -> None:
    """Rename the finished `folder` to `target` (an empty `target` is taken; an existing one, with `replace`, is
    renamed aside and deleted once the new one is in place)."""
    sync_tree(folder)
    folder.chmod(default_mode())
    kill_point("written", target)
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists() and not target.is_symlink():
        os.rename(folder, target)
        sync_path(target.parent)
        return
    if not replace:
        raise FileExistsError(f"{target} appeared while it was written; nothing replaced")
    aside = private_folder(target, REPLACED)
    os.replace(target, aside)  # onto the empty folder mkdtemp made: one rename
    kill_point("replaced", target)
    os.rename(folder, target)
    sync_path(target.parent)
    kill_point("published", target)
    shutil.rmtree(aside)


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def tensor_bytes(tensors) -> int:
    """Bytes a save of `tensors` (torch tensors; other values ignored) takes, each storage counted once (tied
    weights share one)."""
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if hasattr(t, "data_ptr")}
    return sum(unique.values())


def human_bytes(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError


def no_room_reason(error: BaseException) -> str | None:
    """Why `error` (or an error it was raised from) says a write ran out of room (a full disk, a quota, a file size
    limit), or None when it is another error. safetensors' errors carry the OS error's number in their text; torch's
    writer (`torch.save`, optimizer states) says only that it could not write."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return error.strerror
        text = str(error)
        found = re.search(r"os error (\d+)", text)
        if type(error).__name__ == "SafetensorError" and found and int(found[1]) in NO_ROOM:
            return os.strerror(int(found[1]))
        if isinstance(error, RuntimeError) and re.search(TORCH_WRITE_FAILED, text):
            return f"torch could not write a file ({text.strip().splitlines()[0][:120]})"
        error = error.__cause__ or error.__context__
    return None


def write_error(reason: str, target: Path, needed: int, hint: str) -> WriteError:
    """The one line for a write to `target` that ran out of room: the reason, the space it needs and has."""
    existing = target.parent
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    return WriteError(f"could not write {target}: {reason}; it needs about {human_bytes(needed)} and "
                      f"{human_bytes(free)} are free there; nothing was written: {hint}")


@contextmanager
def staged_folder(target: Path, replace: bool = False, needed: int | Callable[[], int] = 0,
                  hint: str = "free some space, or choose another folder", inner: str | None = None) -> Iterator[Path]:
    """Yield the folder to write `target`'s files into: a fresh private staging folder beside it (with `inner`, the
    not yet made folder of that name inside it, for a writer that makes its own). When the block ends, it is
    fsynced and renamed into place (`publish`; an existing `target` replaced only with `replace`). On any error
    nothing of it stays; one that ran out of room becomes a `WriteError` naming `target` and about how much it needs
    (`needed` bytes, or what was written, whichever is more)."""
    shown, target = Path(target), Path(target).absolute()
    private = private_folder(target, STAGING)
    folder = private / inner if inner else private
    try:
        yield folder
        publish(folder, target, replace)
    except BaseException as error:
        reason = no_room_reason(error)
        if reason is None:
            raise
        size = max(needed() if callable(needed) else needed, folder_bytes(private))
        shutil.rmtree(private, ignore_errors=True)
        raise write_error(reason, shown, size, hint) from error
    finally:
        shutil.rmtree(private, ignore_errors=True)


def write_file(path: Path, write: Callable[[Path], object], replace: bool = True,
               hint: str = "free some space, or choose another folder") -> bool:
    """Write the file `path` whole or not at all: `write(staged_path)` writes a private staging file beside it
    (`.NAME.incomplete-PID.HOST-XXXXXXXX.SUFFIX`, with `path`'s suffix for writers that read it), which is fsynced and
    renamed over `path` (an existing one only with `replace`); where `write` returns False, nothing is written. A
    write that runs out of room: a `WriteError`, and nothing left behind. Whether `path` was written."""
    shown, path = Path(path), Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.{STAGING}-{writer_id()}-", suffix=path.suffix,
                                        dir=path.parent)
    os.close(descriptor)
    staged = Path(name)
    try:
        if write(staged) is False:
            staged.unlink()
            return False
        sync_path(staged)
        staged.chmod(0o666 & default_mode())
        kill_point("written", path)
        if not replace and path.exists():
            raise FileExistsError(f"{path} exists; nothing replaced")
        os.replace(staged, path)
        sync_path(path.parent)
        return True
    except BaseException as error:
        size = staged.stat().st_size if staged.exists() else 0
        staged.unlink(missing_ok=True)
        reason = no_room_reason(error)
        if reason is None:
            raise
        raise write_error(reason, shown, size, hint) from error


def write_text(path: Path, text: str, replace: bool = True) -> None:
    """`write_file` of UTF-8 text."""
    write_file(path, lambda staged: staged.write_text(text, encoding="utf-8"), replace)


def inside(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies below it (symbolic links resolved)."""
    path, folder = path.expanduser().resolve(), folder.expanduser().resolve()
    return path == folder or folder in path.parents


def target_problem(target: Path, overwrite: bool, inputs: tuple[Path, ...] = (), option: str = "OUT") -> str | None:
    """Why a command may not write the folder `target` (given as `option`), or None: it is or holds one of its
    `inputs`, or lies inside one; it holds a saved model (config.json) and `overwrite` is off; it holds other files
    (a folder is replaced whole, so they would be lost or mixed in)."""
    for source in inputs:
        if inside(target, source) or inside(source, target):
            where = "is" if target.resolve() == source.resolve() else "overlaps"
            return (f"{option} {target} {where} the input {source}: a command never writes into what it reads; "
                    "choose another folder")
    if target.is_file() or target.is_symlink() and not target.is_dir():
        return f"{option} {target} is a file; choose a folder"
    if not target.is_dir() or not any(target.iterdir()):
        return None
    if (target / "config.json").is_file():
        if overwrite:
            return None
        return (f"{option} {target} already holds a saved model (config.json); pass --overwrite to replace it "
                "(the whole folder), or choose another folder")
    return f"{option} {target} is a folder with other files and no saved model; choose a new or empty folder"


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file `path` is incomplete (its header, or data short of what the header lists), or
    None."""
    size = path.stat().st_size
    try:
        with path.open("rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if size < 8 or 8 + length > size:
                return f"{path.name} is truncated ({size} bytes, its header alone needs {8 + length})"
            header = json.loads(file.read(length))
    except (ValueError, UnicodeDecodeError):
        return f"{path.name} has no readable header"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end != size:
        return f"{path.name} is truncated ({size} bytes of {8 + length + end})"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why the Trainer checkpoint `folder` cannot be resumed (a file missing or cut short), or None."""
    for name in CHECKPOINT_FILES:
        if not (folder / name).is_file():
            return f"it has no {name}"
    try:
        json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return "its trainer_state.json is not valid JSON"
    if problem := safetensors_problem(folder / "model.safetensors"):
        return problem
    for path in sorted(folder.glob("*.pt")) + sorted(folder.glob("*.pth")):  # torch's zip files end in a directory
        if not zipfile.is_zipfile(path):
            return f"{path.name} is truncated or damaged"
    return None


__all__ = ["WriteError", "staged_folder", "write_file", "write_text", "remove_stale", "target_problem",
           "checkpoint_problem"]
