"""Training: Trainer, the training callbacks, accelerate, and data-parallel and sharded runs on several processes.

Causal-LM fine-tuning through Trainer: loss decreases, fp32/bf16, gradient checkpointing and accumulation, safetensors
checkpoints, and resume == uninterrupted. accelerate: device_map="auto" loading, init_empty_weights, and 2-process
data-parallel training (torchrun and docs/ecosystem.md's `accelerate launch` config, gloo on CPU) that matches one
process with the same global batch. Sharded training: FSDP2 (`fully_shard`) on 2 CPU processes (gloo) trains like one
unsharded process, and its sharded torch.distributed.checkpoint reloads with `from_pretrained`; DeepSpeed ZeRO-3 where
installed. (Tensor parallelism: test_tensor_parallel.py.)"""

import copy
import json
import sys
from pathlib import Path

import ddp_train
import fsdp_train
import pytest
import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from helpers import assert_close, assert_grads_close, tiny_config
from helpers.multiprocess import assert_same_losses, launch, torchrun
from helpers.training import make_trainer
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainerState

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.training import LambdaLoggingCallback
from diff_transformer.tools.data import TokenBlocks

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


def test_probe_may_be_a_tensor():
    model = DiffForCausalLM(tiny_config())
    logs = {}
    LambdaLoggingCallback(probe=torch.randint(3, 97, (2, 8))).on_log(None, TrainerState(), None, logs=logs,
                                                                    model=model)
    assert set(logs) >= {"lambda/layer_0", "attn_entropy/layer_1/branch_2"}, sorted(logs)
    with pytest.raises(ValueError, match="probe must be token ids"):
        LambdaLoggingCallback(probe={"ids": torch.ones(1, 2)})



DDP_RTOL = 1e-5  # gradients all-reduced over 2 halves vs one batch: summation order only
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    DiffForCausalLM._from_config(tiny_config(), attn_implementation="sdpa").save_pretrained(path)
    batch = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        logits = DiffForCausalLM.from_pretrained(path).eval()(batch).logits
    return path, batch, logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_map_auto_same_logits(saved, dtype):
    path, batch, fp32_logits = saved
    loaded = AutoModelForCausalLM.from_pretrained(path, device_map="auto", dtype=dtype).eval()
    assert loaded.dtype == dtype and all(p.device.type == "cpu" for p in loaded.parameters())
    reference = DiffForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        actual, expected = loaded(batch).logits, reference(batch).logits
    assert torch.equal(actual, expected), f"max abs diff {(actual - expected).abs().max():.3e}"
    # a whole model in bf16 against fp32: rounding in every layer, as between backends (measured: max diff 4.5e-3)
    assert_close(actual, fp32_logits, dtype, f"device_map='auto' {dtype} vs fp32 logits", "backend")


def test_init_empty_weights_then_dispatch(saved):
    path, batch, logits = saved
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), attn_implementation="sdpa")
    assert all(p.device.type == "meta" for p in empty.parameters())
    empty.tie_weights()
    model = load_checkpoint_and_dispatch(empty, str(path / "model.safetensors"), device_map="auto").eval()
    assert not any(p.device.type == "meta" for p in model.parameters())
    with torch.no_grad():
        assert_close(model(batch).logits, logits, torch.float32, "init_empty_weights + dispatch logits")


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> dict:
    return ddp_train.train(str(tmp_path_factory.mktemp("single")), per_device_batch=ddp_train.GLOBAL_BATCH)


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"],
    # docs/ecosystem.md's command: accelerate 1.15 starts one process for a MULTI_CPU config; this checks it starts two
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / "accelerate_cpu_ddp.yaml")],
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_process_data_parallel_matches_single_process(single_process, tmp_path, launcher):
    ddp = launch(LAUNCHERS[launcher], "ddp_train.py", tmp_path, str(ddp_train.GLOBAL_BATCH // 2))[0]
    assert ddp["processes"] == 2, f"{launcher} started {ddp['processes']} process(es), not 2"
    assert ddp["engine"] == "DistributedDataParallel", ddp["engine"]
    assert_same_losses(ddp["losses"], single_process["losses"], DDP_RTOL, f"DDP on 2 processes ({launcher}) vs 1")


@pytest.mark.parametrize("name", ["accelerate_fsdp", "accelerate_deepspeed_zero3", "accelerate_cpu_ddp"])
def test_launch_configs_parse(name):
    from accelerate.commands.config.config_args import load_config_from_file

    root = ROOT / "configs"
    config = load_config_from_file(str(root / f"{name}.yaml"))
    assert config.distributed_type in {"FSDP", "DEEPSPEED", "MULTI_GPU"}
    if name == "accelerate_fsdp":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "DiffDecoderLayer"
    if name == "accelerate_deepspeed_zero3":
        deepspeed = json.loads((root / "deepspeed_zero3.json").read_text())
        assert deepspeed["zero_optimization"]["stage"] == 3


# fp32 throughout. Each process computes its half batch's gradients and FSDP (or ZeRO) averages them: the same sums in
# another order, so the losses agree to a few float32 ulps (measured: max abs diff 4.8e-7 on losses near 3.5).
LOSS_RTOL = 1e-5
# AdamW divides by sqrt(v), which enlarges those rounding differences where gradients are tiny (measured after 6
# steps: max abs diff 5.2e-6, mean 2.7e-9); a real mismatch moves elements by up to lr * steps = 1.8e-2.
PARAM_ATOL = 5e-5


@pytest.fixture(scope="module")
def single() -> tuple[DiffForCausalLM, TokenBlocks, list[float]]:
    model, dataset = ddp_train.tiny_model_and_data()
    return model, dataset, fsdp_train.train(model, dataset)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, dict]:
    output_dir = tmp_path_factory.mktemp("fsdp")
    return output_dir, torchrun("fsdp_train.py", 2, output_dir)[0]


def test_fsdp_two_processes_match_one(single, sharded):
    model, _, losses = single
    _, results = sharded
    assert_same_losses(results["losses"], losses, LOSS_RTOL, "FSDP2 on 2 processes vs 1 process")
    total = sum(p.numel() for p in model.parameters())
    assert sum(results["shard_numel"]) == total and max(results["shard_numel"]) < 0.55 * total, (
        f"each process should hold about half of the {total} parameter elements: {results['shard_numel']}"
    )


def test_fsdp_sharded_checkpoint_reloads(single, sharded, tmp_path):
    model, dataset, _ = single
    output_dir, results = sharded
    checkpoint = output_dir / "checkpoint"
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    fsdp_train.consolidate(checkpoint, tmp_path)
    trained_logits = torch.tensor(results["logits"])
    input_ids = fsdp_train.rows(dataset, 0, fsdp_train.EVAL_ROWS)
    for loader in (DiffForCausalLM, AutoModelForCausalLM):
        reloaded = loader.from_pretrained(tmp_path).eval()
        with torch.no_grad():
            logits = reloaded(input_ids).logits
        diff = (logits - trained_logits).abs()
        assert torch.equal(logits, trained_logits), f"{loader.__name__}: max abs diff {diff.max():.3e}"
    expected = dict(model.named_parameters())
    for name, param in reloaded.named_parameters():
        diff = (param - expected[name]).abs()
        assert torch.allclose(param, expected[name], rtol=0, atol=PARAM_ATOL), (
            f"{name} after sharded training vs one process: max abs diff {diff.max():.3e}, mean {diff.mean():.3e}"
        )


@pytest.mark.slow
def test_deepspeed_zero3_two_processes_match_one(tmp_path):
    pytest.importorskip("deepspeed")
    config = Path(__file__).resolve().parents[1] / "configs" / "deepspeed_zero3.json"
    single = ddp_train.train(str(tmp_path / "single"), per_device_batch=ddp_train.GLOBAL_BATCH)
    zero3 = torchrun("ddp_train.py", 2, tmp_path / "zero3", str(ddp_train.GLOBAL_BATCH // 2), str(config))[0]
    assert zero3["engine"] == "DeepSpeedEngine", zero3["engine"]
    assert_same_losses(zero3["losses"], single["losses"], LOSS_RTOL, "DeepSpeed ZeRO-3 on 2 processes vs 1 process")


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_first_step_gradients_match_one_process(engine, tmp_path):
    """The first step's gradients on 2 processes (DDP through Trainer, or FSDP2), gathered whole, vs one plain
    backward of the same global batch in one process, per tensor: a gradient scaled by the process count (a sum
    instead of a mean) fails, where the losses after AdamW steps cannot tell."""
    results = torchrun("grad_worker.py", 2, tmp_path, engine)
    assert [r["processes"] for r in results] == [2, 2], results
    grads = torch.load(tmp_path / "grads.pt", weights_only=True)
    model, dataset = ddp_train.tiny_model_and_data()
    input_ids = fsdp_train.rows(dataset, 0, ddp_train.GLOBAL_BATCH)
    model.eval()(input_ids=input_ids, labels=input_ids).loss.backward()
    assert_grads_close(grads, {name: p.grad for name, p in model.named_parameters()}, torch.float32,
                       f"{engine} on 2 processes vs 1")
