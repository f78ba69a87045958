"""Causal-LM fine-tuning through Trainer (issue #4): loss decreases, fp32/bf16, gradient checkpointing and
accumulation, safetensors checkpoints, and resume == uninterrupted."""

import copy

import torch
from helpers import assert_grads_close, tiny_config
from transformers import Trainer, TrainerCallback, TrainingArguments

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.data import KeyValueTask, task_dataset

TASK = KeyValueTask(num_keys=16, num_values=16, num_pairs=4)
RESUME_RTOL = 1e-6  # same CPU kernels, same data order: resumed losses should match to fp32 rounding
ACCUMULATION_RTOL = 3e-7  # 2x2 accumulated micro-batches vs one batch of 4: summation order only (measured 6.6e-8)
BF16_ATOL = 5e-2  # first-step loss, bf16 autocast vs fp32
LOSS_RATIO = 0.85  # last/first logged loss after 60 steps



class CaptureGradients(TrainerCallback):
    """The gradients of the first optimizer step, as the optimizer gets them (after accumulation and clipping)."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def make_trainer(output_dir, callbacks=(), **overrides) -> Trainer:
    tokenizer = TASK.tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    torch.manual_seed(0)
    model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
    fields = dict(
        output_dir=str(output_dir), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
        warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    fields.update(overrides)
    dataset = task_dataset(TASK, tokenizer, count=256, seed=0)
    return Trainer(model=model, args=TrainingArguments(**fields), train_dataset=dataset, callbacks=list(callbacks))


def losses(trainer: Trainer) -> dict[int, float]:
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


def compare(actual: dict[int, float], expected: dict[int, float], rtol: float, what: str) -> None:
    steps = sorted(actual)
    assert steps and set(steps) <= set(expected), f"{what}: steps {steps} vs {sorted(expected)}"
    a, e = torch.tensor([actual[s] for s in steps]), torch.tensor([expected[s] for s in steps])
    diff = (a - e).abs()
    assert torch.allclose(a, e, rtol=rtol, atol=0), (
        f"{what}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e}\n{a.tolist()}\n{e.tolist()}"
    )


def test_loss_decreases(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=60, logging_steps=5)
    trainer.train()
    curve = list(losses(trainer).values())
    assert curve[-1] < LOSS_RATIO * curve[0], f"loss {curve[0]:.3f} -> {curve[-1]:.3f}"


def test_resume_equals_uninterrupted(tmp_path):
    full = make_trainer(tmp_path / "full")
    full.train()
    first = make_trainer(tmp_path / "run", callbacks=[StopAt(4)], save_strategy="steps", save_steps=4)
    first.train()
    checkpoint = tmp_path / "run" / "checkpoint-4"
    assert (checkpoint / "model.safetensors").exists(), sorted(p.name for p in checkpoint.iterdir())
    assert not (checkpoint / "pytorch_model.bin").exists(), "weights must be saved as safetensors"
    assert max(losses(first)) == 4
    resumed = make_trainer(tmp_path / "run")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    after_resume = {step: loss for step, loss in losses(resumed).items() if step > 4}
    assert sorted(after_resume) == [5, 6, 7, 8] and resumed.state.global_step == 8
    compare(after_resume, losses(full), RESUME_RTOL, "resumed vs uninterrupted loss")


def test_accumulation_and_checkpointing_match_full_batch(tmp_path):
    full = make_trainer(tmp_path / "full", max_steps=5)
    full.train()
    accumulated = make_trainer(
        tmp_path / "acc", max_steps=5, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    accumulated.train()
    assert accumulated.model.model.gradient_checkpointing
    compare(losses(accumulated), losses(full), ACCUMULATION_RTOL, "2x2 accumulation + checkpointing vs batch 4")


def test_bf16_training(tmp_path):
    fp32 = make_trainer(tmp_path / "fp32", max_steps=1)
    fp32.train()
    bf16 = make_trainer(tmp_path / "bf16", max_steps=30, bf16=True)
    bf16.train()
    curve = losses(bf16)
    assert abs(curve[1] - losses(fp32)[1]) < BF16_ATOL, f"first loss bf16 {curve[1]:.4f} vs fp32 {losses(fp32)[1]:.4f}"
    values = list(curve.values())
    assert all(torch.isfinite(torch.tensor(values))), values
    assert values[-1] < values[0], f"bf16 loss {values[0]:.3f} -> {values[-1]:.3f}"


def test_trainer_gradients_equal_a_plain_backward(tmp_path):
    """The first step's gradients under Trainer (2 micro-batches of 2 accumulated, gradient checkpointing, no
    clipping, train mode) vs one plain backward of the same 4 sequences on a copy of the initial model in eval mode,
    per tensor (TOLERANCES["grad"]): a gradient scaled in training, or by the accumulation, fails."""
    capture = CaptureGradients()
    trainer = make_trainer(
        tmp_path, callbacks=[capture], max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, max_grad_norm=0,
        train_sampling_strategy="sequential", warmup_steps=0,
    )
    reference = DiffForCausalLM._from_config(copy.deepcopy(trainer.model.config), attn_implementation="sdpa")
    reference.load_state_dict(trainer.model.state_dict())
    trainer.train()
    batch = [trainer.train_dataset[i] for i in range(4)]
    inputs = {key: torch.stack([row[key] for row in batch]) for key in batch[0]}
    reference.eval()(**inputs).loss.backward()
    assert capture.grads is not None, "Trainer made no optimizer step"
    expected = {name: p.grad for name, p in reference.named_parameters()}
    assert_grads_close(capture.grads, expected, torch.float32, "Trainer step 1")
