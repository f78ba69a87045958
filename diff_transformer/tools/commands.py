"""What each `diff-transformer` command does, once `diff_transformer_cli` has parsed and checked its arguments:
train a tiny DIFF model (arXiv 2410.05258), generate, convert, evaluate, upload and serve."""

import argparse
import json
import os
import random
import sys
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
from diff_transformer_cli import nearest_existing

from .. import DiffConfig, DiffForCausalLM
from .data import KeyValueTask, TokenBlocks, retrieval_accuracy, task_dataset, text_file_dataset
from .tokenizer import CHAT_TEMPLATE, CHAT_TOKENS, train_bpe_tokenizer

SMALL_MODEL = 10_000_000  # parameters: below this one thread is fastest, and more oversubscribe a busy machine
TRAINING_OPTIONS = (  # what training_args.json records of `train`'s options
    "data", "max_steps", "minutes", "batch_size", "learning_rate", "hidden_size", "layers", "heads", "block_size",
    "vocab_size", "examples", "pairs", "keys", "attn_implementation", "bf16", "seed", "chat_template",
)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what it stopped; the command line prints it in one line."""


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


def run_convert(args: argparse.Namespace) -> None:
    from .convert import added_parameters, convert_checkpoint

    options = {} if args.layers is None else {"layers": args.layers}
    if args.allow_sliding_window:
        options["allow_sliding_window"] = True
    model = convert_checkpoint(args.src, args.out, dtype=args.dtype, **options)
    added = added_parameters(model)
    print(f"saved {type(model).__name__} to {args.out}: attention_types={model.config.attention_types}, "
          f"{added:,} parameters added ({added / (model.num_parameters() - added):+.2%})")


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


def run_attention_noise(args: argparse.Namespace) -> None:
    from .evaluation import run_attention_noise_cli

    run_attention_noise_cli(load_models(args, "eager"), args.length, args.needles, args.seed, args.output)


def run_outliers(args: argparse.Namespace) -> None:
    from .evaluation import run_outliers_cli

    run_outliers_cli(load_models(args, "sdpa"), args.length, args.top_k, args.seed)


def run_upload(args: argparse.Namespace) -> None:
    from .hub_upload import publish

    publish(args.model_dir, args.repo_id, args.dry_run, args.private, args.license)

