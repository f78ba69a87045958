"""What each `diff-transformer` command does, once `diff_transformer_cli` has parsed and checked its arguments:
train a tiny DIFF model (arXiv 2410.05258), generate, convert, evaluate and upload (`diff_transformer_cli.COMMANDS`
names the function each command runs; `serve` runs `serving.server.serve`)."""

import argparse
import json
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline, set_seed
from transformers import dynamic_module_utils
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging as hf_logging

from .. import DiffConfig, DiffForCausalLM
from ..folder_defaults import generation_defaults
from ..saved_folder import check_weights_manifest, checkpoint_step, nearest_existing, read_config, read_json
from ..tokenization_diff import CHAT_TEMPLATE, CHAT_TOKENS, check_known_words, train_bpe_tokenizer
from .data import KeyValueTask, retrieval_accuracy, task_dataset, text_file_dataset
from .model_size import check_model_size, header_shapes
from .safe_write import RUN_RECORD, kill_point, staged_folder, tensor_bytes, write_file, write_text
from .training import (
    TERMINAL,
    NonFiniteStopCallback,
    ResumedRun,
    TimeLimit,
    clear_run,
    cli_trainer,
    nothing_half_written,
    train_until_stopped,
    training_arguments,
)

# The largest |weight| a loaded model may hold. Above float16's range (65504), so every value a float16 checkpoint can
# hold passes; trained LLMs stay far below (norm gains and embeddings under 1e3; this repository's trained folders
# under 3), while a flipped high exponent bit of a weight near 0.01-1 gives 1e6 to 1e38.
MAX_WEIGHT = 1e5
SMALL_MODEL = 10_000_000  # parameters: below this one thread is fastest, and more oversubscribe a busy machine
TRAINING_OPTIONS = (  # what training_args.json records of `train`'s options
    "data", "max_steps", "minutes", "batch_size", "learning_rate", "hidden_size", "embedding_multiplier", "layers",
    "heads", "block_size", "vocab_size", "examples", "pairs", "keys", "attn_implementation", "bf16", "seed",
    "chat_template", "save_steps", "save_total_limit", "resume",
)


# No command waits on stdin: where a folder's code would run (auto_map without a registered model_type), transformers
# asks whether to trust it and waits 15 s for an answer; at 0 it refuses at once, naming trust_remote_code, as it does
# in its own CI. The commands load our model through the registered classes and never need the folder's copy.
dynamic_module_utils.TIME_OUT_REMOTE_CODE = 0
if not TERMINAL:  # progress bars redraw in place on a terminal; in a log file they are plain lines
    hf_logging.disable_progress_bar()


def load_config(folder: str):
    """The folder's config, read first by every command: a DiffConfig refuses a bad field here with its own message
    (AutoTokenizer, reading it first, would fall back on a bare config and fail with another). Never asks on stdin
    whether to run remote code."""
    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def load_tokenizer(folder: str):
    """The folder's tokenizer; a tokenizer file that is not JSON is named with the fix (transformers' message names
    none)."""
    config = load_config(folder)
    try:
        return AutoTokenizer.from_pretrained(folder, config=config, trust_remote_code=False)
    except ValueError:
        for path in sorted(Path(folder).glob("*.json")):
            if path.name.startswith(("tokenizer", "special_tokens_map", "added_tokens", "chat_template")):
                read_tokenizer_json(path)
        raise


def read_tokenizer_json(path: Path) -> None:
    """`ValueError` naming `path` and the position where it stops being JSON."""
    try:
        read_json(path)
    except ValueError as error:
        raise ValueError(f"{error}; the file is damaged: copy or download the folder again, or save the tokenizer "
                         "again with tokenizer.save_pretrained") from None


def mismatched_shapes(folder: str, config) -> list[str]:
    """"name: S in the file, T for config.json" for each weight of the folder whose shape does not fit its config."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    found = []
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, shape in header_shapes(file).items():
            if name in expected and shape != expected[name]:
                found.append(f"{name}: {list(shape)} in {file.name}, {list(expected[name])} for config.json")
    return found


def listed(items: list[str]) -> str:
    """The first three of `items`, and how many more."""
    return f"{', '.join(items[:3])}{f' and {len(items) - 3} more' if len(items) > 3 else ''}"


def peak_magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """max |x| of `tensor` (NaN where it holds one), without a copy of it: from its min and max."""
    low, high = torch.aminmax(tensor.detach())
    return torch.maximum(-low, high).float()


def check_finite_weights(model: torch.nn.Module, what: str) -> None:
    """`ValueError` naming the weights of `model` that hold NaN or infinite values (which make every output NaN:
    an empty answer, no error), or values beyond `MAX_WEIGHT` (a flipped exponent bit: finite, and the logits NaN)."""
    peaks = {name: peak_magnitude(p) for name, p in model.named_parameters() if p.numel()}
    bad = [f"{name} ({int((~torch.isfinite(p)).sum())} of {p.numel()} values)"
           for name, p in model.named_parameters() if name in peaks and not torch.isfinite(peaks[name])]
    if bad:
        raise ValueError(f"{what} has non-finite weights (NaN or inf): {listed(bad)}; its training diverged or the "
                         "file is damaged: use an earlier checkpoint, or train again with a lower learning rate")
    huge = [f"{name} (|w| up to {float(peaks[name]):.3g}, {int((p.detach().abs() > MAX_WEIGHT).sum())} of "
            f"{p.numel()} values)"
            for name, p in model.named_parameters() if name in peaks and peaks[name] > MAX_WEIGHT]
    if huge:
        raise ValueError(f"{what} has weights of absurd magnitude (above {MAX_WEIGHT:.0e}; trained models stay below "
                         f"1e3): {listed(huge)}; the file is damaged (a flipped bit) or its training diverged: copy or "
                         "download the folder again, or use an earlier checkpoint")


def check_weight_shapes(folder: str) -> None:
    """`ValueError` naming the weights of `folder` whose shape does not fit its config.json, checked before loading:
    transformers' own answer is a multi-line load report, then an error that names neither tensor nor shapes."""
    mismatched = mismatched_shapes(folder, load_config(folder))
    if mismatched:
        raise ValueError(f"the weights in {folder} do not fit its config.json: {'; '.join(mismatched[:3])}; they come "
                         "from another model: save the model and its config again together")


def load_checked_model(folder: str, **options) -> torch.nn.Module:
    """AutoModelForCausalLM from a folder, with the weights' shapes, values and checksums (where save_pretrained
    recorded them) checked, and the generation defaults of a folder saved now (an older folder's length setting
    warned on every call passing max_new_tokens)."""
    check_model_size(folder, load_config(folder))
    check_weight_shapes(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, **options)
    check_finite_weights(model, folder)
    check_weights_manifest(folder)
    generation_defaults(model.generation_config, model.config)
    return model


def model_context(folder: str) -> int | None:
    """The context of the model in `folder`: its config's max_position_embeddings, where it has one."""
    return getattr(load_config(folder), "max_position_embeddings", None)


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


def tiny_config(tokenizer, args: argparse.Namespace) -> DiffConfig:
    return DiffConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 8 / 3) // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=max(args.block_size or 0, 256),  # block_size: --data only
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        embedding_multiplier=None if args.embedding_multiplier == "sqrt" else args.embedding_multiplier,
    )


def build_data(args: argparse.Namespace):
    if args.data is None:
        task = KeyValueTask(num_keys=args.keys, num_values=args.keys, num_pairs=args.pairs)
        tokenizer = task.tokenizer(chat=args.chat_template)
        return task, tokenizer, task_dataset(task, tokenizer, args.examples, seed=args.seed)
    chat = {"chat_template": CHAT_TEMPLATE, "extra_special_tokens": CHAT_TOKENS} if args.chat_template else {}
    tokenizer = train_bpe_tokenizer(files=[args.data], vocab_size=args.vocab_size, **chat)
    return None, tokenizer, text_file_dataset(args.data, tokenizer, args.block_size)


def training_generation_config(tokenizer) -> GenerationConfig:
    """The tokenizer's special tokens, and no length of this run's (its closing demo passes max_new_tokens):
    `save_pretrained` adds the folder's default length (`folder_defaults.generation_defaults`)."""
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def run_record(args: argparse.Namespace) -> dict:
    """What identifies a run, recorded in each checkpoint (`safe_write.RUN_RECORD`) and in training_args.json: its
    options, the sha256 of its --data file, and the options changed on a resume (`--change`)."""
    return {"options": {name: getattr(args, name) for name in TRAINING_OPTIONS if name != "resume"},
            "data_sha256": getattr(args, "data_sha256", None), "changes": getattr(args, "changes", [])}


def save_training_args(args: argparse.Namespace, result, folder: Path, start: int) -> None:
    """training_args.json: the options this run was given and what it did (the Hub model card reads it); a run
    resumed from the checkpoint of step `start` records it, and the mean loss is that of the steps after it."""
    record = {
        "command": "diff-transformer train",
        "options": {name: getattr(args, name) for name in TRAINING_OPTIONS},
        "steps": result.global_step,
        "mean_training_loss": result.training_loss,
        **({"resumed_from_step": start} if start else {}),
        **{key: value for key, value in run_record(args).items() if key != "options" and value},
    }
    (folder / "training_args.json").write_text(json.dumps(record, indent=2) + "\n")


def checkpoint_files(tokenizer, record: dict) -> Callable[[Path], None]:
    """What each checkpoint holds besides Trainer's files: the tokenizer (so that `generate OUT/checkpoint-STEP`
    runs) and the run's record, which `--resume` compares its options with."""
    def write(folder: Path) -> None:
        tokenizer.save_pretrained(folder)
        kill_point("partial", folder)
        (folder / RUN_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return write


def checkpoint_result(model: torch.nn.Module, checkpoint: Path) -> TrainOutput:
    """A checkpoint of the run's last step, as training would have ended: its weights in `model`, its step, and the
    mean of the losses it logged."""
    from safetensors.torch import load_model

    load_model(model, checkpoint / "model.safetensors")  # tied weights, which the file holds once, included
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state.get("log_history", []) if "loss" in entry]
    return TrainOutput(state["global_step"], sum(losses) / max(len(losses), 1), {"train_runtime": 0.0})


def retrieval_result(task, accuracy: float) -> dict:
    """One entry of eval_results.json: the built-in task's held-out retrieval accuracy."""
    return {"task": "text-generation", "dataset": "diff-transformer key/value retrieval (built-in, synthetic)",
            "dataset_config": f"{task.num_keys} keys, {task.num_pairs} pairs", "split": "held-out prompts",
            "metric": "accuracy", "value": round(accuracy, 4),
            "command": "diff-transformer train (retrieval_accuracy over 200 held-out prompts)"}


def save_eval_results(folder: Path, results: list[dict]) -> None:
    """eval_results.json in a saved folder: what was measured on it (the Hub card's model-index reads it), written
    whole or not at all (`safe_write.write_text`)."""
    write_text(folder / "eval_results.json", json.dumps({"results": results}, indent=2) + "\n")


def resume_note(args: argparse.Namespace, checkpoint: Path) -> str:
    """Which checkpoint a resumed run continues from, after the newer ones it skipped as incomplete."""
    skipped = "".join(f"skipping {line}\n" for line in getattr(args, "skipped_checkpoints", []))
    return f"{skipped}resuming from {checkpoint} (step {checkpoint_step(checkpoint)})"


def train_from(trainer, stop, checkpoint: Path | None, max_steps: int) -> TrainOutput:
    """Train to `max_steps`, from `checkpoint` where resuming; a checkpoint of the last step is the result as it is
    (Trainer would train one step more)."""
    start = 0 if checkpoint is None else checkpoint_step(checkpoint)
    if start >= max_steps:
        print(f"{checkpoint} holds the run's last step ({start} of --max-steps {max_steps}): nothing left to train")
        return checkpoint_result(trainer.model, checkpoint)
    result = train_until_stopped(trainer, stop, checkpoint)
    steps = f"steps {start + 1}-{result.global_step}" if start else f"{result.global_step} steps"
    print(f"trained {steps} in {result.metrics['train_runtime']:.0f} s, mean loss {result.training_loss:.4f}")
    return result


def run_train(args: argparse.Namespace) -> None:
    output = Path(args.output)
    existing = nearest_existing(output)
    checkpoint = getattr(args, "resume_from", None)  # the newest complete checkpoint, chosen by the checks of --resume
    set_seed(args.seed)
    task, tokenizer, dataset = build_data(args)
    if args.prompt is not None:
        check_known_words(tokenizer, args.prompt, "--prompt")
    if args.data is not None and len(tokenizer) < args.vocab_size:
        print(f"the BPE tokenizer has {len(tokenizer)} entries, fewer than --vocab-size {args.vocab_size}: "
              f"{args.data} has no more pairs to merge")
    model = DiffForCausalLM._from_config(tiny_config(tokenizer, args), attn_implementation=args.attn_implementation)
    model.generation_config = training_generation_config(tokenizer)
    tokenizer.model_max_length = model.config.max_position_embeddings
    print(f"DiffForCausalLM: {model.num_parameters() / 1e6:.2f}M parameters, {len(dataset)} training sequences")
    set_threads(args.threads, model)
    callbacks = [NonFiniteStopCallback(f"lower --learning-rate ({args.learning_rate:g})")]
    if args.minutes is not None:
        callbacks.append(TimeLimit(args.minutes))
    if checkpoint is not None:
        changed = "learning_rate" in (getattr(args, "change", None) or ())
        callbacks.append(ResumedRun(args.learning_rate if changed else None))
    clear_run(output, checkpoint is not None)
    trainer, progress, stop = cli_trainer(model, training_arguments(args, output), dataset, callbacks,
                                          args.progress_seconds, checkpoint_files(tokenizer, run_record(args)))
    with nothing_half_written(trainer, progress, output, existing):
        start = 0 if checkpoint is None else checkpoint_step(checkpoint)
        if checkpoint is not None:
            print(resume_note(args, checkpoint))
        result = train_from(trainer, stop, checkpoint, args.max_steps)
        check_finite_weights(model, "the trained model")
        with staged_folder(output, replace=True, needed=lambda: tensor_bytes(model.state_dict().values()),
                           hint="free some space, or choose another --output") as staging:
            model.save_pretrained(staging)  # not trainer.save_model: its pickled training_args.bin is no model file
            tokenizer.save_pretrained(staging)
            save_training_args(args, result, staging, start if result.global_step > start else 0)
    print(f"saved to {args.output}")
    reloaded = load_checked_model(args.output).eval()
    print(f"reloaded through AutoModelForCausalLM: {type(reloaded).__name__}")
    if task is not None:
        accuracy = retrieval_accuracy(reloaded, tokenizer, task)
        print(f"retrieval accuracy on held-out prompts: {accuracy:.3f}")
        save_eval_results(Path(args.output), [retrieval_result(task, accuracy)])
        prompt, answer = task.example(random.Random(args.seed + 1))
        args.prompt = args.prompt or prompt
        print(f"expected answer: {answer}")
        answer_tokens = len(tokenizer(" " + answer, add_special_tokens=False)["input_ids"])
    new_tokens = args.max_new_tokens or (answer_tokens if task is not None else 8)
    generate_text(args.output, args.prompt or "ROMEO:", new_tokens, sample=False, model=reloaded)


def generate_text(model_dir: str, prompt: str, max_new_tokens: int, sample: bool, model=None, tokenizer=None) -> str:
    """Continue `prompt`; a folder whose tokenizer has a chat template gets it as a user turn and answers with the
    assistant's reply."""
    tokenizer = tokenizer or load_tokenizer(model_dir)
    generator = pipeline("text-generation", model=model or load_checked_model(model_dir), tokenizer=tokenizer)
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


def most_new_tokens(context: int, length: int, truncate: bool) -> str:
    """The hint of a --max-new-tokens that fills the context: the most that leave room for this `length`-token
    prompt (one token of it with --truncate-prompt)."""
    if truncate:
        return f"use at most {context - 1} (--truncate-prompt keeps the prompt's last tokens)"
    if length < context:
        return f"use at most {context - length}: the prompt takes {length} of its tokens"
    return (f"the prompt alone takes {length} tokens: shorten it, or pass --truncate-prompt and use at most "
            f"{context - 1}")


def fitted_prompt(args: argparse.Namespace, tokenizer) -> str:
    """--prompt when it and --max-new-tokens fit the model's context; its tail with --truncate-prompt (and one
    warning line); else ValueError with the numbers."""
    context = model_context(args.model)
    if context is None:
        return args.prompt
    budget = context - args.max_new_tokens
    length = prompt_length(tokenizer, args.prompt)
    if budget < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the context of "
                         f"{args.model} ({context} tokens, max_position_embeddings); "
                         f"{most_new_tokens(context, length, args.truncate_prompt)}")
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
    tokenizer = load_tokenizer(args.model)
    check_known_words(tokenizer, args.prompt, "the prompt", args.model)
    prompt = fitted_prompt(args, tokenizer)
    model = load_checked_model(args.model)
    set_threads(args.threads, model)
    generate_text(args.model, prompt, args.max_new_tokens, args.sample, model=model, tokenizer=tokenizer)


def run_convert(args: argparse.Namespace) -> None:
    from . import motif
    from .convert import added_parameters, convert_checkpoint

    options = {} if args.layers is None else {"layers": args.layers}
    if args.allow_sliding_window:
        options["allow_sliding_window"] = True
    if args.ignore_field:
        options["ignore_fields"] = tuple(args.ignore_field)
    if args.expand_noise_heads:
        options["expand_noise_heads"] = True
    model = convert_checkpoint(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite, **options)
    is_motif = Path(args.src).is_dir() and motif.is_motif_folder(args.src)
    added = (motif.added_parameters(read_config(args.src), args.expand_noise_heads) if is_motif
             else added_parameters(model))
    print(f"saved {type(model).__name__} to {args.out}: attention_types={model.config.attention_types}, "
          f"{added:,} parameters added ({added / (model.num_parameters() - added):+.2%})")


def load_models(args: argparse.Namespace, attn_implementation: str) -> dict[str, tuple]:
    """{"diff": (model, tokenizer)} plus "baseline" when given; sets the thread count from the model's size. First
    (before loading a model) every tokenizer must spell the evaluation's texts, the baseline's as the model's does,
    and --length must fit every model's context."""
    from .evaluation import check_same_encoding, check_tokenizer

    folders = {"diff": args.model} if args.baseline is None else {"diff": args.model, "baseline": args.baseline}
    tokenizers = {name: load_tokenizer(folder) for name, folder in folders.items()}
    for name, folder in folders.items():
        check_tokenizer(tokenizers[name], folder)
        check_context(folder, args.length, f"--length {args.length}")
    if args.baseline is not None:
        check_same_encoding(tokenizers["diff"], tokenizers["baseline"], args.model, args.baseline)
    # float32 whatever the saved dtype: the measurements sum and divide attention weights, and bf16 sums differ
    # between CPUs by more than the tables print
    models = {name: (load_checked_model(folder, attn_implementation=attn_implementation, dtype=torch.float32).eval(),
                     tokenizers[name])
              for name, folder in folders.items()}
    set_threads(args.threads, models["diff"][0])
    return models


def write_report(table: str, output: str, plot: Callable[[str], bool]) -> None:
    """Print the table and write PREFIX.md, then PREFIX.png through `plot(path)` when matplotlib is installed, each
    whole or not at all (`safe_write.write_file`)."""
    print(table)
    write_text(Path(f"{output}.md"), table + "\n")
    if write_file(Path(f"{output}.png"), lambda staged: plot(str(staged))):
        print(f"wrote {output}.md and {output}.png")
    else:
        print(f"wrote {output}.md; matplotlib is not installed, so no {output}.png (pip install matplotlib)")


def run_eval_needle(args: argparse.Namespace) -> None:
    from .evaluation import NeedleSettings, needle_accuracy, needle_table, needle_title, save_heatmap

    settings = NeedleSettings(lengths=args.lengths, depths=args.depths, needles=args.needles,
                              queries=args.queries, samples=args.samples, seed=args.seed)
    check_context(args.model, max(args.lengths), f"--lengths {' '.join(map(str, args.lengths))}")
    model, tokenizer = load_checked_model(args.model).eval(), load_tokenizer(args.model)
    set_threads(args.threads, model)
    results = needle_accuracy(model, tokenizer, settings, progress=True)
    name = Path(args.model).name
    write_report(needle_table(results, settings, name), args.output,
                 lambda path: save_heatmap(results, settings, path, needle_title(settings, name)) is not None)


def run_attention_noise(args: argparse.Namespace) -> None:
    from .evaluation import attention_noise_reports, noise_table, save_noise_plot

    reports = attention_noise_reports(load_models(args, "eager"), args.length, args.needles, args.seed)
    write_report(noise_table(reports), args.output,
                 lambda path: save_noise_plot(reports, path) is not None)


def run_outliers(args: argparse.Namespace) -> None:
    from .evaluation import outlier_reports, outlier_table

    print(outlier_table(outlier_reports(load_models(args, "sdpa"), args.length, args.top_k, args.seed)))


def run_upload(args: argparse.Namespace) -> None:
    from .hub_upload import publish

    publish(args.model_dir, args.repo_id, args.dry_run, args.private, args.license)

