"""The private parts of transformers, peft and torch the package overrides, wraps or calls (docs/versions.md lists
them with where and why): each still exists with the parameters the package passes or receives, so that a release
that renames or reshapes one fails here by name rather than somewhere downstream. The behaviour each is relied on for
is tested where the package uses it (the tests the versions page names)."""

import inspect
import logging

import peft.peft_model as peft_model
import pytest
import torch
import transformers
from peft.utils import constants
from torch.nn.modules import module as torch_module
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel, Trainer
from transformers.generation import GenerationMixin
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# name in docs/versions.md -> (where it lives, its attribute there, the parameters the package relies on, in order,
# after self/cls)
INTERNALS = {
    "PreTrainedModel._check_and_adjust_attn_implementation": (
        PreTrainedModel, "_check_and_adjust_attn_implementation", ["attn_implementation"]),
    "GenerationMixin._get_static_cache_init_shape": (GenerationMixin, "_get_static_cache_init_shape", []),
    "PreTrainedModel.maybe_distribute_model": (PreTrainedModel, "maybe_distribute_model",
                                               ["model", "distributed_config"]),
    "PreTrainedModel._init_weights": (PreTrainedModel, "_init_weights", ["module"]),
    "PreTrainedModel._from_config": (PreTrainedModel, "_from_config", ["config"]),
    "ContinuousBatchingManager._create_batch_processor": (ContinuousBatchingManager, "_create_batch_processor", []),
    "GenerationConfig._get_default_generation_params": (GenerationConfig, "_get_default_generation_params", []),
    "PreTrainedConfig.validate_rope": (PreTrainedConfig, "validate_rope", []),
    "Trainer._get_output_dir": (Trainer, "_get_output_dir", ["trial"]),
    "Trainer._save_checkpoint": (Trainer, "_save_checkpoint", ["model", "trial"]),
    "Trainer._issue_warnings_after_load": (Trainer, "_issue_warnings_after_load", ["load_result"]),
    "peft_model._prepare_prompt_learning_config": (peft_model, "_prepare_prompt_learning_config",
                                                   ["peft_config", "model_config"]),
    "torch _addindent": (torch_module, "_addindent", ["s_", "numSpaces"]),
}


def leading_parameters(function) -> list[str]:
    """The names of `function`'s parameters, without self or cls, unwrapped past functools.wraps."""
    names = list(inspect.signature(inspect.unwrap(function)).parameters)
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


@pytest.mark.parametrize("name", list(INTERNALS))
def test_internal_exists_with_the_parameters_we_pass(name):
    owner, attribute, expected = INTERNALS[name]
    assert hasattr(owner, attribute), f"{name} is gone"
    found = leading_parameters(getattr(owner, attribute))
    assert found[: len(expected)] == expected, f"{name} now takes {found}; the package passes {expected}"


def test_static_cache_shape_hook_is_still_called_by_generate():
    """transformers' generate asks the model for the early static-cache shape by this name (the override is dead
    code otherwise)."""
    source = inspect.getsource(transformers.generation.utils.GenerationMixin)
    assert "self._get_static_cache_init_shape()" in source


def test_batching_manager_builds_its_processor_through_the_hook():
    """The manager builds its batch processor (and so the paged cache) by calling `self._create_batch_processor()`,
    the call paged_cache.py wraps."""
    assert "self._create_batch_processor()" in inspect.getsource(ContinuousBatchingManager)


def test_rope_validation_logs_through_its_module_logger():
    """configuration_diff.py collects rope problems from this logger's records (transformers only logs them)."""
    source = inspect.getsource(transformers.modeling_rope_utils)
    assert transformers.modeling_rope_utils.logger is logging.getLogger("transformers.modeling_rope_utils")
    assert "must be a float or int >= 1" in source and "Missing required keys" in source


def test_serve_keeps_its_generation_state():
    """`transformers serve`'s command keeps its generation thread's state here; transformers_serve.py shuts it down."""
    serve = pytest.importorskip("transformers.cli.serve", reason="transformers' serving extra is not installed")
    assert "self._generation_state = " in inspect.getsource(serve)


def test_attention_registry_lists_its_keys():
    """`unknown_backend` (attention_kernels.py) asks the registry for its names rather than reading error text."""
    assert {"sdpa", "flex_attention"} <= set(ALL_ATTENTION_FUNCTIONS.valid_keys())


def test_peft_tables_and_generation_hook():
    assert isinstance(constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, dict)
    assert isinstance(constants.TRANSFORMERS_MODELS_TO_PREFIX_TUNING_POSTPROCESS_MAPPING, dict)
    assert "llama" in constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    assert callable(peft_model.PeftModelForCausalLM.prepare_inputs_for_generation)


def test_torch_private_ops():
    """The strided shard of tensor parallelism's branch halves and the tiled kernel's softmax backward."""
    from torch.distributed.tensor.placement_types import _StridedShard

    assert list(inspect.signature(_StridedShard).parameters)[:2] == ["dim", "split_factor"]
    probs = torch.softmax(torch.randn(2, 3, dtype=torch.float64), -1)
    grad = torch.randn(2, 3, dtype=torch.float64)
    out = torch.empty_like(grad)
    torch.ops.aten._softmax_backward_data.out(grad, probs, -1, torch.float64, grad_input=out)
    expected = probs * (grad - (grad * probs).sum(-1, keepdim=True))  # d softmax^T grad
    assert torch.allclose(out, expected, atol=1e-12), (out - expected).abs().max()
