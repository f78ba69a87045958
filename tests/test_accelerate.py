"""accelerate integration (issue #4): device_map="auto" loading, init_empty_weights, and 2-process data-parallel
training (torchrun, gloo on CPU) that matches one process with the same global batch."""

import json
from pathlib import Path

import ddp_train
import pytest
import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from multiprocess import assert_same_losses, torchrun
from reference import assert_close, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

from diff_transformer import DiffForCausalLM

DDP_RTOL = 1e-5  # gradients all-reduced over 2 halves vs one batch: summation order only


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
    assert_close(actual, fp32_logits, dtype, f"device_map='auto' {dtype} vs fp32 logits")


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


def test_two_process_data_parallel_matches_single_process(tmp_path):
    single = ddp_train.train(str(tmp_path / "single"), per_device_batch=ddp_train.GLOBAL_BATCH)
    ddp = torchrun("ddp_train.py", 2, tmp_path / "ddp", str(ddp_train.GLOBAL_BATCH // 2))
    assert ddp["engine"] == "DistributedDataParallel", ddp["engine"]
    assert_same_losses(ddp["losses"], single["losses"], DDP_RTOL, "DDP on 2 processes vs 1 process")


@pytest.mark.parametrize("name", ["accelerate_fsdp", "accelerate_deepspeed_zero3", "accelerate_cpu_ddp"])
def test_launch_configs_parse(name):
    from accelerate.commands.config.config_args import load_config_from_file

    root = Path(__file__).resolve().parents[1] / "configs"
    config = load_config_from_file(str(root / f"{name}.yaml"))
    assert config.distributed_type in {"FSDP", "DEEPSPEED", "MULTI_CPU"}
    if name == "accelerate_fsdp":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "DiffDecoderLayer"
    if name == "accelerate_deepspeed_zero3":
        deepspeed = json.loads((root / "deepspeed_zero3.json").read_text())
        assert deepspeed["zero_optimization"]["stage"] == 3
