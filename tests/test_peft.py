"""PEFT on DiffForCausalLM (issue #4): LoRA with default targets, differential parameters via modules_to_save,
adapter save/load, and merge_and_unload."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from helpers import tiny_config

from diff_transformer import DiffForCausalLM
from diff_transformer.peft_defaults import DIFF_TRAINABLE_MODULES, LORA_TARGET_MODULES

# fp32 logits of the merged model vs the adapter model: only summation order differs.
MERGE_ATOL = 1e-5
STEPS, LR = 20, 1e-2
LOSS_RATIO = 0.9  # final/initial loss after STEPS steps on one memorised batch



def base_model() -> DiffForCausalLM:
    torch.manual_seed(0)
    return DiffForCausalLM._from_config(tiny_config(), attn_implementation="sdpa")


def lora_model(base: DiffForCausalLM):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, modules_to_save=list(DIFF_TRAINABLE_MODULES))
    return get_peft_model(base, config)


def train(model, batch: torch.Tensor, steps: int = STEPS) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def max_mean(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a - b).abs()
    return f"max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    batch = torch.randint(3, 97, (4, 16))
    model = lora_model(base_model())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = train(model, batch)
    path = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(path)
    return model.eval(), batch, initial, losses, path


def test_default_targets_are_all_projections(trained):
    model = trained[0]
    assert model.peft_config["default"].target_modules == set(LORA_TARGET_MODULES)
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(LORA_TARGET_MODULES), wrapped


def test_lora_and_differential_parameters_train(trained):
    model, _, initial, losses, _ = trained
    assert losses[-1] < LOSS_RATIO * losses[0], f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for part in ("lora_A", "lora_B", "lambda_params", "subln"):
        names = [n for n in trainable if part in n]
        assert names, f"no trainable {part} parameters"
        assert any(not torch.equal(initial[n], dict(model.named_parameters())[n]) for n in names), f"{part} unchanged"
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and "base_layer" in n]
    assert frozen and all(torch.equal(initial[n], dict(model.named_parameters())[n]) for n in frozen)


def test_adapter_save_load_same_logits(trained):
    model, batch, _, _, path = trained
    assert (path / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(base_model(), path).eval()
    with torch.no_grad():
        expected, actual = model(batch).logits, loaded(batch).logits
    assert torch.equal(actual, expected), max_mean(actual, expected)


def test_merge_and_unload_same_logits(trained):
    model, batch, _, _, path = trained
    adapter = PeftModel.from_pretrained(base_model(), path).eval()
    with torch.no_grad():
        expected = adapter(batch).logits
        merged = adapter.merge_and_unload()
        actual = merged(batch).logits
    assert type(merged) is DiffForCausalLM
    assert not any("lora" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
    assert torch.allclose(actual, expected, atol=MERGE_ATOL, rtol=0), max_mean(actual, expected)
