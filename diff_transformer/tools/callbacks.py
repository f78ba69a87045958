"""Trainer callbacks for the Differential Transformer (Ye et al., arXiv 2410.05258): lambda logging and warm-up, and a
stop on divergence.

`LambdaLoggingCallback` adds lambda per layer (and optionally the entropy of both softmax branches on a fixed probe
batch) to the Trainer's logs. `LambdaWarmupCallback` ramps lambda_init of a converted model (which starts at 0,
see convert.py) linearly to a target, so the function moves away from the source model gradually.
`NonFiniteStopCallback` ends training with an error at the first step whose loss or gradients are not finite.
"""

import torch
from transformers import TrainerCallback

from ..attention_kernels import capture_branch_attentions
from ..modeling_diff import differential_layers


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


__all__ = [
    "LambdaLoggingCallback",
    "LambdaWarmupCallback",
    "NonFiniteStopCallback",
    "NonFiniteTrainingError",
    "lambda_values",
    "set_lambda_init",
    "probe_entropies",
]
