"""Is this a usable saved model folder? Pure functions on paths and JSON, shared by the command line's argument checks,
`serve` and `upload`, each answering a bad folder in one line that names the fix.

Torch-free: it imports the standard library only, so `diff_transformer_cli` loads it while parsing arguments without
importing torch or transformers (see `diff_transformer_cli.load_torch_free`)."""

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
CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # the folders Trainer saves its checkpoints in, by step


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
            "give a plain text file, or convert it first (e.g. iconv -t utf-8)"
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
    path = Path(folder)
    if path.is_dir():
        return None
    existing = nearest_existing(path)
    if existing.is_dir():
        missing = existing / path.absolute().relative_to(existing).parts[0]
        return f"no such folder: {folder} ({missing} does not exist)"
    return f"no such folder: {folder} ({existing} is a file)"


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
