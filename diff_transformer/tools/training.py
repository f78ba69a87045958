"""Training the Differential Transformer (Ye et al., arXiv 2410.05258) with transformers' Trainer: the callbacks (lambda
logging and warm-up, a stop on divergence, a wall-clock cap, a checkpoint on Ctrl-C or SIGTERM, progress lines) and
the plumbing of `diff-transformer train` (Trainer's arguments and construction, resuming, and checkpoints that are
complete or absent: `CheckpointTrainer` writes each through `safe_write.staged_folder`).

`LambdaLoggingCallback` adds lambda per layer (and optionally the entropy of both softmax branches on a fixed probe
batch) to the Trainer's logs. `LambdaWarmupCallback` ramps lambda_init of a converted model (which starts at 0,
see convert.py) linearly to a target, so the function moves away from the source model gradually.
`NonFiniteStopCallback` ends training with an error at the first step whose loss or gradients are not finite.
"""

import argparse
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, rotate_checkpoints

from ..attention_kernels import capture_branch_attentions
from ..modeling_diff import differential_layers
from ..saved_folder import checkpoints
from .safe_write import WriteError, checkpoint_problem, staged_folder, tensor_bytes

TERMINAL = sys.stderr.isatty()  # progress bars redraw in place on a terminal; in a log file they are plain lines


def lambda_values(model: torch.nn.Module) -> list[float]:
    """Current lambda of every differential layer, in layer order."""
    with torch.no_grad():
        return [layer.lambda_params().item() for layer in differential_layers(model)]


def branch_entropy(attn: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of softmax rows [B, h, T, S]; masked entries are 0 and contribute 0."""
    return -(attn * attn.clamp_min(1e-30).log()).sum(-1).mean()


def probe_entropies(model: torch.nn.Module, probe: dict[str, torch.Tensor]) -> dict[str, float]:
    """Entropy of A1 and A2 per differential layer on a probe batch (eager forward, no gradients, nothing kept)."""
    previous, was_training = model.config._attn_implementation, model.training
    model.set_attn_implementation("eager")
    model.eval()
    try:
        with torch.no_grad(), capture_branch_attentions(model) as maps:
            model(**{k: v.to(model.device) for k, v in probe.items()})
            return {
                f"attn_entropy/layer_{i}/branch_{b + 1}": branch_entropy(a).item()
                for i, entry in enumerate(maps)
                for b, a in enumerate(entry[:2])
            }
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)


class LambdaLoggingCallback(TrainerCallback):
    """On every Trainer log: `lambda/layer_{i}` (index among differential layers) and, with a `probe` batch (token
    ids [batch, seq], or a dict with `input_ids`), `attn_entropy/layer_{i}/branch_{1,2}`.

    Values go into `logs` (seen by callbacks after this one) and into `state.log_history`. Reporting integrations
    (wandb, tensorboard) run before user callbacks, so to reach them add this one first:
    `trainer.callback_handler.callbacks.insert(0, LambdaLoggingCallback(...))`.
    """

    def __init__(self, probe: torch.Tensor | dict[str, torch.Tensor] | None = None):
        if isinstance(probe, torch.Tensor):
            probe = {"input_ids": probe}
        if probe is not None and "input_ids" not in probe:
            raise ValueError(
                f"probe must be token ids [batch, seq] or a batch dict with 'input_ids', got {type(probe).__name__} "
                f"with keys {sorted(probe)}"
            )
        self.probe = probe

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None or model is None:
            return
        extra = {f"lambda/layer_{i}": value for i, value in enumerate(lambda_values(model))}
        if self.probe is not None:
            extra.update(probe_entropies(model, self.probe))
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)


def set_lambda_init(model: torch.nn.Module, value: float) -> None:
    """Set lambda_init of every differential layer (and the config, so checkpoints reload with it)."""
    for layer in differential_layers(model):
        layer.set_lambda_init(value)
    model.config.lambda_init = value


class LambdaWarmupCallback(TrainerCallback):
    """Ramp a constant lambda_init linearly from its start value to `target` over `warmup_steps` optimizer steps.

    Every intermediate value is a constant, so `config.lambda_init` always describes the model and checkpoints
    saved mid-ramp reload exactly.
    """

    def __init__(self, target: float, warmup_steps: int):
        if not 0.0 <= target < 1.0 or warmup_steps < 1:
            raise ValueError(f"need 0 <= target < 1 and warmup_steps >= 1, got {target}, {warmup_steps}")
        self.target = target
        self.warmup_steps = warmup_steps
        self.start: float | None = None

    def value_at(self, step: int) -> float:
        progress = min(step / self.warmup_steps, 1.0)
        return self.start + (self.target - self.start) * progress

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start = model.config.lambda_init or 0.0
        set_lambda_init(model, self.value_at(state.global_step))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        set_lambda_init(model, self.value_at(state.global_step))


class NonFiniteTrainingError(ValueError):
    """Training diverged: a loss or gradient is NaN or infinite."""


class NonFiniteStopCallback(TrainerCallback):
    """Raise `NonFiniteTrainingError` before the optimizer step of the first step whose gradients are not all finite
    (a NaN or infinite loss makes them so), so that no NaN reaches the weights. Trainer's own logs hide such a run:
    `logging_nan_inf_filter` leaves non-finite losses out of the logged mean, which reads 0 when all are.

    `hint` ends the message: what the user can change (the command line names its --learning-rate)."""

    def __init__(self, hint: str = "lower the learning rate, or check the data and the loss"):
        self.hint = hint

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        if gradients and not all(bool(torch.isfinite(g).all()) for g in gradients):
            raise NonFiniteTrainingError(
                f"training diverged at step {state.global_step + 1} of {state.max_steps}: the loss or a gradient is "
                f"NaN or infinite; {self.hint}"
            )


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what it stopped; the command line prints it in one line and exits with `exit_code`."""

    exit_code = 130


def remove_created_folders(folder: Path, existing: Path) -> None:
    """Remove `folder` and its parents up to `existing` (which existed before this run) where they are empty."""
    folder = folder.absolute()
    while folder != existing and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


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


class PlainProgress(TrainerCallback):
    """Off a terminal: the loss in plain lines (on stdout, as QuietProgress writes its own), at the first log, so that
    a log shows training has started, once per quarter of the run, and at the first log `seconds` after the last
    line, so that a long run's log moves at a steady rate."""

    def __init__(self, seconds: float):
        self.quarter = 0
        self.seconds = seconds
        self.printed = -math.inf

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in (logs or {}):
            return
        quarter_passed = state.global_step >= self.quarter * state.max_steps / 4
        if not quarter_passed and time.monotonic() - self.printed < self.seconds:
            return
        print(f"step {state.global_step}/{state.max_steps}: loss {logs['loss']:.4f}", flush=True)
        self.printed = time.monotonic()
        while self.quarter * state.max_steps / 4 <= state.global_step:
            self.quarter += 1

    def close(self) -> None:
        pass


class CheckpointOnStop(TrainerCallback):
    """Ctrl-C or SIGTERM while `installed`: the step under way finishes, Trainer saves a checkpoint of it (weights,
    optimizer, scheduler, RNG states, the data position) and stops; `raise_if_stopped` then raises what the signal
    would have raised. A second signal raises at once."""

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict[int, Callable] = {}

    def request(self, signum: int, frame) -> None:
        if self.signum is not None:
            self.raise_signal(signum, frame)
        self.signum = signum

    def raise_signal(self, signum: int, frame) -> None:
        handler = self.previous.get(signum)
        if callable(handler):  # KeyboardInterrupt for SIGINT, the command line's `Terminated` for SIGTERM
            handler(signum, frame)
        raise KeyboardInterrupt

    def on_step_end(self, args, state, control, **kwargs):
        if self.signum is not None:
            control.should_save = True
            control.should_training_stop = True

    def raise_if_stopped(self) -> None:
        if self.signum is not None:
            self.raise_signal(self.signum, None)

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
            yield
            return
        self.previous = {signum: signal.signal(signum, self.request) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in self.previous.items():
                signal.signal(signum, handler)


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


def training_arguments(args: argparse.Namespace, folder: Path) -> TrainingArguments:
    """Trainer's settings; its checkpoints (every --save-steps, the last --save-total-limit kept, and one on Ctrl-C
    or SIGTERM) go into `folder`/checkpoint-STEP."""
    return TrainingArguments(
        output_dir=str(folder),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(100, args.max_steps // 10),
        logging_steps=max(1, min(50, args.max_steps // 20)),
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        save_total_limit=args.save_total_limit,
        report_to=[],
        bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(),  # bf16 on a CPU-only machine needs it said
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=not TERMINAL,  # QuietProgress replaces the log printing; PlainProgress off a terminal
    )


def checkpoint_note(output: Path) -> str:
    """What an interrupted run leaves: its newest complete checkpoint in `output`, and how to continue from it."""
    last = newest_complete(output)
    if last is None:
        return "nothing saved"
    return f"saved {last}: run the same command with --resume to continue from it"


def newest_complete(output: Path) -> Path | None:
    """The newest checkpoint in `output` that `--resume` can use (`safe_write.checkpoint_problem`), or None."""
    found = [path for path in checkpoints(output) if checkpoint_problem(path) is None] if output.is_dir() else []
    return found[-1] if found else None


@contextmanager
def nothing_half_written(trainer: Trainer, progress, output: Path, existing: Path) -> Iterator[None]:
    """On any error (Ctrl-C, SIGTERM, divergence, a full disk): remove the folders made for the run below `existing`
    (the part of the path there before this run) where they hold no checkpoint (what is being written is in a
    staging folder, which `safe_write.staged_folder` removes); say in one line what stopped at which step, and which
    checkpoint it left."""
    try:
        yield
    except BaseException as error:
        progress.close()
        remove_created_folders(output, existing)
        state = trainer.state
        where = (f"at step {state.global_step} of {state.max_steps}" if state.global_step < state.max_steps
                 else "while saving")
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (`Terminated`, with its exit status)
            stopped = Interrupted(f"{str(error) or 'interrupted'} {where}; {checkpoint_note(output)}")
            stopped.exit_code = getattr(error, "exit_code", stopped.exit_code)
            raise stopped from None
        if isinstance(error, WriteError):  # a full disk: one line already, with the space needed
            raise WriteError(f"{error} ({where}; {checkpoint_note(output)})") from error
        if isinstance(error, (OSError, SafetensorError)):  # safetensors' errors are no OSError
            raise OSError(f"could not save the model ({error}); nothing saved: free some space, or choose another "
                          "--output") from error
        if isinstance(error, ValueError):
            raise ValueError(f"{error}; nothing saved") from error
        raise


def clear_run(output: Path, resume: bool) -> None:
    """Without `resume`, remove the checkpoints of an older run in `output` (--overwrite: a new run, not to be mixed
    with them)."""
    if not resume:
        for checkpoint in checkpoints(output):
            shutil.rmtree(checkpoint)


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another parameter (tied embeddings' lm_head.weight), which checkpoints leave
    out."""
    return ({name for name, _ in model.named_parameters(remove_duplicate=False)}
            - {name for name, _ in model.named_parameters()})


class CheckpointTrainer(Trainer):
    """Trainer whose checkpoints are complete or absent: each is written, with `extra_files(folder)` (the tokenizer
    and the run's record), into a private staging folder beside OUTPUT/checkpoint-STEP, fsynced and renamed into
    place (`safe_write.staged_folder`), and only then are older ones rotated out; a full disk is one line
    (`safe_write.WriteError`) and leaves nothing. Resuming does not warn of the tied weights the checkpoint rightly
    leaves out.

    Trainer writes a checkpoint into `_get_output_dir()`/checkpoint-STEP (transformers 5.17 to 5.24): for the save,
    that folder is the staging one."""

    def __init__(self, *args, extra_files: Callable[[Path], None] | None = None,
                 hint: str = "free some space, or choose another output_dir", **kwargs):
        super().__init__(*args, **kwargs)
        self.extra_files = extra_files
        self.hint = hint
        self.staging: str | None = None

    def _get_output_dir(self, trial) -> str:
        return self.staging or super()._get_output_dir(trial)

    def checkpoint_bytes(self) -> int:
        """About what a checkpoint takes: the weights and the optimizer's state."""
        optimizer_state = getattr(self.optimizer, "state", {}) if self.optimizer is not None else {}
        return tensor_bytes([*self.model.state_dict().values(),
                             *(value for state in optimizer_state.values() for value in state.values())])

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        with staged_folder(run_dir / name, replace=True, needed=self.checkpoint_bytes, hint=self.hint,
                           inner=name) as folder:
            self.staging = str(folder.parent)
            try:
                super()._save_checkpoint(model, trial)  # its rotation sees the staging folder only
            finally:
                self.staging = None
            if self.extra_files is not None:
                self.extra_files(folder)
        if self.args.should_save:
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint)

    def _issue_warnings_after_load(self, load_result) -> None:
        tied = tied_names(self.model)
        super()._issue_warnings_after_load(
            load_result._replace(missing_keys=[key for key in load_result.missing_keys if key not in tied]))


class ResumedRun(TrainerCallback):
    """The options a resumed run changed (`--change`) in force: Trainer restores the checkpoint's log and save
    intervals, and its scheduler and optimizer, whose peak learning rate is the old one. At the start, the intervals
    are this run's again, and with a new `learning_rate` the peak is it and the current step's rate is the
    schedule's from it."""

    def __init__(self, learning_rate: float | None = None):
        self.learning_rate = learning_rate

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        state.compute_steps(args, state.max_steps)
        if self.learning_rate is None:
            return
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate may wrap it
        scheduler.base_lrs = [self.learning_rate] * len(scheduler.base_lrs)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"] = self.learning_rate
            group["lr"] = self.learning_rate * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def cli_trainer(model: torch.nn.Module, arguments: TrainingArguments, dataset, callbacks: list[TrainerCallback],
                progress_seconds: float, extra_files: Callable[[Path], None]
                ) -> tuple[Trainer, TrainerCallback, CheckpointOnStop]:
    """`CheckpointTrainer` (writing `extra_files` into each checkpoint) with `callbacks`, a `CheckpointOnStop`, and
    the command line's progress (`QuietProgress` on a terminal, else `PlainProgress` every `progress_seconds`) in
    place of its own log printing; with the progress callback and the stop."""
    stop = CheckpointOnStop()
    trainer = CheckpointTrainer(model=model, args=arguments, train_dataset=dataset, callbacks=[*callbacks, stop],
                                extra_files=extra_files, hint="free some space, or choose another --output")
    for printer in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(printer)
    progress = QuietProgress() if TERMINAL else PlainProgress(progress_seconds)
    trainer.add_callback(progress)
    return trainer, progress, stop


def train_until_stopped(trainer: Trainer, stop: CheckpointOnStop, checkpoint: Path | None) -> TrainOutput:
    """`trainer.train`, from `checkpoint` where given; Ctrl-C or SIGTERM saves a checkpoint, then raises."""
    with stop.installed():
        result = trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    stop.raise_if_stopped()
    return result


__all__ = [
    "LambdaLoggingCallback",
    "LambdaWarmupCallback",
    "NonFiniteStopCallback",
    "NonFiniteTrainingError",
    "lambda_values",
    "set_lambda_init",
    "probe_entropies",
]
