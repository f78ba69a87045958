"""Conversion: Llama/Mistral/Qwen2 checkpoints converted, DiffLlama imported, and the lambda warmup that follows."""

import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Trainer,
    TrainingArguments,
)

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.training import LambdaLoggingCallback, LambdaWarmupCallback, lambda_values
from diff_transformer.tools.convert import added_parameters, convert, convert_checkpoint, convert_llama_family
from diff_transformer.tokenization_diff import train_bpe_tokenizer
from diff_transformer_cli import main

LOGIT_ATOL = 1e-6  # fp32 conversion: the same function up to summation order (measured: max abs diff 1.8e-7)
IMPORT_ATOL = 1e-5  # DiffLlama import is a pure permutation: only summation order differs
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
SOURCES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, head_dim=8, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True)),
}


def random_source(kind: str, **overrides) -> torch.nn.Module:
    """Random weights; biases, norms and lambda vectors are perturbed too (they start at 0, 1 or small)."""
    if kind == "diffllama":
        model = DiffLlamaForCausalLM(DiffLlamaConfig(**{**COMMON, **overrides}, head_dim=16))
    else:
        model = SOURCES[kind]()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "lambda" in name or "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    diff = (actual - expected).abs()
    assert diff.max() <= atol, f"{what}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", list(SOURCES))
def test_converted_checkpoint_matches_and_learns(kind, tmp_path):
    source = random_source(kind)
    source.generation_config.max_new_tokens = 7
    source.save_pretrained(tmp_path / "src")
    train_bpe_tokenizer(texts=["hello world"] * 4, vocab_size=300).save_pretrained(tmp_path / "src")
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert isinstance(model, DiffForCausalLM) and set(model.config.attention_types) == {"differential"}
    assert model.generation_config.max_new_tokens == 7, "generation config not carried over"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("hello")["input_ids"], "tokenizer not copied"
    ids = torch.randint(1, 97, (2, 24))
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        assert_logits_close(logits(model, ids), logits(source, ids), LOGIT_ATOL, f"{kind}/{backend} logits")
    assert lambda_values(model) == [0.0] * 3, "lambda must start at exactly 0"

    model.train()
    model(ids, labels=ids).loss.backward()
    for i, layer in enumerate(model.model.layers):
        grad = layer.self_attn.lambda_params.q1.grad
        assert grad is not None and grad.abs().max() > 0, f"layer {i}: lambda vector got no gradient"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = logits(model, ids)
    for _ in range(3):
        optimizer.step()
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
    after = logits(model, ids)
    assert torch.isfinite(after).all(), f"{kind}: NaN/inf after optimizer steps"
    assert (after - before).abs().max() > 1e-3, f"{kind}: optimizer steps did not change the model"
    assert any(v != 0.0 for v in lambda_values(model)), f"{kind}: lambda did not move"


def test_partial_conversion_keeps_logits(tmp_path):
    source = random_source("llama")
    model = convert_llama_family(source, layers=[1, 2])
    assert model.config.attention_types == ["standard", "differential", "differential"]
    ids = torch.randint(1, 97, (2, 24))
    assert_logits_close(logits(model, ids), logits(source, ids), LOGIT_ATOL, "layers 1..L-1 converted")
    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids[:1, :6], **greedy), source.generate(ids[:1, :6], **greedy)), (
        "cached greedy generation of the hybrid conversion differs from the source's"
    )
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_logits_close(logits(reloaded, ids), logits(source, ids), LOGIT_ATOL, "partial conversion reloaded")


def test_parameter_cost():
    source = random_source("mistral")
    model = convert_llama_family(source)
    added = model.num_parameters() - source.num_parameters()
    d, hidden = 8, 64
    expected = 3 * ((4 + 2) * d * hidden + 4 * d)  # branch-2 q (h*d) and k (h_kv*d) rows, 4 lambda vectors
    assert added == expected == added_parameters(model)


@pytest.mark.parametrize(
    ("backend", "kv_heads"), [("eager", 2), ("sdpa", 2), ("sdpa", 4)], ids=["eager-GQA", "sdpa-GQA", "sdpa-MHA"]
)
def test_diffllama_import_identical(backend, kv_heads, tmp_path, capsys):
    source = random_source("diffllama", num_key_value_heads=kv_heads)
    source.set_attn_implementation(backend)
    source.save_pretrained(tmp_path / "src")
    with pytest.warns(UserWarning, match="no tokenizer files found"):
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out")])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation=backend)
    added = model.num_parameters() - source.num_parameters()
    assert added == 3 * 32 and f" {added} parameters added (+" in capsys.readouterr().out, "the SubLN gains"
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.value_head_dim) == (2, kv_heads // 2, 32)
    assert config.use_subln and config.lambda_init is None
    ids = torch.randint(1, 97, (2, 24))
    assert_logits_close(logits(model, ids), logits(source, ids), IMPORT_ATOL, f"DiffLlama import ({backend})")


def test_unsupported_architecture_refused(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="cannot convert model_type 'gpt2'.*supported are llama, mistral, qwen2"):
        convert_checkpoint(str(tmp_path / "gpt2"), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"], "nothing written"


def test_sliding_window_refused_unless_allowed():
    source = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=16)).eval()
    with pytest.raises(ValueError, match="sliding_window=16 < max_position_embeddings=128"):
        convert(source)
    with pytest.warns(UserWarning, match="at most 16 tokens"):
        model = convert(source, allow_sliding_window=True)
    ids = torch.randint(1, 97, (1, 16))  # within the window the outputs agree
    assert_logits_close(logits(model, ids), logits(source, ids), LOGIT_ATOL, "within the sliding window")


def test_lambda_warmup_and_logging_callbacks(tmp_path):
    model = convert_llama_family(random_source("llama")).train()
    ids = torch.randint(1, 97, (16, 12))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                             report_to=[], save_strategy="no", learning_rate=1e-3, use_cpu=True)
    probe = {"input_ids": ids[:2]}
    callbacks = [LambdaWarmupCallback(target=0.4, warmup_steps=2), LambdaLoggingCallback(probe=probe)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
    assert model.config.lambda_init == pytest.approx(0.4)
    assert model.model.layers[0].self_attn.lambda_params.lambda_init == pytest.approx(0.4)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all("lambda/layer_0" in entry for entry in logged) and len(logged) == 2, "lambda missing from logs"
    assert logged[-1]["lambda/layer_2"] == pytest.approx(lambda_values(model)[2], abs=1e-6)
    assert 0 < logged[-1]["attn_entropy/layer_0/branch_1"] <= torch.log(torch.tensor(12.0)).item() + 1e-5
    assert model.config._attn_implementation == "sdpa", "probe must restore the attention backend"
