"""accelerate integration (issue #4): device_map="auto" loading, init_empty_weights, and 2-process data-parallel
training (torchrun and docs/ecosystem.md's `accelerate launch` config, gloo on CPU) that matches one process with the
same global batch."""

import json
import sys
from pathlib import Path

import ddp_train
import pytest
import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from multiprocess import assert_same_losses, launch
from helpers import assert_close, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

from diff_transformer import DiffForCausalLM

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
