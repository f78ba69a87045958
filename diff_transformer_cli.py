"""`diff-transformer` command line: train a tiny DIFF model (arXiv 2410.05258), generate from a saved one, convert
checkpoints, evaluate retrieval, attention noise and outliers, upload to the Hub and serve with vLLM. Add --debug to
any command to see a traceback.

This module parses and checks the arguments without importing torch or transformers, so `--help` and argument errors
answer at once; each command then runs the function `COMMANDS` names for it."""

import argparse
import difflib
import hashlib
import importlib
import importlib.util
import json
import math
import pickle
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flex_attention", "diff_flash")


def load_torch_free(name: str) -> ModuleType:
    """The package's module `name` (one that imports the standard library only), without running
    `diff_transformer/__init__.py`, which imports torch and transformers (seconds of CPU): read from its file and
    registered under its own name, so that the package's code, once imported, shares this one module."""
    if "diff_transformer" in sys.modules:  # torch is in already: the ordinary import
        return importlib.import_module(name)
    if name not in sys.modules:
        package = importlib.util.find_spec("diff_transformer")  # finds the package without importing it
        path = Path(package.origin).parent.joinpath(*name.split(".")[1:]).with_suffix(".py")
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


saved_folder = load_torch_free("diff_transformer.saved_folder")
safe_write = load_torch_free("diff_transformer.tools.safe_write")


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a job scheduler's stop), handled as Ctrl-C is: one line, nothing half-written. Its exit status
    is 128 + 15, as the shell reports a process the signal ended (Ctrl-C's: 130); an exception raised in its place
    carries `exit_code` on."""

    exit_code = 128 + signal.SIGTERM


def on_sigterm(signum: int, frame) -> None:
    raise Terminated("terminated (SIGTERM)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default where it has one (not for None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with errors on one line (usage lines omitted: --help shows them), exit status 2, and defaults
    shown in --help. The value after an option of `verbatim_options` is taken as is, even when it starts with a dash
    (`--vllm-args --enforce-eager`), which argparse alone reads as a missing value."""

    verbatim_options: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is not None and self.verbatim_options:
            args = list(args)
            for i in reversed(range(len(args) - 1)):
                if args[i] in self.verbatim_options:
                    args[i : i + 2] = [f"{args[i]}={args[i + 1]}"]
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        """argparse's, with unknown options answered by the command's own parser (its name, its --help), each with
        the option it most likely means (`option_hint`)."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = getattr(namespace, "command_parser", self)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser.option_hint(extras)}")
        return namespace

    def option_hint(self, extras: list[str]) -> str:
        """"; did you mean --learning-rate?" for the unknown options among `extras` that abbreviate one of this
        parser's options by its words' initials (--lr) or misspell it (--learing-rate); "" when none does."""
        options = [name for action in self._actions for name in action.option_strings if name.startswith("--")]
        initials = {"--" + "".join(word[0] for word in name[2:].split("-")): name for name in options}
        hints = []
        for extra in extras:
            name = extra.partition("=")[0]
            if name.startswith("--") and name not in options:
                close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
                if guess := initials.get(name) or (close[0] if close else None):
                    hints.append((guess, name))
        if len(hints) == 1:
            return f"; did you mean {hints[0][0]}?"
        return f"; did you mean {', '.join(f'{guess} for {name}' for guess, name in hints)}?" if hints else ""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(text)


def as_float(text: str) -> float:
    """float(text) when it is a finite number, else NaN (which fails every range check): 'inf', 'nan', 'x'."""
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def positive_float(text: str) -> float:
    if not as_float(text) > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return float(text)


def non_negative_float(text: str) -> float:
    if not as_float(text) >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return float(text)


def percent(text: str) -> float:
    if not 0 <= as_float(text) <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} must be a percentage between 0 and 100")
    return float(text)


def text_file(text: str) -> str:
    """A readable UTF-8 text file with some text in it (checked up front: training a tokenizer on anything else
    fails obscurely, or after seconds)."""
    try:
        content = saved_folder.read_text_file(text)
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not content.strip():
        what = "is empty" if not content else f"holds only whitespace ({len(content)} characters)"
        raise argparse.ArgumentTypeError(f"{text} {what}; give a text file with the text to train on")
    return text


def folder_config(text: str, diff: bool = False) -> dict:
    """config.json of a local folder written by save_pretrained, with a model_type (of a DIFF Transformer with
    `diff`), a tokenizer and safetensors weights (`saved_folder.check_folder`)."""
    try:
        return saved_folder.check_folder(text, diff=diff)
    except saved_folder.FolderError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def model_folder(text: str) -> str:
    """A local folder written by save_pretrained: a readable config.json with a model_type, a tokenizer and
    weights."""
    folder_config(text)
    return text


def diff_model_folder(text: str) -> str:
    """A model folder whose config is a DIFF Transformer's."""
    folder_config(text, diff=True)
    return text


def check_upload_folder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """upload's MODEL_DIR: a saved DIFF model folder, refused in the words `upload` itself uses."""
    try:
        saved_folder.check_folder(args.model_dir, diff=True)
    except saved_folder.FolderError as error:
        parser.error(str(error))


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written into `folder` (made with its parents where missing), or None: probed with a real
    file, which also finds read-only mounts."""
    existing = saved_folder.nearest_existing(folder)
    if not existing.is_dir():
        return f"{existing} is a file, so no folder can be made there"
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError as error:
        return f"cannot write in {existing} ({error.strerror})"


def check_output_prefix(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--output PREFIX of an evaluation: its folder can be written, checked before the evaluation runs."""
    problem = unwritable(Path(args.output).parent)
    if problem:
        parser.error(f"--output {args.output}: {problem}; choose another --output")


# train's options on --resume: those a run may change deliberately (--change NAME, which applies them), and those it
# may change freely (they do not touch what is trained); any other is the run's (its model, tokenizer and data).
RESUME_CHANGEABLE = ("learning_rate", "max_steps", "bf16", "save_steps")
RESUME_FREE = ("minutes", "attn_implementation", "save_total_limit", "resume")


def option_name(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def shown(value) -> str:
    """An option's value as a user reads it in a message."""
    return {None: "not given", True: "on", False: "off"}.get(value, str(value)) if not isinstance(value, float) \
        else f"{value:g}"


def clear_stale(target: Path, parser: argparse.ArgumentParser) -> None:
    """Clear what writers killed part-way left beside `target` and in it (`safe_write.remove_stale`), saying so."""
    for done in safe_write.remove_stale(target.parent) + safe_write.remove_stale(target):
        print(f"{parser.prog}: {done}, left by a killed run")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def newest_complete_checkpoint(args: argparse.Namespace, parser: argparse.ArgumentParser,
                               found: list[Path]) -> Path:
    """The newest checkpoint of `found` that can be resumed; the newer ones it skips, with why, go into
    `args.skipped_checkpoints`. None complete: refused, naming each and its fault."""
    skipped = []
    for checkpoint in reversed(found):
        problem = safe_write.checkpoint_problem(checkpoint)
        if problem is None:
            args.skipped_checkpoints = skipped
            return checkpoint
        skipped.append(f"{checkpoint}: {problem} (incomplete)")
    parser.error(f"--resume: no checkpoint in --output {args.output} is complete ({'; '.join(skipped)}); drop "
                 "--resume and pass --overwrite to start a new run")


def changed_option(args: argparse.Namespace, name: str, before, checkpoint: Path, record: dict) -> str | None:
    """How this run's option `name` differs from the run's `before` recorded in `checkpoint`, or None."""
    now = getattr(args, name)
    if name == "data":
        if (before is None) == (now is None) and record.get("data_sha256") == args.data_sha256:
            return None
        if before is not None and now is not None:
            return f"the file of --data {now} is not the run's ({before}, sha256 {record.get('data_sha256')})"
    elif now == before:
        return None
    return f"{option_name(name)} is {shown(now)} here but {shown(before)} in the run ({checkpoint})"


def check_same_run(args: argparse.Namespace, parser: argparse.ArgumentParser, checkpoint: Path) -> None:
    """--resume continues only the run of `checkpoint` (its record, `safe_write.RUN_RECORD`): an option of another
    value is refused, naming both values, unless it may change (`RESUME_FREE`, or `RESUME_CHANGEABLE` with
    --change, recorded in `args.changes`)."""
    if not (checkpoint / safe_write.RUN_RECORD).is_file():
        parser.error(f"--resume: {checkpoint} records no options of its run ({safe_write.RUN_RECORD}; an older "
                     "version wrote it), so this run could silently differ from it; start a new run with --overwrite")
    record = json.loads((checkpoint / safe_write.RUN_RECORD).read_text())
    args.changes = list(record.get("changes", []))
    for name, before in record["options"].items():
        if name in RESUME_FREE or not hasattr(args, name):
            continue
        difference = changed_option(args, name, before, checkpoint, record)
        if difference is None:
            continue
        if name not in RESUME_CHANGEABLE:
            parser.error(f"--resume: {difference}, and it cannot change on a resume (the model, its tokenizer and "
                         f"its data are the run's); give the run's value, or start a new run with --overwrite")
        if name not in args.change:
            parser.error(f"--resume: {difference}; give the run's value to continue it, or add --change "
                         f"{option_name(name)[2:]} to train on with the new one")
        if name == "max_steps" and args.max_steps < saved_folder.checkpoint_step(checkpoint):
            parser.error(f"--max-steps {args.max_steps} is fewer than the {saved_folder.checkpoint_step(checkpoint)} "
                         f"steps {checkpoint} has trained; give more")
        args.changes.append({"option": name, "from": before, "to": getattr(args, name),
                             "at_step": saved_folder.checkpoint_step(checkpoint)})


def check_checkpoints(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """train's --resume needs a complete checkpoint in --output, of the same run (`args.resume_from`: the newest
    one); checkpoints there without it need --overwrite (a new run). Whether --output holds checkpoints."""
    found = saved_folder.checkpoints(args.output) if Path(args.output).is_dir() else []
    args.resume_from = None
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --output and --overwrite starts a new one there; drop one of "
                     "them")
    if args.change and not args.resume:
        parser.error(f"--change {args.change[0].replace('_', '-')} applies to --resume only; drop it")
    if args.resume and not found:
        parser.error(f"--resume: --output {args.output} holds no checkpoint (checkpoint-STEP folder) to continue "
                     "from; drop --resume to start a new run")
    if args.resume:
        args.resume_from = newest_complete_checkpoint(args, parser, found)
        check_same_run(args, parser, args.resume_from)
    if found and not args.resume and not args.overwrite:
        parser.error(f"--output {args.output} holds checkpoints of an unfinished run (the last: {found[-1].name}); "
                     "pass --resume to continue it, or --overwrite to start a new run")
    return bool(found)


def check_output_folder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """train's --output: writable, not a saved model unless --overwrite, not around its --data file, and with a
    complete checkpoint of the same run for --resume."""
    problem = unwritable(Path(args.output))
    if problem:
        parser.error(f"--output {args.output}: {problem}; choose another --output")
    output = Path(args.output)
    clear_stale(output, parser)
    if args.data is not None and safe_write.inside(Path(args.data), output):
        parser.error(f"--output {args.output} holds the --data file {args.data}, and the model replaces the folder "
                     "whole; choose another --output")
    if check_checkpoints(args, parser) and (args.resume or not (output / "config.json").is_file()):
        return  # a run started with --overwrite over a saved model holds both until its model replaces them
    if (output / "config.json").is_file():
        if not args.overwrite:
            parser.error(f"--output {args.output} already holds a saved model (config.json); pass --overwrite to "
                         "replace it, or choose another --output")
    elif output.is_dir() and any(output.iterdir()):  # the model replaces the folder whole, in one rename
        parser.error(f"--output {args.output} is a folder with other files and no saved model; choose a new or "
                     "empty folder")


def check_convert_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """convert's OUT: writable, never SRC or a folder inside or around it, a saved model only with --overwrite
    (replaced whole), no folder of other files."""
    out = Path(args.out)
    problem = unwritable(out)
    if problem:
        parser.error(f"OUT {args.out}: {problem}; choose another folder")
    clear_stale(out, parser)
    inputs = (Path(args.src),) if Path(args.src).expanduser().exists() else ()
    if problem := safe_write.target_problem(out, args.overwrite, inputs):
        parser.error(problem)


def local_folder_or_hub_id(text: str) -> str:
    """A local folder or a Hub id; a missing local folder fails here rather than after a minute of Hub retries, and
    a local one needs a readable config.json with a model_type (its weights may be any transformers reads)."""
    try:
        saved_folder.check_local_path(text)
        if Path(text).expanduser().exists():
            saved_folder.check_folder(text, files=False)
    except (FileNotFoundError, saved_folder.FolderError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def embedding_multiplier(text: str) -> float | str:
    """train's --embedding-multiplier: a number > 0, or 'sqrt' (sqrt(hidden size), DiffConfig's default)."""
    if text == "sqrt":
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number > 0 (1.0: unscaled embeddings) or 'sqrt' "
                                         "(sqrt of --hidden-size)")
    return value


def parse_layers(text: str) -> list[int]:
    """'1-11' or '1,3,5' (0-based, ranges inclusive) -> layer indices."""
    layers = []
    for part in text.split(","):
        start, _, end = part.strip().partition("-")
        if not start.isdigit() or not (end or start).isdigit() or int(end or start) < int(start):
            raise argparse.ArgumentTypeError(f"{text!r}: give 0-based layers as a range '1-11' or a list '2,4'")
        layers.extend(range(int(start), int(end or start) + 1))
    return layers


# train options that apply to one kind of data only: name -> (default, whether it applies to --data). Their parser
# default is None, so that one given for the other kind is refused rather than silently ignored.
DATA_SPECIFIC = {"block_size": (128, True), "vocab_size": (2048, True), "examples": (100_000, False),
                 "pairs": (2, False), "keys": (16, False)}
BYTE_ALPHABET = 256  # a byte-level BPE vocabulary holds every byte before any merge


def fill_data_specific(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The defaults of `DATA_SPECIFIC` for the data in use; an option given for the other kind is refused."""
    for name, (default, for_text) in DATA_SPECIFIC.items():
        option = f"--{name.replace('_', '-')}"
        if for_text != (args.data is not None) and getattr(args, name) is not None:
            scope = ("--data (the built-in task sets its own sequences and vocabulary)" if for_text else
                     "the built-in task (--data trains on the file's text)")
            parser.error(f"{option} applies to {scope} only; drop {option}")
        if for_text == (args.data is not None) and getattr(args, name) is None:
            setattr(args, name, default)


def smallest_vocabulary(chat_template: bool) -> int:
    """Entries of a byte-level BPE tokenizer before any merge: the bytes and the special (and chat) tokens."""
    from diff_transformer.tokenization_diff import CHAT_TOKENS, SPECIAL_TOKENS

    return BYTE_ALPHABET + len(SPECIAL_TOKENS) + (len(CHAT_TOKENS) if chat_template else 0)


def backend_problem(name: str) -> str | None:
    """Why attention backend `name` cannot run on this machine, or None. Checked before any work: the model would
    refuse it only once built, after the data."""
    if name == "diff_flash":
        from diff_transformer.attention_kernels import triton_available

        ok, reason = triton_available()
        return None if ok else reason.partition("; ")[0]
    if name == "flash_attention_2":
        import torch

        if importlib.util.find_spec("flash_attn") is None:
            return "the flash_attn package is not installed"
        if not torch.cuda.is_available():
            return "no CUDA GPU"
    return None


def check_train_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    fill_data_specific(args, parser)
    args.change = [name.replace("-", "_") for name in args.change or ()]
    if args.embedding_multiplier is None:  # the built-in task's recipe; the package's default on text
        args.embedding_multiplier = "sqrt" if args.data is not None else 1.0
    if args.hidden_size % (2 * args.heads):
        parser.error(f"--hidden-size ({args.hidden_size}) must be a multiple of 2 * --heads ({2 * args.heads}): "
                     "each head has two query/key sub-heads of hidden / (2 heads) dims")
    if args.data is None and args.pairs > args.keys:
        parser.error(f"--pairs ({args.pairs}) cannot exceed --keys ({args.keys}): each pair uses a distinct key")
    if args.data is not None and args.block_size < 2:
        parser.error(f"--block-size {args.block_size} leaves no room for text: a block is <s> and --block-size - 1 "
                     "tokens of the file; use --block-size 2 or more")
    size = 0 if args.data is None else Path(args.data).stat().st_size
    if args.data is not None and size < args.block_size - 1:  # a token spells at least one byte
        parser.error(f"--data {args.data} has {size} bytes, fewer than the {args.block_size - 1} tokens of text in "
                     f"one block of --block-size {args.block_size}; give a longer file or --block-size {size + 1}")
    if args.data is not None and args.vocab_size < (smallest := smallest_vocabulary(args.chat_template)):
        parser.error(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's fixed entries ({BYTE_ALPHABET} "
                     f"bytes and {smallest - BYTE_ALPHABET} special tokens); use --vocab-size {smallest} or more")
    args.data_sha256 = None if args.data is None else file_sha256(args.data)
    if problem := backend_problem(args.attn_implementation):
        parser.error(f"--attn-implementation {args.attn_implementation} cannot run on this machine ({problem}); use "
                     "--attn-implementation sdpa")
    check_output_folder(args, parser)


def common_options() -> argparse.ArgumentParser:
    """Options every command takes."""
    common = Parser(add_help=False)
    common.add_argument("--threads", type=positive_int,
                        help="CPU threads (default: 1 for models under 10M parameters or machines with <= 2 cores, "
                             "else half the cores; more threads than that oversubscribe a busy machine)")
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return common


def add_train_parser(commands, common) -> Parser:
    parser = commands.add_parser("train", parents=[common], help="train a tiny model (default: synthetic retrieval)",
                                 description="Train a DIFF model with Trainer, save it, reload it and generate.")
    parser.add_argument("--data", type=text_file,
                        help="a UTF-8 text file to train on, with a byte-level BPE tokenizer trained on it; "
                             "omitted: the built-in synthetic key/value retrieval task")
    parser.add_argument("--output", default="runs/diff-tiny", help="folder for the model and tokenizer")
    parser.add_argument("--max-steps", type=positive_int, default=10000, help="training budget in optimizer steps")
    parser.add_argument("--minutes", type=positive_float,
                        help="optional wall-clock cap; warns when it stops training before --max-steps")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="sequences per optimizer step")
    parser.add_argument("--learning-rate", type=positive_float, default=5e-3, help="peak AdamW learning rate (cosine)")
    parser.add_argument("--hidden-size", type=positive_int, default=64, help="model width")
    parser.add_argument("--embedding-multiplier", type=embedding_multiplier,
                        help="token embeddings x this in the forward (config.json's embedding_multiplier): a number "
                             "> 0, or 'sqrt' for sqrt(--hidden-size) (default: 1.0 on the built-in task, the "
                             "recipe measured over seeds in benchmarks/RESULTS.md; 'sqrt' on --data)")
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=positive_int, default=4,
                        help="differential heads h; head_dim = hidden-size / (2h)")
    parser.add_argument("--block-size", type=positive_int,
                        help="sequence length for --data, and the model's context if above 256 (default: 128)")
    parser.add_argument("--vocab-size", type=positive_int, help="BPE vocabulary size for --data (default: 2048)")
    parser.add_argument("--examples", type=positive_int,
                        help="synthetic training sequences of the built-in task (default: 100000)")
    parser.add_argument("--pairs", type=positive_int, help="key/value pairs per synthetic sequence (default: 2)")
    parser.add_argument("--keys", type=positive_int, help="distinct keys (and values) of the synthetic task "
                                                          "(default: 16)")
    parser.add_argument("--attn-implementation", default="sdpa", choices=ATTENTION_IMPLEMENTATIONS,
                        help="attention backend (docs/backends.md); diff_flash needs CUDA and triton")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (also on CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and order")
    parser.add_argument("--chat-template", action="store_true",
                        help="save the built-in chat template (<|user|>...</s><|assistant|>...</s>) with the "
                             "tokenizer; the built-in task then trains on chat turns")
    parser.add_argument("--prompt", help="prompt for the closing generation (default: a held-out task prompt, or "
                                         "'ROMEO:' with --data)")
    parser.add_argument("--max-new-tokens", type=positive_int,
                        help="tokens of the closing generation (default: the expected answer's, or 8 on --data)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the saved model in --output (refused without it), or start a new run where "
                             "--output holds checkpoints")
    parser.add_argument("--save-steps", type=positive_int,
                        help="save a checkpoint (weights, optimizer, scheduler, RNG, data position) into "
                             "--output/checkpoint-STEP every N steps (default: only on Ctrl-C or SIGTERM); the "
                             "finished model replaces them")
    parser.add_argument("--save-total-limit", type=positive_int, default=2,
                        help="checkpoints to keep; older ones are deleted")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --output (give the run's options "
                             "again: another value is refused, but for --change)")
    parser.add_argument("--change", action="append", metavar="OPTION",
                        choices=[name.replace("_", "-") for name in RESUME_CHANGEABLE],
                        help="with --resume: train on with this option's new value (learning-rate, max-steps, bf16, "
                             "save-steps; repeatable), recorded in training_args.json")
    parser.add_argument("--progress-seconds", type=non_negative_float, default=60,
                        help="off a terminal, print a loss line at least this often (besides each quarter of the "
                             "run); 0: at every log")
    parser.set_defaults(check=check_train_args)
    return parser


def add_generate_parser(commands, common) -> Parser:
    parser = commands.add_parser("generate", parents=[common], help="generate from a saved model folder",
                                 description="Continue a prompt with pipeline('text-generation').")
    parser.add_argument("model", type=diff_model_folder, help="saved DIFF model folder (model + tokenizer)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--truncate-prompt", action="store_true",
                        help="keep the end of a prompt too long for the model's context (refused without it)")
    return parser


def add_convert_parser(commands, common) -> Parser:
    parser = commands.add_parser("convert", parents=[common],
                                 help="convert a Llama/Mistral/Qwen2, DiffLlama or Motif-2 model",
                                 description="Convert a checkpoint into a DIFF model with the same logits.")
    parser.add_argument("src", type=local_folder_or_hub_id, help="source folder or Hub id")
    parser.add_argument("out", help="output folder (model, generation config, tokenizer files)")
    parser.add_argument("--layers", type=parse_layers,
                        help="0-based layers to make differential, e.g. '1-11' or '2,4' (default: all)")
    parser.add_argument("--allow-sliding-window", action="store_true",
                        help="convert a sliding-window model anyway (outputs match only within the window)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype to load and save in ('auto': the checkpoint's)")
    parser.add_argument("--ignore-field", action="append", metavar="NAME",
                        help="Motif-2 only: a config.json field you have checked does not change the outputs "
                             "(the converter refuses set fields it does not know); repeatable")
    parser.add_argument("--expand-noise-heads", action="store_true",
                        help="Motif-2-12.7B only: write plain DIFF, each grouped noise head copied to every head of "
                             "its group (more parameters; for servers and tools without grouped noise heads)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the saved model in OUT, the whole folder (refused without it)")
    parser.set_defaults(check=check_convert_args)
    return parser


def add_eval_needle_parser(commands, common) -> Parser:
    parser = commands.add_parser("eval-needle", parents=[common], help="multi-needle retrieval accuracy",
                                 description="Multi-needle retrieval (paper §3.4): greedy accuracy per context length "
                                             "and answer depth. Writes PREFIX.md and, with matplotlib, PREFIX.png.")
    parser.add_argument("model", type=model_folder,
                        help="saved model folder with a tokenizer for English text (any causal LM, for baselines)")
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096],
                        help="prompt lengths in tokens (context + question)")
    parser.add_argument("--depths", type=percent, nargs="+", default=[0, 25, 50, 75, 100],
                        help="depth of the queried needles in the context, in %%")
    parser.add_argument("--needles", type=positive_int, default=6,
                        help="needles N in the context (at most one per built-in city)")
    parser.add_argument("--queries", type=positive_int, default=2,
                        help="queried needles R (<= --needles), placed together at the depth")
    parser.add_argument("--samples", type=positive_int, default=5, help="prompts per (length, depth)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--output", default="runs/needle", help="output prefix: PREFIX.md and PREFIX.png")
    parser.set_defaults(check=check_output_prefix)
    return parser


def add_attention_noise_parser(commands, common) -> Parser:
    parser = commands.add_parser("attention-noise", parents=[common], help="attention to the answer vs the rest",
                                 description="Attention of the answering position to the answer needle and to the "
                                             "rest of the context (paper Table 3): normalised (each head's row over "
                                             "its sum, 1 - lambda: the paper's comparison), raw and the share "
                                             "answer / (answer + noise), overall and per layer. Writes PREFIX.md "
                                             "and, with matplotlib, PREFIX.png.")
    parser.add_argument("model", type=diff_model_folder, help="saved DIFF model folder with its tokenizer")
    parser.add_argument("--baseline", type=model_folder,
                        help="saved baseline (e.g. LlamaForCausalLM) using the same tokenizer")
    parser.add_argument("--length", type=positive_int, default=1024, help="prompt length in tokens")
    parser.add_argument("--needles", type=positive_int, default=6,
                        help="needles in the context (at most one per built-in city)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt")
    parser.add_argument("--output", default="runs/attention_noise", help="output prefix: PREFIX.md and PREFIX.png")
    parser.set_defaults(check=check_output_prefix)
    return parser


def add_outliers_parser(commands, common) -> Parser:
    parser = commands.add_parser("outliers", parents=[common], help="top-k activation magnitudes vs the median",
                                 description="Top-k magnitudes and the exact median of attention logits (both "
                                             "branches pooled, and each branch of a differential layer) and hidden "
                                             "states (every decoder layer's output), over all layers together "
                                             "(paper Table 5).")
    parser.add_argument("model", type=diff_model_folder, help="saved DIFF model folder with its tokenizer")
    parser.add_argument("--baseline", type=model_folder, help="saved baseline model using the same tokenizer")
    parser.add_argument("--length", type=positive_int, default=512, help="tokens of the probe text")
    parser.add_argument("--top-k", type=positive_int, default=3, help="largest magnitudes to report")
    parser.add_argument("--seed", type=int, default=0, help="seed of the probe text")
    return parser


def add_upload_parser(commands, common) -> Parser:
    parser = commands.add_parser("upload", parents=[common], help="publish a saved folder to the Hugging Face Hub",
                                 description="Write the model card, code and client defaults into a saved folder, "
                                             "check that it loads with trust_remote_code=True, then upload it.")
    parser.add_argument("model_dir", type=Path, help="folder written by save_pretrained (model + tokenizer)")
    parser.add_argument("repo_id", help="Hub repository, 'user-or-org/model-name'")
    parser.add_argument("--dry-run", action="store_true", help="prepare and check the folder, do not upload")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--license", default="mit", help="license id for the model card (the package's is mit)")
    parser.set_defaults(check=check_upload_folder)
    return parser


def add_serve_parser(commands, common) -> Parser:
    parser = commands.add_parser("serve", parents=[common], help="serve a saved folder with vLLM (OpenAI API)",
                                 description="Start vLLM's OpenAI-compatible server on a saved DIFF model folder.")
    parser.add_argument("model", type=diff_model_folder, help="folder written by save_pretrained (model + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype: float32, bfloat16, float16, or auto: the "
                                                    "folder's dtype on a CPU, vLLM's choice on a GPU")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the config's)")
    parser.add_argument("--kv-cache-gib", type=int, default=1,
                        help="KV-cache size in GiB on vLLM's CPU build (VLLM_CPU_KVCACHE_SPACE; GPUs size it)")
    parser.add_argument("--served-model-name", help="model name clients send (default: the folder path)")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="ranks each layer is sharded over (vLLM's; 1 or 2 verified, docs/serving.md)")
    parser.add_argument("--pipeline-parallel-size", type=positive_int, default=1,
                        help="stages the layers are split into (vLLM's; 1 or 2 verified)")
    parser.add_argument("--api-key-file", metavar="FILE",
                        help="a file whose first line is the key clients must send (Authorization: Bearer KEY); "
                             "passed to vLLM in its environment, never on a command line. VLLM_API_KEY in the "
                             "environment works too")
    parser.add_argument("--vllm-args", default="", help="more vLLM server options, one string "
                                                        "(e.g. \"--seed 0 --enforce-eager\")")
    parser.verbatim_options = ("--vllm-args",)
    return parser


# The commands, in the order --help lists them: each adds its parser, named NAME, and runs as COMMANDS[NAME].
PARSERS = (add_train_parser, add_generate_parser, add_convert_parser, add_eval_needle_parser,
           add_attention_noise_parser, add_outliers_parser, add_upload_parser, add_serve_parser)
# What each command runs, as "module:function": imported only once the arguments are checked (with torch).
COMMANDS = {
    "train": "diff_transformer.tools.commands:run_train",
    "generate": "diff_transformer.tools.commands:run_generate",
    "convert": "diff_transformer.tools.commands:run_convert",
    "eval-needle": "diff_transformer.tools.commands:run_eval_needle",
    "attention-noise": "diff_transformer.tools.commands:run_attention_noise",
    "outliers": "diff_transformer.tools.commands:run_outliers",
    "upload": "diff_transformer.tools.commands:run_upload",
    "serve": "diff_transformer.serving.server:serve",
}


def runner(command: str) -> Callable[[argparse.Namespace], None]:
    """The function that runs `command` (`COMMANDS`), imported here, with torch."""
    module, _, function = COMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), function)


def build_parser() -> Parser:
    parser = Parser(prog="diff-transformer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(required=True, dest="command", metavar="COMMAND")
    common = common_options()
    for add in PARSERS:
        command = add(commands, common)
        command.set_defaults(command_parser=command)
    return parser


def refused_pickle(args: argparse.Namespace) -> str:
    """The answer where torch.load (weights_only=True) refused a pickled weight file: which of the command's folders'
    pickles it may be, and the fix that runs none of their code (torch's own message suggests weights_only=False)."""
    folders = [value for value in vars(args).values() if isinstance(value, (str, Path)) and Path(value).is_dir()]
    files = [str(Path(folder) / name) for folder in folders for name in saved_folder.pickled_files(folder)]
    return (f"refused to load the pickled weights {', '.join(files) or 'of the model'}: they hold more than tensors "
            "(torch.load with weights_only=True), and loading a pickle runs code its author chose; do not pass "
            "weights_only=False: use the model's safetensors weights, or convert it to safetensors with a tool you "
            "trust")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    command = args.command_parser
    if hasattr(args, "check"):
        args.check(args, command)
    # torch's weights-only unpickler warns of the protocol of a pickle it then refuses (one line says why)
    warnings.filterwarnings("ignore", message="Detected pickle protocol")
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    try:
        runner(args.command)(args)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: what it stopped, in one line
        if args.debug:
            raise
        code = getattr(stop, "exit_code", 128 + signal.SIGINT)
        command.exit(code, f"{command.prog}: {str(stop) or 'interrupted'}\n")
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met more than tensors: refused, and said so
        if args.debug:
            raise
        command.exit(2, f"{command.prog}: error: {refused_pickle(args)} (--debug shows the traceback)\n")
    except (ValueError, OSError) as error:  # the libraries' answers to a user's mistake name the fix
        if args.debug:
            raise
        command.exit(2, f"{command.prog}: error: {' '.join(str(error).split())} (--debug shows the traceback)\n")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
