"""`diff-transformer` command line: train a tiny DIFF model (arXiv 2410.05258), generate from a saved one, convert
checkpoints, evaluate retrieval, attention noise and outliers, upload to the Hub and serve with vLLM. Add --debug to
any command to see a traceback."""

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PrinterCallback,
    ProgressCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    pipeline,
    set_seed,
)

from .. import DiffConfig, DiffForCausalLM
from ..configuration_diff import check_local_path, check_model_type
from .data import (
    KeyValueTask,
    TokenBlocks,
    read_json,
    read_text_file,
    retrieval_accuracy,
    task_dataset,
    text_file_dataset,
)
from ..serving import add_serve_arguments, serve
from .evaluation import CITIES
from .tokenizer import CHAT_TEMPLATE, CHAT_TOKENS, train_bpe_tokenizer

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flex_attention", "diff_flash")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
SMALL_MODEL = 10_000_000  # parameters: below this one thread is fastest, and more oversubscribe a busy machine
TRAINING_OPTIONS = (  # what training_args.json records of `train`'s options
    "data", "max_steps", "minutes", "batch_size", "learning_rate", "hidden_size", "layers", "heads", "block_size",
    "vocab_size", "examples", "pairs", "keys", "attn_implementation", "bf16", "seed", "chat_template",
)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what it stopped; the command line prints it in one line."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default where it has one (not for None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with errors on one line (usage lines omitted: --help shows them), exit status 2, and defaults
    shown in --help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)

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


def percent(text: str) -> float:
    if not 0 <= as_float(text) <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} must be a percentage between 0 and 100")
    return float(text)


def text_file(text: str) -> str:
    """A readable UTF-8 text file (checked up front: training a tokenizer on anything else fails obscurely)."""
    try:
        read_text_file(text)
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def folder_config(text: str) -> dict:
    """config.json of a local folder written by save_pretrained, with a tokenizer."""
    folder = Path(text)
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text} (looked in {os.getcwd()})")
    if not (folder / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} has no config.json, so it is no saved model folder; "
                                         f"model.save_pretrained({text!r}) writes one")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise argparse.ArgumentTypeError(f"{text} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); save the "
                                         f"model's tokenizer there with tokenizer.save_pretrained({text!r})")
    try:
        return read_json(folder / "config.json")
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}; fix it, or save the model again with save_pretrained") from None


def model_folder(text: str) -> str:
    """A local folder written by save_pretrained: a readable config.json and a tokenizer."""
    folder_config(text)
    return text


def diff_model_folder(text: str) -> str:
    """A model folder whose config is a DIFF Transformer's."""
    try:
        check_model_type(folder_config(text), text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def nearest_existing(path: Path) -> Path:
    """`path` itself when it exists, else its closest existing parent."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written into `folder` (made with its parents where missing), or None: probed with a real
    file, which also finds read-only mounts."""
    existing = nearest_existing(folder)
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


def check_output_folder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """train's --output: writable, and not a saved model unless --overwrite."""
    problem = unwritable(Path(args.output))
    if problem:
        parser.error(f"--output {args.output}: {problem}; choose another --output")
    if (Path(args.output) / "config.json").is_file() and not args.overwrite:
        parser.error(f"--output {args.output} already holds a saved model (config.json); pass --overwrite to "
                     "replace it, or choose another --output")


def remove_created_folders(folder: Path, existing: Path) -> None:
    """Remove `folder` and its parents up to `existing` (which existed before this run) where they are empty."""
    folder = folder.absolute()
    while folder != existing and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def model_context(folder: str) -> int | None:
    """The context of the model in `folder`: its config's max_position_embeddings, where it has one."""
    return getattr(AutoConfig.from_pretrained(folder), "max_position_embeddings", None)


def check_context(folder: str, tokens: int, what: str) -> None:
    """`tokens` fit the context of the model in `folder`."""
    context = model_context(folder)
    if context is not None and tokens > context:
        raise ValueError(f"{what} asks for {tokens} tokens, more than the context of {folder} ({context} tokens, "
                         f"max_position_embeddings); use at most {context}")


def local_folder_or_hub_id(text: str) -> str:
    """A local folder or a Hub id; a missing local folder fails here rather than after a minute of Hub retries."""
    try:
        check_local_path(text)
    except FileNotFoundError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def parse_layers(text: str) -> list[int]:
    """'1-11' or '1,3,5' (0-based, ranges inclusive) -> layer indices."""
    layers = []
    for part in text.split(","):
        start, _, end = part.strip().partition("-")
        if not start.isdigit() or not (end or start).isdigit() or int(end or start) < int(start):
            raise argparse.ArgumentTypeError(f"{text!r}: give 0-based layers as a range '1-11' or a list '2,4'")
        layers.extend(range(int(start), int(end or start) + 1))
    return layers


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(requested: int | None, model: torch.nn.Module) -> None:
    """--threads, else one thread for a small model or a machine with <= 2 cores, else half the cores."""
    cores, parameters = usable_cores(), model.num_parameters()
    if requested is not None:
        threads, reason = requested, "--threads"
    elif parameters < SMALL_MODEL or cores <= 2:
        threads, reason = 1, f"auto for a {parameters / 1e6:.2f}M-parameter model on {cores} cores"
    else:
        threads, reason = cores // 2, f"auto: half of {cores} cores"
    torch.set_num_threads(threads)
    print(f"using {threads} CPU thread{'s' if threads > 1 else ''} ({reason}; --threads N sets it)")


class TimeLimit(TrainerCallback):
    """An optional wall-clock cap on top of the step budget; says so loudly when it cuts training short, since the
    result then depends on the machine's speed and load."""

    def __init__(self, minutes: float):
        self.minutes = minutes
        self.deadline = time.monotonic() + 60 * minutes

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() > self.deadline and state.global_step < state.max_steps:
            control.should_training_stop = True
            print(f"WARNING: --minutes {self.minutes:g} stopped training at step {state.global_step} of "
                  f"{state.max_steps}; the model may be undertrained (drop --minutes to train all steps)")


class QuietProgress(ProgressCallback):
    """The progress bar with the latest loss on it, and one summary line per quarter of the run instead of every
    log dict."""

    def __init__(self):
        super().__init__()
        self.quarter = 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.training_bar is None or "loss" not in (logs or {}):
            return
        self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}")
        if state.global_step >= self.quarter * state.max_steps / 4:
            self.training_bar.write(f"step {state.global_step}/{state.max_steps}: loss {logs['loss']:.4f}")
            while self.quarter * state.max_steps / 4 <= state.global_step:
                self.quarter += 1

    def close(self) -> None:
        """End the bar's line (on_train_end does, but Ctrl-C skips it)."""
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


def tiny_config(tokenizer, args: argparse.Namespace) -> DiffConfig:
    return DiffConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 8 / 3) // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=max(args.block_size, 256),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )


def build_data(args: argparse.Namespace):
    if args.data is None:
        task = KeyValueTask(num_keys=args.keys, num_values=args.keys, num_pairs=args.pairs)
        tokenizer = task.tokenizer(chat=args.chat_template)
        return task, tokenizer, task_dataset(task, tokenizer, args.examples, seed=args.seed)
    chat = {"chat_template": CHAT_TEMPLATE, "extra_special_tokens": CHAT_TOKENS} if args.chat_template else {}
    tokenizer = train_bpe_tokenizer(files=[args.data], vocab_size=args.vocab_size, **chat)
    return None, tokenizer, text_file_dataset(args.data, tokenizer, args.block_size)


def training_generation_config(tokenizer, dataset: TokenBlocks) -> GenerationConfig:
    """Generation defaults as the model was trained: its special tokens, and at most as many tokens (prompt included)
    as its longest training sequence."""
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_length=max(len(block) for block in dataset.blocks),
    )


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.output,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(100, args.max_steps // 10),
        logging_steps=max(1, min(50, args.max_steps // 20)),
        save_strategy="no",
        report_to=[],
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),  # bf16 on a CPU-only machine needs it said
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=False,  # QuietProgress replaces the log printing
    )


def check_train_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.hidden_size % (2 * args.heads):
        parser.error(f"--hidden-size ({args.hidden_size}) must be a multiple of 2 * --heads ({2 * args.heads}): "
                     "each head has two query/key sub-heads of hidden / (2 heads) dims")
    if args.data is None and args.pairs > args.keys:
        parser.error(f"--pairs ({args.pairs}) cannot exceed --keys ({args.keys}): each pair uses a distinct key")
    check_output_folder(args, parser)


def run_training(trainer: Trainer, progress: QuietProgress, output: Path, existing: Path):
    """trainer.train(); Ctrl-C ends it as `Interrupted` naming the step, after removing the empty folders that
    Trainer made for `output` below `existing` (the part of the path there before this run)."""
    try:
        return trainer.train()
    except KeyboardInterrupt:
        progress.close()
        remove_created_folders(output, existing)
        raise Interrupted(f"interrupted at step {trainer.state.global_step} of {trainer.state.max_steps}; "
                          "nothing saved") from None


def save_training_args(args: argparse.Namespace, result, folder: Path) -> None:
    """training_args.json: the options this run was given and what it did (the Hub model card reads it)."""
    record = {
        "command": "diff-transformer train",
        "options": {name: getattr(args, name) for name in TRAINING_OPTIONS},
        "steps": result.global_step,
        "mean_training_loss": result.training_loss,
    }
    (folder / "training_args.json").write_text(json.dumps(record, indent=2) + "\n")


def train(args: argparse.Namespace) -> None:
    existing = nearest_existing(Path(args.output))
    set_seed(args.seed)
    task, tokenizer, dataset = build_data(args)
    model = DiffForCausalLM._from_config(tiny_config(tokenizer, args), attn_implementation=args.attn_implementation)
    print(f"DiffForCausalLM: {model.num_parameters() / 1e6:.2f}M parameters, {len(dataset)} training sequences")
    set_threads(args.threads, model)
    callbacks = [] if args.minutes is None else [TimeLimit(args.minutes)]
    trainer = Trainer(model=model, args=training_arguments(args), train_dataset=dataset, callbacks=callbacks)
    for printer in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(printer)
    progress = QuietProgress()
    trainer.add_callback(progress)
    result = run_training(trainer, progress, Path(args.output), existing)
    print(f"trained {result.global_step} steps in {result.metrics['train_runtime']:.0f} s, "
          f"mean loss {result.training_loss:.4f}")
    model.generation_config = training_generation_config(tokenizer, dataset)
    tokenizer.model_max_length = model.config.max_position_embeddings
    trainer.save_model(args.output)
    tokenizer.save_pretrained(args.output)
    save_training_args(args, result, Path(args.output))
    print(f"saved to {args.output}")
    reloaded = AutoModelForCausalLM.from_pretrained(args.output).eval()
    print(f"reloaded through AutoModelForCausalLM: {type(reloaded).__name__}")
    if task is not None:
        print(f"retrieval accuracy on held-out prompts: {retrieval_accuracy(reloaded, tokenizer, task):.3f}")
        prompt, answer = task.example(random.Random(args.seed + 1))
        args.prompt = args.prompt or prompt
        print(f"expected answer: {answer}")
        answer_tokens = len(tokenizer(" " + answer, add_special_tokens=False)["input_ids"])
    new_tokens = args.max_new_tokens or (answer_tokens if task is not None else 8)
    generate_text(args.output, args.prompt or "ROMEO:", new_tokens, sample=False, model=reloaded)


def generate_text(model_dir: str, prompt: str, max_new_tokens: int, sample: bool, model=None, tokenizer=None) -> str:
    """Continue `prompt`; a folder whose tokenizer has a chat template gets it as a user turn and answers with the
    assistant's reply."""
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
    generator = pipeline("text-generation", model=model or AutoModelForCausalLM.from_pretrained(model_dir),
                         tokenizer=tokenizer)
    generator.model.generation_config.max_length = None  # the folder's default length; this call sets max_new_tokens
    chat = tokenizer.chat_template is not None
    inputs = [{"role": "user", "content": prompt}] if chat else prompt
    # explicit: transformers 5.17's pipeline cleans up spaces by default ("k9 ? ?" -> "k9??"), newer ones do not
    outputs = generator(inputs, max_new_tokens=max_new_tokens, do_sample=sample, return_full_text=True,
                        clean_up_tokenization_spaces=False)
    text = outputs[0]["generated_text"][-1]["content"] if chat else outputs[0]["generated_text"]
    print(f"generated: {text}")
    return text


def prompt_length(tokenizer, prompt: str) -> int:
    """Tokens the model reads for `prompt` as `generate_text` passes it (a user turn where there is a chat template)."""
    if tokenizer.chat_template is None:
        return len(tokenizer(prompt, verbose=False)["input_ids"])
    turn = [{"role": "user", "content": prompt}]
    return len(tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenizer_kwargs={"verbose": False},
                                             return_dict=False))


def prompt_tail(tokenizer, prompt: str, budget: int) -> str:
    """The longest tail of `prompt`, cut at a token boundary, whose `prompt_length` is at most `budget`."""
    offsets = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    keep = min(len(offsets), budget - (prompt_length(tokenizer, prompt) - len(offsets)))
    while keep > 0:
        tail = prompt[offsets[-keep][0] :]
        if prompt_length(tokenizer, tail) <= budget:
            return tail
        keep -= 1  # the text cut there may tokenize a little longer
    raise ValueError(f"no part of the prompt fits in {budget} tokens with this tokenizer's chat template; "
                     "lower --max-new-tokens")


def fitted_prompt(args: argparse.Namespace, tokenizer) -> str:
    """--prompt when it and --max-new-tokens fit the model's context; its tail with --truncate-prompt (and one
    warning line); else ValueError with the numbers."""
    context = model_context(args.model)
    if context is None:
        return args.prompt
    budget = context - args.max_new_tokens
    if budget < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the context of "
                         f"{args.model} ({context} tokens, max_position_embeddings); use at most {context - 1}")
    length = prompt_length(tokenizer, args.prompt)
    if length <= budget:
        return args.prompt
    if not args.truncate_prompt:
        raise ValueError(f"the prompt is {length} tokens, and with --max-new-tokens {args.max_new_tokens} needs "
                         f"{length + args.max_new_tokens}, more than the context of {args.model} ({context} tokens, "
                         f"max_position_embeddings); shorten it, lower --max-new-tokens, or pass --truncate-prompt to "
                         f"keep its last {budget} tokens")
    tail = prompt_tail(tokenizer, args.prompt, budget)
    print(f"diff-transformer generate: warning: the prompt is {length} tokens; kept its last "
          f"{prompt_length(tokenizer, tail)} (--truncate-prompt) so that it and --max-new-tokens "
          f"{args.max_new_tokens} fit the context of {context} tokens", file=sys.stderr)
    return tail


def run_generate(args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt = fitted_prompt(args, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    set_threads(args.threads, model)
    generate_text(args.model, prompt, args.max_new_tokens, args.sample, model=model, tokenizer=tokenizer)


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
    parser.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=positive_int, default=4,
                        help="differential heads h; head_dim = hidden-size / (2h)")
    parser.add_argument("--block-size", type=positive_int, default=128, help="sequence length for --data")
    parser.add_argument("--vocab-size", type=positive_int, default=2048, help="BPE vocabulary size for --data")
    parser.add_argument("--examples", type=positive_int, default=100_000, help="synthetic training sequences")
    parser.add_argument("--pairs", type=positive_int, default=KeyValueTask.num_pairs,
                        help="key/value pairs per synthetic sequence")
    parser.add_argument("--keys", type=positive_int, default=KeyValueTask.num_keys,
                        help="distinct keys (and values) of the synthetic task")
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
                        help="replace the saved model in --output (refused without it)")
    parser.set_defaults(func=train, check=check_train_args)
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
    parser.set_defaults(func=run_generate)
    return parser


def run_convert(args: argparse.Namespace) -> None:
    from .convert import added_parameters, convert_checkpoint

    options = {} if args.layers is None else {"layers": args.layers}
    if args.allow_sliding_window:
        options["allow_sliding_window"] = True
    model = convert_checkpoint(args.src, args.out, dtype=args.dtype, **options)
    added = added_parameters(model)
    print(f"saved {type(model).__name__} to {args.out}: attention_types={model.config.attention_types}, "
          f"{added:,} parameters added ({added / (model.num_parameters() - added):+.2%})")


def add_convert_parser(commands, common) -> Parser:
    parser = commands.add_parser("convert", parents=[common], help="convert a Llama/Mistral/Qwen2 or DiffLlama model",
                                 description="Convert a checkpoint into a DIFF model with the same logits.")
    parser.add_argument("src", type=local_folder_or_hub_id, help="source folder or Hub id")
    parser.add_argument("out", help="output folder (model, generation config, tokenizer files)")
    parser.add_argument("--layers", type=parse_layers,
                        help="0-based layers to make differential, e.g. '1-11' or '2,4' (default: all)")
    parser.add_argument("--allow-sliding-window", action="store_true",
                        help="convert a sliding-window model anyway (outputs match only within the window)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype to load and save in ('auto': the checkpoint's)")
    parser.set_defaults(func=run_convert)
    return parser


def load_models(args: argparse.Namespace, attn_implementation: str) -> dict[str, tuple]:
    """{"diff": (model, tokenizer)} plus "baseline" when given; sets the thread count from the model's size. First
    (before loading a model) every tokenizer must spell the evaluation's texts, the baseline's as the model's does,
    and --length must fit every model's context."""
    from .evaluation import check_same_encoding, check_tokenizer, load_model

    folders = {"diff": args.model} if args.baseline is None else {"diff": args.model, "baseline": args.baseline}
    tokenizers = {name: AutoTokenizer.from_pretrained(folder) for name, folder in folders.items()}
    for name, folder in folders.items():
        check_tokenizer(tokenizers[name], folder)
        check_context(folder, args.length, f"--length {args.length}")
    if args.baseline is not None:
        check_same_encoding(tokenizers["diff"], tokenizers["baseline"], args.model, args.baseline)
    models = {name: (load_model(folder, attn_implementation), tokenizers[name]) for name, folder in folders.items()}
    set_threads(args.threads, models["diff"][0])
    return models


def run_eval_needle(args: argparse.Namespace) -> None:
    from .evaluation import NeedleSettings, load, run_needle_cli

    settings = NeedleSettings(lengths=args.lengths, depths=args.depths, needles=args.needles,
                              queries=args.queries, samples=args.samples, seed=args.seed)
    check_context(args.model, max(args.lengths), f"--lengths {' '.join(map(str, args.lengths))}")
    model, tokenizer = load(args.model)
    set_threads(args.threads, model)
    run_needle_cli(model, tokenizer, Path(args.model).name, settings, args.output)


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
    parser.add_argument("--needles", type=positive_int, default=6, help=f"needles N in the context (at most {len(CITIES)})")
    parser.add_argument("--queries", type=positive_int, default=2,
                        help="queried needles R (<= --needles), placed together at the depth")
    parser.add_argument("--samples", type=positive_int, default=5, help="prompts per (length, depth)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--output", default="needle", help="output prefix: PREFIX.md and PREFIX.png")
    parser.set_defaults(func=run_eval_needle, check=check_output_prefix)
    return parser


def run_attention_noise(args: argparse.Namespace) -> None:
    from .evaluation import run_attention_noise_cli

    run_attention_noise_cli(load_models(args, "eager"), args.length, args.needles, args.seed, args.output)


def add_attention_noise_parser(commands, common) -> Parser:
    parser = commands.add_parser("attention-noise", parents=[common], help="attention to the answer vs the rest",
                                 description="Attention of the answering position to the answer needle and to the "
                                             "rest of the context per layer (paper Table 3). Writes PREFIX.md and, "
                                             "with matplotlib, PREFIX.png.")
    parser.add_argument("model", type=diff_model_folder, help="saved DIFF model folder with its tokenizer")
    parser.add_argument("--baseline", type=model_folder,
                        help="saved baseline (e.g. LlamaForCausalLM) using the same tokenizer")
    parser.add_argument("--length", type=positive_int, default=1024, help="prompt length in tokens")
    parser.add_argument("--needles", type=positive_int, default=6, help=f"needles in the context (at most {len(CITIES)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt")
    parser.add_argument("--output", default="attention_noise", help="output prefix: PREFIX.md and PREFIX.png")
    parser.set_defaults(func=run_attention_noise, check=check_output_prefix)
    return parser


def run_outliers(args: argparse.Namespace) -> None:
    from .evaluation import run_outliers_cli

    run_outliers_cli(load_models(args, "sdpa"), args.length, args.top_k, args.seed)


def add_outliers_parser(commands, common) -> Parser:
    parser = commands.add_parser("outliers", parents=[common], help="top-k activation magnitudes vs the median",
                                 description="Top-k magnitudes and the median of attention logits and hidden "
                                             "states (paper Table 5).")
    parser.add_argument("model", type=diff_model_folder, help="saved DIFF model folder with its tokenizer")
    parser.add_argument("--baseline", type=model_folder, help="saved baseline model using the same tokenizer")
    parser.add_argument("--length", type=positive_int, default=512, help="tokens of the probe text")
    parser.add_argument("--top-k", type=positive_int, default=3, help="largest magnitudes to report")
    parser.add_argument("--seed", type=int, default=0, help="seed of the probe text")
    parser.set_defaults(func=run_outliers)
    return parser


def run_upload(args: argparse.Namespace) -> None:
    from .hub_upload import publish

    publish(args.model_dir, args.repo_id, args.dry_run, args.private, args.license)


def add_upload_parser(commands, common) -> Parser:
    parser = commands.add_parser("upload", parents=[common], help="publish a saved folder to the Hugging Face Hub",
                                 description="Write the model card, code and client defaults into a saved folder, "
                                             "check that it loads with trust_remote_code=True, then upload it.")
    parser.add_argument("model_dir", type=Path, help="folder written by save_pretrained (model + tokenizer)")
    parser.add_argument("repo_id", help="Hub repository, 'user-or-org/model-name'")
    parser.add_argument("--dry-run", action="store_true", help="prepare and check the folder, do not upload")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--license", default="mit", help="license id for the model card (the package's is mit)")
    parser.set_defaults(func=run_upload)
    return parser


def add_serve_parser(commands, common) -> Parser:
    parser = commands.add_parser("serve", parents=[common], help="serve a saved folder with vLLM (OpenAI API)",
                                 description="Start vLLM's OpenAI-compatible server on a saved DIFF model folder.")
    add_serve_arguments(parser)
    parser.set_defaults(func=serve)
    return parser


def build_parser() -> Parser:
    parser = Parser(prog="diff-transformer", description=__doc__)
    commands = parser.add_subparsers(required=True, dest="command", metavar="COMMAND")
    common = common_options()
    for add in (add_train_parser, add_generate_parser, add_convert_parser, add_eval_needle_parser,
                add_attention_noise_parser, add_outliers_parser, add_upload_parser, add_serve_parser):
        command = add(commands, common)
        command.set_defaults(command_parser=command)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    command = args.command_parser
    if hasattr(args, "check"):
        args.check(args, command)
    try:
        args.func(args)
    except KeyboardInterrupt as stop:  # Ctrl-C: what it stopped, in one line
        if args.debug:
            raise
        command.exit(130, f"{command.prog}: {str(stop) or 'interrupted'}\n")
    except (ValueError, OSError) as error:  # the libraries' answers to a user's mistake name the fix
        if args.debug:
            raise
        command.exit(2, f"{command.prog}: error: {' '.join(str(error).split())} (--debug shows the traceback)\n")


if __name__ == "__main__":
    main()
