"""benchmarks/quantization.py: transformers' CPU quantization integrations (torchao, optimum-quanto, bitsandbytes,
llm-compressor saved and loaded again) on tiny DIFF V1, V2, hybrid and Llama models saved as from_pretrained folders.
Each method whose library is installed loads every model or fails for DIFF exactly where it fails for Llama; where it
loads, it replaces the Linear layers, keeps the held-out loss finite and near the unquantized one, and greedy generate
runs. An absent library is skipped by name."""

import math
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark

quantization = load_benchmark("quantization")

# On tiny random models (loss ~5.6 nats, near uniform over 256 tokens) no method here moved the loss by 0.002; a
# method that garbles a layer moves it by far more.
LOSS_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict[str, Path], torch.Tensor, torch.Tensor]:
    """(folders, held-out ids, calibration ids)"""
    folders = quantization.save_tiny_models(tmp_path_factory.mktemp("tiny"))
    ids = torch.randint(0, quantization.TINY["vocab_size"], (12, 32), generator=torch.Generator().manual_seed(0))
    return folders, ids[:4], ids[4:]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(quantization.METHODS))
def test_method_on_diff_v1_v2_hybrid_and_llama(method, tiny):
    if reason := quantization.missing_library(method):
        pytest.skip(reason)
    folders, ids, calibration = tiny
    results = {name: quantization.measure(folder, ids, [method], calibration) for name, folder in folders.items()}
    llama_fails = "error" in results["Llama"][method]
    for name, found in results.items():
        result = found[method]
        assert ("error" in result) == llama_fails, f"{method} on {name}: {result}, on Llama: {results['Llama'][method]}"
        if llama_fails:
            continue
        assert math.isfinite(result["loss"]), f"{method} on {name}: loss {result['loss']}"
        change = abs(result["loss"] - found["none"])
        assert change < LOSS_TOLERANCE, f"{method} on {name}: loss {found['none']:.4f} -> {result['loss']:.4f}"
        replaced, total = map(int, result["linears"].split(" of "))
        assert replaced >= total - 3, f"{method} on {name}: {result['linears']} Linear layers quantized"
        assert result["generate"], f"{method} on {name}: generate gave the wrong shape"


def test_an_absent_library_is_skipped_by_name(tiny, monkeypatch):
    monkeypatch.setitem(quantization.METHODS, "nothing", ("no_such_quantizer", "pip install no-such-quantizer",
                                                          lambda: None))
    folders, ids, calibration = tiny
    assert quantization.try_method(folders["DIFF V1"], "nothing", ids, calibration) == {
        "skipped": "no_such_quantizer not installed (`pip install no-such-quantizer`)"}


def test_command_without_models_names_the_choice(capsys):
    with pytest.raises(SystemExit) as stopped:
        quantization.main([])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "give saved model folders (with --data), --tiny or --lm-scaling: one of them")


@pytest.mark.slow
def test_llm_compressor_w8a8_reloaded_quantizes_activations_per_token(tiny, tmp_path):
    """The W8A8 folder llm-compressor saves, loaded again by transformers, computes each projection from int8 weights
    (per output channel) and int8 activations (per token, dynamic): a DIFF q_proj's output equals an independent fake
    quantization of its input, and differs from the unquantized input's by far more."""
    if reason := quantization.missing_library("llm-compressor W8A8"):
        pytest.skip(reason)
    folders, _, calibration = tiny
    model = quantization.quantized_model(folders["DIFF V1"], "llm-compressor W8A8", calibration, tmp_path)
    projection, seen = model.model.layers[0].self_attn.q_proj, {}
    projection.register_forward_hook(lambda module, args, out: seen.update(x=args[0], y=out, w=module.weight.clone()))
    with torch.no_grad():
        model(calibration[:2])
    x, y, w = seen["x"], seen["y"], seen["w"]
    steps = w / projection.weight_scale  # int8 weights: whole multiples of their channel's scale
    assert (steps - steps.round()).abs().max() < 1e-3 and steps.abs().max() <= 128
    scale = x.abs().amax(-1, keepdim=True) / 127.5  # symmetric int8 over each token's features (compressed-tensors)
    expected = torch.nn.functional.linear((x / scale).round().clamp(-128, 127) * scale, w)
    unquantized = torch.nn.functional.linear(x, w)
    error, effect = (y - expected).abs().max().item(), (y - unquantized).abs().max().item()
    assert error < 1e-5 < effect / 100, f"max |y - int8-input reference| {error:.2e}, vs float input {effect:.2e}"


def test_saved_models_on_a_text_file(tmp_path):
    """The trained-models mode end to end on a committed small-scale model and a text file: held-out loss from the
    last 10% of the text, each method's cell (measured, or skipped by name), the per-family table, the report file."""
    folder = Path(__file__).parents[1] / "benchmarks/paper_small/text/runs/text-DIFF-seed0-01b3572701.model"
    text = tmp_path / "text.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200)))
    report = quantization.main([str(folder), "--data", str(text), "--block", "32", "--blocks", "4",
                                "--methods", "bitsandbytes 8-bit", "--output", str(tmp_path / "report.md")])
    row = next(line for line in report.splitlines() if line.startswith("| text-DIFF-seed0-01b3572701 |"))
    # independently: blocks of <s> + 31 tokens, the last 10% of them held out, the first 4 of those scored
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    blocks = torch.tensor([[tokenizer.bos_token_id] + ids[i:i + 31] for i in range(0, len(ids) - 30, 31)])
    held_out = blocks[int(0.9 * len(blocks)):][:4]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(held_out, labels=held_out).loss
    assert abs(float(row.split("|")[2]) - expected.item()) < 1e-4, f"{row} vs held-out loss {expected.item():.5f}"
    cell = row.split("|")[3].strip()
    assert cell.startswith(("+", "-", "skipped: bitsandbytes not installed")), cell
    assert "| DIFF | 1 |" in report and (tmp_path / "report.md").read_text().startswith("Generated by `python")
