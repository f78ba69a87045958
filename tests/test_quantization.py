"""benchmarks/quantization.py: transformers' CPU quantization integrations (torchao, optimum-quanto) on tiny DIFF V1,
V2, hybrid and Llama models saved as from_pretrained folders. Each method whose library is installed loads every
model or fails for DIFF exactly where it fails for Llama; where it loads, it replaces the Linear layers, keeps the
held-out loss finite and near the unquantized one, and greedy generate runs. An absent library is skipped by name."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "quantization.py"
spec = importlib.util.spec_from_file_location("quantization", SCRIPT)
quantization = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quantization)

# On tiny random models (loss ~5.6 nats, near uniform over 256 tokens) no method here moved the loss by 0.002; a
# method that garbles a layer moves it by far more.
LOSS_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[dict[str, Path], torch.Tensor]:
    folders = quantization.save_tiny_models(tmp_path_factory.mktemp("tiny"))
    return folders, torch.randint(0, quantization.TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.parametrize("method", list(quantization.METHODS))
def test_method_on_diff_v1_v2_hybrid_and_llama(method, tiny):
    if reason := quantization.missing_library(method):
        pytest.skip(reason)
    folders, ids = tiny
    results = {name: quantization.measure(folder, ids, [method]) for name, folder in folders.items()}
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
    folders, ids = tiny
    assert quantization.try_method(folders["DIFF V1"], "nothing", ids) == {
        "skipped": "no_such_quantizer not installed (`pip install no-such-quantizer`)"}


def test_command_without_models_names_the_choice(capsys):
    with pytest.raises(SystemExit) as stopped:
        quantization.main([])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "give saved model folders (with --data) or --tiny, not both")
