"""Is this a usable saved model folder of the Differential Transformer (arXiv 2410.05258)? The one place that answers,
one line per fault naming the fix: no such folder, a file in its place, a PEFT adapter without its model, no
config.json, a config.json that is not JSON, no or another `model_type`, no tokenizer, no safetensors weights. The
configuration (`configuration_diff.py`), the command line's argument checks, serving and the Hub upload all ask here.

Standard library only: the command line loads it while parsing arguments, before torch or transformers, and a saved
folder ships it beside `configuration_diff.py`, which imports it."""

import hashlib
import json
import os
import re
from pathlib import Path

# A folder holds a tokenizer when it has one of these (tokenizer_config.json alone holds settings, not a vocabulary):
TOKENIZER_FILES = (
    "tokenizer.json",  # fast tokenizers (the `tokenizers` library), what tokenizer.save_pretrained writes
    "tokenizer.model",  # SentencePiece models (Llama, Mistral)
    "vocab.json",  # byte-level BPE vocabularies read with merges.txt (GPT-2, Qwen2)
    "vocab.txt",  # WordPiece vocabularies (BERT)
)
# Files Python's pickle writes (weights of old checkpoints, Trainer's training_args.bin, optimizer states): loading
# one runs code its author chose, so a model's weights must be safetensors.
PICKLED = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")
MODEL_TYPE = "diff_transformer"  # DiffConfig.model_type
CONVERTIBLE = "Llama, Mistral, Qwen2, DiffLlama and Motif-2 checkpoints"  # what `diff-transformer convert` reads
CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # the folders Trainer saves its checkpoints in, by step
# The sha256 of each safetensors file, as the model classes' save_pretrained wrote it: two tensors of one shape
# swapped, or a flipped bit, change no shape and may leave every value plausible; only a checksum tells.
WEIGHTS_MANIFEST = "weights_sha256.json"


class FolderError(ValueError):
    """A saved folder that cannot be used, in one line naming the fix."""


def nearest_existing(path: Path) -> Path:
    """`path` itself when it exists, else its closest existing parent."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def read_text_file(path: str | os.PathLike) -> str:
    """The file's text; `FileNotFoundError` / `ValueError` naming the file when it is missing, a folder or not UTF-8
    text."""
    if Path(path).is_dir():
        raise IsADirectoryError(f"{path} is a folder, not a text file; give one file (join several with `cat`)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such file: {path} (looked in {os.getcwd()})")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
            f"give a plain text file, or convert it first, naming its encoding after -f (e.g. iconv -f LATIN1 -t "
            f"UTF-8 {path} > {Path(path).stem}-utf8.txt)"
        ) from None


def read_json(path: str | os.PathLike) -> dict:
    """The JSON object in `path`; `ValueError` naming the file and the position of the error when it is not one."""
    try:
        value = json.loads(read_text_file(path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object of settings")
    return value


def checkpoint_step(path: Path) -> int:
    return int(CHECKPOINT.fullmatch(path.name)[1])


def checkpoints(folder: str | os.PathLike) -> list[Path]:
    """Trainer's checkpoint folders in `folder` (checkpoint-STEP), by step."""
    found = [path for path in Path(folder).glob("checkpoint-*") if CHECKPOINT.fullmatch(path.name) and path.is_dir()]
    return sorted(found, key=checkpoint_step)


def missing_folder(folder: str | os.PathLike) -> str | None:
    """Why `folder` is no folder (the first part of its path that does not exist, or the file in its place), or
    None."""
    path = Path(os.path.expanduser(folder))
    if path.is_dir():
        return None
    if path.is_file():
        return f"{folder} is a file, not a folder; give the folder save_pretrained() wrote"
    existing = nearest_existing(path)
    if existing.is_dir():
        missing = existing / path.absolute().relative_to(existing).parts[0]
        return f"no such folder: {folder} ({missing} does not exist)"
    return f"no such folder: {folder} ({existing} is a file)"


def check_local_path(path: str | os.PathLike) -> None:
    """Raise `FileNotFoundError` for a missing folder that is plainly meant as local: `./x`, `/x`, `~/x`, `x` alone,
    `a/b/c`, or `a/b` where `a/` exists here. transformers would ask the Hub for it instead, which takes up to a
    minute to fail without a connection. `user/model` with no local `user/` stays a Hub id."""
    text = os.fspath(path)
    if os.path.exists(os.path.expanduser(text)):
        return
    first = text.split("/")[0]
    if text.startswith((".", "/", "~", "\\")) or text.count("/") != 1 or os.path.isdir(first):
        raise FileNotFoundError(f"{missing_folder(text)}; give the folder save_pretrained() wrote, or a Hub id "
                                "'user/model'")


def adapter_only(folder: str | os.PathLike) -> str:
    """What to do with a folder `peft_model.save_pretrained` wrote: the adapter, without the model it adapts."""
    try:
        base = read_json(Path(folder) / "adapter_config.json").get("base_model_name_or_path") or "BASE"
    except ValueError:
        base = "BASE"
    return (f"{folder} holds a PEFT adapter (adapter_config.json), not a model; merge it into its base model "
            f"({base}) and save the result with its tokenizer: PeftModel.from_pretrained(AutoModelForCausalLM."
            f"from_pretrained({base!r}), {str(folder)!r}).merge_and_unload().save_pretrained(OUT), then "
            "tokenizer.save_pretrained(OUT)")


def read_config(folder: str | os.PathLike) -> dict:
    """The settings in `folder`/config.json; `FolderError` when the folder, its config.json, or a JSON object in it
    is missing."""
    if problem := missing_folder(folder):
        raise FolderError(problem)
    if not (Path(folder) / "config.json").is_file():
        if (Path(folder) / "adapter_config.json").is_file():
            raise FolderError(adapter_only(folder))
        raise FolderError(f"{folder} has no config.json, so it is no saved model folder; "
                          f"model.save_pretrained({str(folder)!r}) writes one")
    try:
        return read_json(Path(folder) / "config.json")
    except ValueError as error:
        raise FolderError(f"{error}; fix it, or save the model again with save_pretrained") from None


def wrong_model_type(found: object, source: str | os.PathLike) -> str:
    """The answer for `source` (a folder, or a config's name) holding another architecture than the DIFF
    Transformer's, which would otherwise load as a random model."""
    source = os.fspath(source)
    return (f"{source} holds a '{found}' model, not a DIFF Transformer ('{MODEL_TYPE}'); convert it first with "
            f"`diff-transformer convert {source} OUT` ({CONVERTIBLE}), or use it as it is (AutoModelForCausalLM, "
            "plain vLLM)")


def check_model_type(config: dict, source: str | os.PathLike) -> None:
    """`FolderError` when the settings `config` (of `source`) name another architecture; none named passes (a config
    read as a DiffConfig is one)."""
    found = config.get("model_type", MODEL_TYPE)
    if found != MODEL_TYPE:
        raise FolderError(wrong_model_type(found, source))


def missing_model_type(config: dict, folder: str | os.PathLike, diff: bool) -> str | None:
    """What to restore where a folder's config.json has no `model_type`, or None. Without one, transformers falls back
    on the folder's code (`auto_map`) and asks on stdin whether to run it."""
    if "model_type" in config:
        return None
    architectures = config.get("architectures") or []
    if diff or any(str(name).startswith("Diff") for name in architectures):
        restore = f'"model_type": "{MODEL_TYPE}"'
    else:
        restore = f"the model_type of its architecture ({', '.join(architectures) or 'unknown'}), e.g. \"llama\""
    return f"{folder}/config.json has no \"model_type\"; restore {restore} in it"


def pickled_files(folder: str | os.PathLike) -> list[str]:
    """Names of the folder's pickled files (`PICKLED`)."""
    return sorted({path.name for pattern in PICKLED for path in Path(folder).glob(pattern)})


def check_files(folder: str | os.PathLike) -> None:
    """`FolderError` unless `folder` holds a tokenizer (`TOKENIZER_FILES`) and safetensors weights."""
    path = Path(folder)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FolderError(f"{folder} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); save the model's tokenizer "
                          f"there with tokenizer.save_pretrained({str(folder)!r})")
    if not any(path.glob("*.safetensors")):
        pickled = pickled_files(path)
        held = f" (only the pickled {', '.join(pickled)}, which run code when loaded)" if pickled else ""
        raise FolderError(f"{folder} has no safetensors weights{held}; load the model and save it again with "
                          f"model.save_pretrained({str(folder)!r}), which writes model.safetensors")


def check_folder(folder: str | os.PathLike, diff: bool = False, files: bool = True) -> dict:
    """The settings in `folder`/config.json once the folder passed every check: a config.json with a `model_type`
    (the DIFF Transformer's with `diff`), and with `files` a tokenizer and safetensors weights; else `FolderError`
    with the first fault."""
    config = read_config(folder)
    if problem := missing_model_type(config, folder, diff):
        raise FolderError(problem)
    if diff:
        check_model_type(config, folder)
    if files:
        check_files(folder)
    return config


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_weights_manifest(folder: str | os.PathLike) -> None:
    """`WEIGHTS_MANIFEST` in `folder`: the sha256 of each of its *.safetensors files, written through a temporary
    file and a rename (a manifest is whole or absent)."""
    files = {path.name: file_sha256(path) for path in sorted(Path(folder).glob("*.safetensors"))}
    temporary = Path(folder) / f".{WEIGHTS_MANIFEST}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps({"sha256": files}, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, Path(folder) / WEIGHTS_MANIFEST)


def check_weights_manifest(folder: str | os.PathLike) -> None:
    """`FolderError` naming each weight file of `folder` that is missing or whose sha256 differs from the one
    `WEIGHTS_MANIFEST` recorded when it was saved; a folder without a manifest (saved by other code) passes."""
    path = Path(folder) / WEIGHTS_MANIFEST
    if not path.is_file():
        return
    try:
        recorded = read_json(path).get("sha256", {})
    except ValueError as error:
        raise FolderError(f"{error}; delete it, or save the model again with save_pretrained") from None
    missing = [name for name in recorded if not (Path(folder) / name).is_file()]
    changed = [name for name in recorded if name not in missing and file_sha256(Path(folder) / name) != recorded[name]]
    if missing or changed:
        what = "; ".join([*(f"{name} is missing" for name in missing),
                          *(f"{name} is not the file save_pretrained wrote (its sha256 differs)" for name in changed)])
        raise FolderError(f"the weights in {folder} were damaged or replaced since they were saved ({what}, by "
                          f"{WEIGHTS_MANIFEST}); copy or download the folder again, or, if you changed the weights on "
                          "purpose, save the model with save_pretrained, which records them")
