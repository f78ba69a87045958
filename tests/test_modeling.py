"""Core model: reference math, lambda, caching, padding, save/load, checkpointing, bad input."""

import copy
import json
import inspect
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import (
    PADDED,
    NONDEGENERATE,
    STACKS,
    assert_decode_matches_full_forward,
    assert_close,
    assert_grads_close,
    assert_layer_matches_reference,
    attention_mask,
    attention_params,
    attention_weights,
    build_stack,
    left_padded,
    paper_lambda_init,
    randomize_gains,
    reference_diff_attention,
    reference_branch_maps,
    reference_lambda,
    tiny_config,
)
from helpers.motif_format import polynorm
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from diff_transformer import DiffConfig, DiffForCausalLM, DiffForSequenceClassification, DiffModel
from diff_transformer.attention_kernels import BRANCH_MAPS, eager_diff_attention
from diff_transformer.diff_lambda import compute_lambda, frozen_lambdas
from diff_transformer.kernel_tiled import tiled_diff_attention
from diff_transformer.poly_norm import build_mlp

BACKENDS = ["eager", "sdpa"]
BF16_ROUNDING = 2.0**-8  # a bf16 number keeps 8 significant bits: rounding to it moves a value by <= 2^-8 relative
FP32_ATOL = 1e-5  # fp32's own error on PolyNorm's terms (|.| < 10): a value that close to a bf16 boundary may round
# either way
DTYPES = [torch.float32, torch.bfloat16]
HEADS = {
    "MHA": dict(num_attention_heads=4, num_key_value_heads=4),
    "GQA": dict(num_attention_heads=4, num_key_value_heads=2),
}


def build_model(backend: str = "sdpa", dtype: torch.dtype = torch.float32, **overrides) -> DiffForCausalLM:
    model = DiffForCausalLM._from_config(tiny_config(**overrides), attn_implementation=backend)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
@PADDED
def test_attention_matches_reference(backend, heads, dtype, padded):
    """B2-T12-H4-D8: output and gradients (input, every weight, lambda vectors, SubLN gain) vs fp64 reference."""
    model = build_model(backend, dtype, **HEADS[heads], hidden_size=64).model
    randomize_gains(model)
    layer_idx = 1
    attn = model.layers[layer_idx].self_attn
    x = torch.randn(2, 12, 64, dtype=dtype, requires_grad=True)
    assert_layer_matches_reference(
        attn, model, x, attention_mask(padded) if padded else None, attention_params(attn),
        lambda x_ref, weights, key_valid: reference_diff_attention(x_ref, weights, model.config, layer_idx, key_valid),
        dtype, f"{backend}/{heads}",
    )


def test_lambda_init_schedule():
    config = tiny_config(num_hidden_layers=6)
    expected = [0.8 - 0.6 * math.exp(-0.3 * i) for i in range(6)]
    assert [config.layer_lambda_init(i) for i in range(6)] == pytest.approx(expected, abs=1e-12)
    assert expected[0] == pytest.approx(0.2) and expected[5] == pytest.approx(0.8 - 0.6 * math.exp(-1.5))
    model = build_model(num_hidden_layers=6)
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.lambda_params.lambda_init == pytest.approx(paper_lambda_init(i))
        assert layer.self_attn.output_scale == pytest.approx(1 - paper_lambda_init(i))
    constant = tiny_config(lambda_init=0.5)
    assert [constant.layer_lambda_init(i) for i in range(2)] == [0.5, 0.5]


def test_lambda_formula_and_init():
    q1, k1, q2, k2 = (torch.randn(8, dtype=torch.float64) for _ in range(4))
    value = compute_lambda(q1, k1, q2, k2, 0.3)
    expected = math.exp(float(q1 @ k1)) - math.exp(float(q2 @ k2)) + 0.3
    assert value.dtype == torch.float64  # fp32 at least: float64 stays float64
    assert value.item() == pytest.approx(expected, rel=1e-12)
    low = compute_lambda(*(t.bfloat16() for t in (q1, k1, q2, k2)), 0.3)
    assert low.dtype == torch.float32  # bf16 (or fp16) vectors: lambda in fp32
    model = build_model(hidden_size=256, num_attention_heads=2, num_hidden_layers=4)  # d = 64
    vectors = torch.cat([torch.cat([p.q1, p.k1, p.q2, p.k2]) for p in
                         (layer.self_attn.lambda_params for layer in model.model.layers)])
    assert vectors.std().item() == pytest.approx(0.1, rel=0.15), "lambda vectors should be N(0, lambda_std_dev)"


def test_frozen_lambdas_scope():
    """`generate` computes each layer's lambda once per call (`frozen_lambdas`): the per-forward value bit for bit,
    released when the last open block ends (a nested block keeps the outer values; of two overlapping blocks, as
    from two threads, neither leaves its values behind), so a weight written in place through `.data` between
    calls, which leaves no version-counter trace, is seen by the next call."""
    model = build_model()
    modules = [layer.self_attn.lambda_params for layer in model.model.layers]
    with frozen_lambdas(model):
        frozen = [m.frozen for m in modules]
        with frozen_lambdas(model):
            pass
        assert all(m.frozen is f for m, f in zip(modules, frozen))
    assert all(m.frozen is None for m in modules)
    assert all(torch.equal(f, m()) for f, m in zip(frozen, modules))
    first, second = frozen_lambdas(model), frozen_lambdas(model)  # overlapping, as from two threads' generate
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert all(m.frozen is not None for m in modules), "an open block must keep its values"
    second.__exit__(None, None, None)
    assert all(m.frozen is None for m in modules), "the last block to close must release the values"
    prompt = torch.randint(3, 97, (2, 7))

    def first_logits():
        out = model.generate(prompt, max_new_tokens=1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        return out.logits[0]

    before = first_logits()
    for m in modules:
        m.q1.data.add_(0.5)
    after = first_logits()
    fresh = build_model()  # an independent model holding the written weights: no state shared with `model`
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = fresh(prompt).logits[:, -1]
    assert not torch.allclose(before, expected, rtol=1e-5, atol=1e-5), "the write should change the logits"
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)
    assert all(m.frozen is None for m in modules)


def greedy_by_full_forward(model, prompt, steps):
    seq = prompt
    for _ in range(steps):
        with torch.no_grad():
            next_token = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, next_token], dim=1)
    return seq


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_greedy_equals_full_forward_argmax(backend, heads):
    model = build_model(backend, **HEADS[heads])
    prompt = torch.randint(3, 97, (2, 7))
    generated = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert generated.shape[1] == 7 + 24
    assert torch.equal(generated, greedy_by_full_forward(model, prompt, 24))


DECODE_STACKS = {"V1-MHA": dict(num_attention_heads=2, num_key_value_heads=2), **STACKS}


def build_nondegenerate(backend: str, stack: str, seed: int = 0) -> DiffForCausalLM:
    """A seeded tiny model of `DECODE_STACKS` with clear logit margins (`NONDEGENERATE`, perturbed norm gains)."""
    torch.manual_seed(seed)
    config = tiny_config(**DECODE_STACKS[stack], **NONDEGENERATE)
    model = DiffForCausalLM._from_config(config, attn_implementation=backend)
    randomize_gains(model)
    return model.eval()


@pytest.mark.parametrize("stack", list(DECODE_STACKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decode_logits_equal_full_forward(backend, stack):
    """Prompts of 7, 3, 5 tokens left-padded into one batch, 6 cached greedy steps: every step's logits vs a full
    forward without a cache of each prompt alone, under the other backend (sdpa's V1 steps run the one-call
    `sdpa_decode_step`, V2 and hybrid transformers' sdpa)."""
    model = build_nondegenerate(backend, stack)
    other = "sdpa" if backend == "eager" else "eager"
    # a config of its own: _from_config sets the backend on the config object it is given
    reference = DiffForCausalLM._from_config(copy.deepcopy(model.config), attn_implementation=other)
    reference.load_state_dict(model.state_dict())
    assert (model.config._attn_implementation, reference.config._attn_implementation) == (backend, other)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=gen) for n in (7, 3, 5)]
    assert_decode_matches_full_forward(model, reference.eval(), prompts, 6, f"{backend} {stack}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_batch_generation_equals_one_by_one(backend):
    model = build_model(backend, num_attention_heads=4, num_key_value_heads=2)
    prompts = [torch.randint(3, 97, (n,)) for n in (9, 4, 6)]
    batch, mask = left_padded(prompts)
    width = batch.shape[1]
    together = model.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(together[i, width:], alone[0, len(p):]), f"prompt {i} differs when batched"


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_forward_matches_unpadded(backend):
    model = build_model(backend)
    tokens = torch.randint(3, 97, (1, 10))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), tokens], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(tokens).logits
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        with_pad = model(padded, attention_mask=mask, position_ids=position_ids).logits[:, 5:]
    assert_close(with_pad, plain, torch.float32, f"{backend} padded vs unpadded logits")


def test_backends_agree_on_loss_and_gradients():
    losses, grads = {}, {}
    batch = torch.randint(3, 97, (2, 16))
    for backend in BACKENDS:
        torch.manual_seed(1)
        model = build_model(backend, num_attention_heads=4, num_key_value_heads=2).train()
        loss = model(batch, labels=batch).loss
        loss.backward()
        losses[backend] = loss.detach()
        grads[backend] = {name: p.grad for name, p in model.named_parameters()}
    assert_close(losses["sdpa"], losses["eager"], torch.float32, "loss sdpa vs eager")
    assert_grads_close(grads["sdpa"], grads["eager"], torch.float32, "sdpa vs eager")


def test_save_load_bit_identical_and_auto_classes(tmp_path):
    model = build_model()
    batch = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        logits = model(batch).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    for name in ("modeling_diff.py", "configuration_diff.py"):
        assert (tmp_path / name).exists(), f"{name} not copied next to the weights"
    auto_map = AutoConfig.from_pretrained(tmp_path).auto_map
    assert auto_map["AutoModelForCausalLM"] == "modeling_diff.DiffForCausalLM"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is DiffForCausalLM
    assert type(AutoConfig.from_pretrained(tmp_path)) is DiffConfig
    assert type(AutoModel.from_pretrained(tmp_path)) is DiffModel
    assert type(AutoModelForSequenceClassification.from_pretrained(tmp_path)) is DiffForSequenceClassification
    with torch.no_grad():
        assert torch.equal(loaded.eval()(batch).logits, logits), "logits changed after save/load"


def test_remote_code_loads_without_package(tmp_path):
    """Logits and cached greedy tokens of the Hub copy equal the package's, under the installed transformers; the
    copy's own code registers the `diff_flash` backend, the TP styles and peft's defaults."""
    model = build_model()
    batch = torch.randint(3, 97, (1, 8))
    with torch.no_grad():
        logits = model(batch).logits
    generated = model.generate(batch, max_new_tokens=12, do_sample=False)
    model.save_pretrained(tmp_path / "model")
    torch.save({"batch": batch, "logits": logits, "generated": generated}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.path = [p for p in sys.path if p not in ("", {os.getcwd()!r})]
        sys.modules["diff_transformer"] = None  # any import of the package now fails
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'model')!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        with torch.no_grad():
            logits = model(expected["batch"]).logits
        diff = (logits - expected["logits"]).abs().max().item()
        assert diff == 0.0, f"max abs diff {{diff}}"
        generated = model.generate(expected["batch"], max_new_tokens=12, do_sample=False)
        assert torch.equal(generated, expected["generated"]), (generated, expected["generated"])
        # the folder's own registration.py made the model code's entries (no package to make them)
        from peft.utils import constants
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        where = ALL_ATTENTION_FUNCTIONS["diff_flash"].__module__
        assert where.startswith("transformers_modules") and where.endswith(".attention_kernels"), where
        assert {{"diff_colwise", "diff_replicated"}} <= set(ALL_PARALLEL_STYLES), sorted(ALL_PARALLEL_STYLES)
        assert constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["diff_transformer"][0] == "q_proj"
        print("REMOTE_OK", type(model).__name__)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "REMOTE_OK DiffForCausalLM" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("stack", list(DECODE_STACKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_checkpointing_same_gradients(backend, stack):
    """Loss and every parameter's gradient with activation checkpointing vs without, per tensor."""
    batch = torch.randint(3, 97, (2, 12))
    grads, losses = [], []
    for checkpointing in (False, True):
        model = build_nondegenerate(backend, stack, seed=3).train()
        if checkpointing:  # transformers 5.24 renamed gradient_checkpointing_enable; the old name warns there
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert model.model.gradient_checkpointing
        loss = model(batch, labels=batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert_close(losses[1], losses[0], torch.float32, f"{backend} {stack} checkpointed loss")
    assert_grads_close(grads[1], grads[0], torch.float32, f"{backend} {stack} checkpointed")


def test_eager_returns_differential_maps():
    """B1-T6-H2-D16, layer 0: captured A1, A2 and the returned A1 - lambda A2 vs the fp64 reference of its input."""
    from diff_transformer import capture_branch_attentions

    model = build_model("eager")
    randomize_gains(model)
    batch = torch.randint(3, 97, (1, 6))
    attn = model.model.layers[0].self_attn
    inputs = []
    hook = attn.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(kwargs["hidden_states"].detach()),
                                          with_kwargs=True)
    with torch.no_grad(), capture_branch_attentions(model) as branches:
        out = model(batch, output_attentions=True)
    hook.remove()
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 2, 6, 6)
    assert len(branches) == 2
    weights = {name: w.detach() for name, w in attention_weights(attn).items()}
    lam, _ = reference_lambda(weights, model.config, 0)
    a1, a2, captured_lam = branches[0]
    assert_close(captured_lam, lam, torch.float32, "captured lambda")
    ref_a1, ref_a2 = reference_branch_maps(inputs[0].double(), weights, model.config)  # [1, h, T, T]
    for j in range(2):
        assert_close(a1[0, j], ref_a1[0, j], torch.float32, f"head {j} A1")
        assert_close(a2[0, j], ref_a2[0, j], torch.float32, f"head {j} A2")
        assert_close(out.attentions[0][0, j], ref_a1[0, j] - lam * ref_a2[0, j], torch.float32,
                     f"head {j} A1 - lambda A2")
    assert BRANCH_MAPS.get() is None, "maps are still collected after the block"


@pytest.mark.parametrize("stack", list(STACKS))
def test_eager_matches_sdpa_with_output_attentions(stack):
    """transformers' eager-vs-sdpa test passes `output_attentions=True` only to a forward whose `**kwargs` declare it
    (`Unpack[TransformersKwargs]`); with it, both backends give the same last hidden states on a left-padded batch,
    the padded positions excepted, as that test checks."""
    sdpa, eager = build_stack("sdpa", stack), build_stack("eager", stack)
    for module in (sdpa, sdpa.model, sdpa.model.layers[0], sdpa.model.layers[0].self_attn):
        kwargs = inspect.signature(module.forward).parameters["kwargs"]
        assert "output_attentions" in kwargs.annotation.__args__[0].__annotations__, type(module).__name__
    ids = torch.randint(3, 97, (7, 9))
    mask = torch.ones_like(ids)
    mask[-1, :2] = 0
    with torch.no_grad():
        expected, actual = (
            m(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True).hidden_states[-1]
            for m in (eager, sdpa)
        )
    assert_close(actual[:-1], expected[:-1], torch.float32, f"{stack}: sdpa vs eager hidden states")
    assert_close(actual[-1, 2:], expected[-1, 2:], torch.float32, f"{stack}: sdpa vs eager, padded row")


@pytest.mark.parametrize(
    "fields, fragment",
    [
        (dict(num_key_value_heads=3), "num_key_value_heads (3) must divide"),
        (dict(hidden_size=60, num_attention_heads=4), "set head_dim explicitly"),
        (dict(head_dim=7), "must be even"),
        (dict(attention_dropout=0.1), "attention_dropout"),
        (dict(lambda_init=1.5), "lambda_init must be in [0, 1)"),
        (dict(diff_version=3), "diff_version must be 1 or 2"),
        (dict(attention_types=["differential"]), "one per layer"),
        (dict(attention_types=["differential", "softmax"]), "must be one of"),
        (dict(diff_version=2, attention_types=["standard", "differential"]), "need diff_version=1"),
        (dict(value_head_dim=24, attention_types=["standard", "differential"]), "multiple of head_dim"),
    ],
    ids=["kv-heads", "head-dim-default", "odd-head-dim", "dropout", "lambda-init", "version", "types-len",
         "types-name", "v2-hybrid", "standard-vdim"],
)
def test_invalid_configs_raise(fields, fragment):
    with pytest.raises(ValueError, match="DiffConfig") as info:
        tiny_config(**fields)
    assert fragment in str(info.value)


def test_out_of_range_token_ids_raise():
    model = build_model()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 97\)"):
        model(torch.tensor([[5, 97]]))
    with pytest.raises(ValueError, match="input_ids must lie"):
        model(torch.tensor([[-1, 5]]))
    model.resize_token_embeddings(101)  # the check follows the embedding, as the error's fix says
    model(torch.tensor([[5, 100]]))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 101\)"):
        model(torch.tensor([[5, 101]]))


def test_unknown_attn_implementation_raises():
    with pytest.raises(ValueError, match="not supported"):
        DiffForCausalLM._from_config(tiny_config(), attn_implementation="fast_magic")


def test_truncated_safetensors_raise(tmp_path):
    build_model().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OSError, match="truncated or corrupt") as info:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value) and "save_pretrained" in str(info.value), str(info.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "fp64"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_padded_rows_give_no_nan(backend, precision):
    """Also under bf16 autocast (Trainer's bf16=True on CPU) and in float64, whose mask minimum overflows fp32."""
    autocast = precision == "bf16-autocast"
    model = build_model(backend, torch.float64 if precision == "fp64" else torch.float32).train()
    batch = torch.randint(3, 97, (3, 8))
    mask = torch.ones_like(batch)
    mask[1] = 0
    mask[2, :5] = 0
    labels = batch.masked_fill(mask == 0, -100)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(batch, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.logits).all(), "NaN/inf in logits of a fully padded row"
    for name, param in model.named_parameters():
        assert torch.isfinite(param.grad).all(), f"NaN/inf in grad of {name}"


@pytest.mark.parametrize("kernel", ["eager", "tiled"])
def test_kernels_compute_in_fp32_under_autocast(kernel):
    """The eager and tiled kernels keep scores and softmax in fp32 under bf16 autocast: bitwise the outputs without
    it, and no NaN from a fully masked row (in bf16 scores an additive mask's fp32 minimum rounds to -inf)."""
    torch.manual_seed(0)
    batch, h, h_kv, length, d = 2, 4, 2, 12, 8
    q, k, v = torch.randn(batch, 2 * h, length, d), *torch.randn(2, batch, h_kv, length, 2 * d)
    lam = torch.tensor(0.3)
    allowed = torch.ones(length, length, dtype=torch.bool).tril() & (torch.arange(length) >= 5)  # rows 0-4: none
    mask = torch.zeros(batch, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    attn = build_model("eager").model.layers[0].self_attn
    if kernel == "eager":
        attend = lambda: eager_diff_attention(attn, q, k, v, lam, mask, d**-0.5)[0]  # noqa: E731
    else:
        attend = lambda: tiled_diff_attention(q, k, v, lam, d**-0.5, mask, rows=4)  # noqa: E731
    expected = attend()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attend()
    assert got.dtype == torch.float32 and torch.isfinite(got).all(), f"{kernel}: {got.dtype}, NaN/inf under autocast"
    diff = (got - expected).abs()
    assert torch.equal(got, expected), f"{kernel}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e}"


LEGACY_ROPE = {
    "default": {},
    "top-level-theta": {"rope_theta": 500000.0},
    "rope_scaling": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
}


@pytest.mark.parametrize("fields", list(LEGACY_ROPE))
def test_legacy_rope_config_formats_load_as_llama_reads_them(fields, tmp_path):
    """A config.json in the older format (`rope_theta` / `rope_scaling` at top level) gives the rope parameters and
    rotary frequencies that transformers' LlamaConfig and LlamaRotaryEmbedding give for the same file."""
    import json

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    shape = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, vocab_size=97)
    config = {"model_type": "diff_transformer", **shape, **LEGACY_ROPE[fields]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = AutoConfig.from_pretrained(tmp_path)
    llama = LlamaConfig(**{**shape, "num_attention_heads": 4}, **LEGACY_ROPE[fields])  # Llama's head_dim = our d = 16
    assert ours.rope_parameters == llama.rope_parameters
    x, positions = torch.zeros(1, 5, 64), torch.arange(5)[None]
    got = DiffModel(ours).rotary_emb(x, positions)
    want = LlamaRotaryEmbedding(llama)(x, positions)
    for a, b in zip(got, want):
        assert_close(a, b, torch.float32, f"{fields} rotary cos/sin")


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_without_subln_matches_reference(backend):
    """use_subln=False with lambda far from 0 (lambda_init 0.5, lambda vectors of std 0.3): no SubLN and no
    (1 - lambda_init) scale, output and gradients vs the fp64 reference."""
    torch.manual_seed(0)
    model = build_model(backend, use_subln=False, lambda_init=0.5, **NONDEGENERATE).model
    attn = model.layers[1].self_attn
    assert isinstance(attn.subln, torch.nn.Identity) and attn.output_scale == 1.0
    lam = attn.lambda_params().item()
    assert abs(lam) > 0.1 and abs(lam - 0.5) > 0.01, f"lambda {lam} should be far from 0 and from lambda_init"
    x = torch.randn(2, 12, 64, requires_grad=True)
    params = {"q": attn.q_proj.weight, "k": attn.k_proj.weight, "v": attn.v_proj.weight, "o": attn.o_proj.weight,
              "lq1": attn.lambda_params.q1, "lk1": attn.lambda_params.k1,
              "lq2": attn.lambda_params.q2, "lk2": attn.lambda_params.k2}
    assert_layer_matches_reference(
        attn, model, x, attention_mask(True), params,
        lambda x_ref, weights, key_valid: reference_diff_attention(x_ref, weights, model.config, 1, key_valid),
        torch.float32, f"{backend} without SubLN",
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_classification_logits_loss_and_padding(backend):
    """DiffForSequenceClassification on a right-padded batch: each row's logits are the score head on the last
    real token's hidden state of that row alone (DiffModel, no padding), as Llama's head pools; its loss is the
    cross-entropy of those logits; a pad id in the middle of the row (not trailing) is no end marker."""
    torch.manual_seed(0)
    config = tiny_config(num_labels=3, **NONDEGENERATE)
    model = DiffForSequenceClassification._from_config(config, attn_implementation=backend).eval()
    base = DiffModel._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    assert model.config._attn_implementation == backend
    missing, unexpected = base.load_state_dict(model.model.state_dict(), strict=False)
    assert not missing and not unexpected, f"the classifier's body is not a DiffModel: missing {missing}, " \
        f"unexpected {unexpected}"
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, 97, (n,), generator=gen) for n in (9, 5, 7)]
    rows[2][3] = config.pad_token_id  # an inner pad token: the pooled token is still the last one
    batch = torch.zeros(3, 9, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = row
    labels = torch.tensor([2, 0, 1])
    lengths = torch.tensor([len(row) for row in rows])
    out = model(batch, attention_mask=(torch.arange(9) < lengths[:, None]).long(), labels=labels)
    with torch.no_grad():
        expected = torch.stack([model.score(base(row[None]).last_hidden_state[0, -1]) for row in rows])
    assert out.logits.shape == (3, 3)
    assert_close(out.logits.detach(), expected, torch.float32, f"{backend} classification logits", "backend")
    assert_close(out.loss.detach(), torch.nn.functional.cross_entropy(expected, labels), torch.float32,
                 f"{backend} classification loss", "backend")
    assert (expected.argmax(-1) != expected.argmin(-1)).all() and expected.std() > 0.05, "degenerate logits"


def init_fields(module: torch.nn.Module) -> dict[str, str]:
    """What a module's `__init__` set: its children (by class name) and plain attributes (by type)."""
    children = {name: type(child).__name__ for name, child in module.named_children()}
    return children | {name: type(value).__name__ for name, value in vars(module).items() if not name.startswith("_")}


def llama_twin(config: DiffConfig):
    from transformers import LlamaConfig

    return LlamaConfig(**{key: getattr(config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "pad_token_id", "rms_norm_eps")})


DIFF_CLASS_NAME = {"LlamaDecoderLayer": "DiffDecoderLayer", "LlamaModel": "DiffModel",
                   "LlamaForCausalLM": "DiffForCausalLM", "LlamaAttention": "DiffStandardAttention"}


@pytest.mark.parametrize("parent", list(DIFF_CLASS_NAME))
def test_classes_hold_what_their_llama_parent_builds(parent):
    """DiffDecoderLayer, DiffModel, DiffForCausalLM and DiffStandardAttention build their modules without calling
    their Llama parent's `__init__` (it would build Llama attention); they must still set every child and attribute
    that `__init__` sets, of the same classes but for the attention and the Diff classes themselves, so that Llama's
    inherited forwards keep working when transformers changes Llama."""
    import transformers.models.llama.modeling_llama as llama

    import diff_transformer.modeling_diff as modeling

    config = tiny_config(attention_types=["standard", "differential"])
    llama_class, diff_class = getattr(llama, parent), getattr(modeling, DIFF_CLASS_NAME[parent])
    built = {"LlamaDecoderLayer": lambda cls, c: cls(c, 1), "LlamaAttention": lambda cls, c: cls(c, 0)}.get(
        parent, lambda cls, c: cls(c))
    theirs, ours = init_fields(built(llama_class, llama_twin(config))), init_fields(built(diff_class, config))
    renamed = {**DIFF_CLASS_NAME, "LlamaAttention": "DiffAttention", "LlamaConfig": "DiffConfig"}
    if parent == "LlamaModel":  # embeddings scaled by config.embedding_multiplier; layers printed by kind
        renamed.update(Embedding="Gemma3TextScaledWordEmbedding", ModuleList="DecoderLayers")
    expected = {name: renamed.get(kind, kind) for name, kind in theirs.items()}
    changed = {k: (ours[k], expected[k]) for k in set(ours) & set(expected) if ours[k] != expected[k]}
    assert ours == expected, (f"{diff_class.__name__} drifted from {parent}: missing {set(expected) - set(ours)}, "
                              f"extra {set(ours) - set(expected)}, other classes {changed}")


def test_print_folds_identical_layers_like_llama():
    """print(model) at 32 layers: the identical layers fold into one entry, as Llama's do (per-layer lambda_init
    values in the repr would stop torch from folding them)."""
    from transformers import LlamaForCausalLM

    config = tiny_config(num_hidden_layers=32)
    ours, theirs = repr(DiffForCausalLM(config)), repr(LlamaForCausalLM(llama_twin(config)))
    assert "(0-31): 32 x DiffDecoderLayer(" in ours, ours[:2000]
    assert len(ours.splitlines()) <= len(theirs.splitlines()) + 2, ours


@pytest.mark.parametrize("multiplier", [None, 1.0, 3.5], ids=["default", "unscaled", "m3.5"])
def test_token_embeddings_are_multiplied_and_only_they(multiplier):
    """The first layer reads embedding_multiplier x E[ids] (None: sqrt(hidden)); the tied output head is not
    scaled: the model equals an unscaled twin of the same weights fed those scaled embeddings."""
    config = tiny_config(embedding_multiplier=multiplier, tie_word_embeddings=True)
    expected = math.sqrt(config.hidden_size) if multiplier is None else multiplier
    torch.manual_seed(0)
    model = DiffForCausalLM(config).eval()
    twin = DiffForCausalLM(tiny_config(embedding_multiplier=1.0, tie_word_embeddings=True)).eval()
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        torch.testing.assert_close(out.hidden_states[0], weight[ids] * torch.tensor(expected), rtol=0, atol=0)
        torch.testing.assert_close(out.logits, twin(inputs_embeds=weight[ids] * expected).logits,
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(model(inputs_embeds=model.get_input_embeddings()(ids)).logits, out.logits)


def test_folder_saved_before_the_multiplier_keeps_unscaled_embeddings():
    """A folder committed before the field existed (its config.json has none) loads with unscaled embeddings."""
    folder = Path(__file__).parents[1] / "benchmarks/paper_small/quick/runs/retrieval-DIFF-seed0-9428adb8fc.model"
    assert "embedding_multiplier" not in json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.embedding_multiplier == 1.0
    ids = torch.arange(min(12, model.config.vocab_size))[None]
    with torch.no_grad():
        first = model(ids, output_hidden_states=True).hidden_states[0]
    assert torch.equal(first, model.get_input_embeddings().weight[ids])


def test_poly_norm_mlp_in_bf16_rounds_only_the_activation_output():
    """The PolyNorm MLP in bf16: its activation, computed in fp32 from the bf16 gate projection, is the float64
    formula (tests/helpers/motif_format.py's) on that same input rounded once to bf16 (<= 2^-8 relative). The
    coefficients nearly cancel (N(z^3) - 0.9 N(z) ...), so bf16 intermediates (a missing fp32 upcast) land up to
    0.07 beyond that bound, where the upcast stays within it (max relative 0.0039, 2^-8). The MLP's output is the
    float64 MLP's within bf16's matmul rounding (measured up to 0.0062 of 1 + |expected|)."""
    torch.manual_seed(0)
    config = tiny_config(hidden_act="poly_norm")
    mlp = build_mlp(config)
    with torch.no_grad():
        mlp.act_fn.weight.copy_(torch.tensor([1.0, 0.2, -0.9]))
        mlp.act_fn.bias.fill_(-0.2)
    mlp = mlp.bfloat16()
    seen = {}
    mlp.act_fn.register_forward_hook(lambda module, args, output: seen.update(gate=args[0], act=output))
    x = torch.randn(4, 16, config.hidden_size).bfloat16()
    with torch.no_grad():
        out = mlp(x)
    w = {name: value.double() for name, value in mlp.state_dict().items()}
    expected_act = polynorm(seen["gate"].double(), w["act_fn.weight"], w["act_fn.bias"], None)
    diff = (seen["act"].double() - expected_act).abs()
    assert seen["act"].dtype == out.dtype == torch.bfloat16, (seen["act"].dtype, out.dtype)
    assert (diff <= BF16_ROUNDING * expected_act.abs() + FP32_ATOL).all(), (
        f"PolyNorm in bf16 vs float64: max diff {diff.max():.3e}, mean {diff.mean():.3e}, max relative "
        f"{(diff / expected_act.abs()).max():.3e} (bound {BF16_ROUNDING:.3e} + {FP32_ATOL:g})")
    xd = x.double()
    expected = (polynorm(xd @ w["gate_proj.weight"].T, w["act_fn.weight"], w["act_fn.bias"], None)
                * (xd @ w["up_proj.weight"].T)) @ w["down_proj.weight"].T
    diff = (out.double() - expected).abs()
    assert (diff <= 0.02 * (1 + expected.abs())).all(), (
        f"PolyNorm MLP in bf16 vs float64: max diff {diff.max():.3e}, mean {diff.mean():.3e}")
