"""Sharded training (issue #15): FSDP2 (`fully_shard`) on 2 CPU processes (gloo) trains like one unsharded process,
and its sharded torch.distributed.checkpoint reloads with `from_pretrained`; DeepSpeed ZeRO-3 where installed."""

from pathlib import Path

import ddp_train
import fsdp_train
import pytest
import torch
from helpers import assert_grads_close
from multiprocess import assert_same_losses, torchrun
from transformers import AutoModelForCausalLM

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.data import TokenBlocks

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
