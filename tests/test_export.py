"""Export: the routes of docs/export.md (torch.export, ONNX, ExecuTorch) against the eager model.

`torch.export` with dynamic batch and sequence up to the model's context, ONNX through `torch.onnx.export(dynamo=True)`
run by onnxruntime, and transformers' ExecuTorch recipe (`TorchExportableModuleForDecoderOnlyLM`, unmodified: it
allocates the static cache from the config), each against the eager model. The model is the README main job's
(`diff-transformer train`), trained for a few steps."""

import pytest
import torch
from helpers import STACKS, assert_close, build_stack
from torch.export import Dim
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

from diff_transformer_cli import main

PROMPT = "k3 v7 k9 v2 ? k9"


class Logits(torch.nn.Module):
    """input_ids -> logits, without a cache: the graph users export for scoring and ONNX runtimes."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@pytest.fixture(scope="module")
def readme_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export") / "diff-tiny"
    main(["train", "--max-steps", "30", "--examples", "500", "--output", str(folder)])
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def dynamic_shapes(model) -> dict:
    seq = Dim("seq", min=1, max=model.config.max_position_embeddings)
    return {"input_ids": {0: Dim("batch", min=1, max=8), 1: seq}}


def sample_ids(model, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(length))


def test_torch_export_dynamic_batch_and_sequence(readme_model):
    """One program for every batch and length up to the context: lengths 1, 129 (past the CPU tiled kernel's
    threshold, which must not become a shape guard) and the full context match eager logits (fp32 tolerance)."""
    model, _ = readme_model
    program = torch.export.export(Logits(model), (sample_ids(model, 2, 16),), dynamic_shapes=dynamic_shapes(model))
    for batch, length in [(1, 1), (3, 129), (2, model.config.max_position_embeddings)]:
        ids = sample_ids(model, batch, length)
        with torch.no_grad():
            assert_close(program.module()(ids), model(ids).logits, torch.float32, f"exported B{batch}-T{length}")


@pytest.mark.slow
def test_onnx_matches_eager_logits(readme_model, tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime", reason="pip install -e '.[export]'")
    model, _ = readme_model
    program = torch.onnx.export(Logits(model), (sample_ids(model, 2, 16),), dynamic_shapes=dynamic_shapes(model),
                                dynamo=True)
    program.save(tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(tmp_path / "model.onnx", providers=["CPUExecutionProvider"])
    for batch, length in [(1, 5), (3, 200)]:
        ids = sample_ids(model, batch, length)
        (logits,) = session.run(None, {"input_ids": ids.numpy()})
        with torch.no_grad():
            assert_close(torch.from_numpy(logits), model(ids).logits, torch.float32, f"onnxruntime B{batch}-T{length}")


def executorch_program(model, ids: torch.Tensor, max_cache_len: int) -> torch.export.ExportedProgram:
    """transformers' recipe as its documentation uses it: a static-cache generation config, then `export`."""
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": max_cache_len}
    )
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)
    return recipe.export(input_ids=ids[:, :1], cache_position=torch.tensor([0]))


def exported_greedy(program, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with the exported program one token per call, positions 0, 1, ... as an ExecuTorch runner
    feeds them. (transformers' `TorchExportableModuleWithStaticCache.generate` feeds each new token one position
    late, and `TorchExportableModuleForDecoderOnlyLM.generate` feeds the last prompt token twice.)"""
    module, tokens = program.module(), ids[0].tolist()
    for position in range(len(tokens) + new_tokens - 1):
        logits = module(input_ids=torch.tensor([[tokens[position]]]), cache_position=torch.tensor([position]))
        if position >= len(ids[0]) - 1:
            tokens.append(int(logits[0, -1].argmax()))
    return torch.tensor([tokens])


@pytest.mark.slow
def test_executorch_recipe_generates_the_eager_tokens(readme_model):
    model, tokenizer = readme_model
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    program = executorch_program(model, ids, max_cache_len=64)
    exported = exported_greedy(program, ids, 6)
    eager = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, cache_implementation="dynamic")
    assert torch.equal(exported, eager), f"{tokenizer.decode(exported[0])!r} != {tokenizer.decode(eager[0])!r}"


@pytest.mark.slow
@pytest.mark.parametrize("stack", list(STACKS))
def test_executorch_recipe_decodes_like_the_full_forward(stack):
    """Token by token through the exported program's static cache: each step's logits equal the full forward's
    (random tiny models, whose near-tied logits make greedy tokens a fragile comparison)."""
    model = build_stack("sdpa", stack)
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    program = executorch_program(model, ids, max_cache_len=16)
    with torch.no_grad():
        full = model(ids).logits
    for t in range(ids.shape[1]):
        step = program.module()(input_ids=ids[:, t : t + 1], cache_position=torch.tensor([t]))
        assert_close(step[:, -1], full[:, t], torch.float32, f"{stack} step {t}")
