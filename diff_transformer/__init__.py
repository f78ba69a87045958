"""diff-transformer: the Differential Transformer (arXiv 2410.05258) as a Hugging Face model.

Importing the package registers `DiffConfig` and the model classes with transformers' Auto classes.
"""

import transformers
from transformers import AutoConfig

from . import modeling_diff
from .attention_kernels import capture_branch_attentions
from ._version import __version__
from .configuration_diff import DiffConfig
from .folder_defaults import AUTO_MODEL_CLASSES
from .modeling_diff import (
    DiffForCausalLM,
    DiffForQuestionAnswering,
    DiffForSequenceClassification,
    DiffForTokenClassification,
    DiffModel,
    DiffPreTrainedModel,
)
from .multihead_diffattn import MultiheadDiffAttn, rotary_rel_pos


def register_auto_classes() -> None:
    """`DiffConfig` with AutoConfig and each model class with its Auto class (`AUTO_MODEL_CLASSES`); registered for
    the Auto classes too, so that save_pretrained writes `auto_map` and copies the model code, and saved folders load
    with trust_remote_code=True."""
    AutoConfig.register(DiffConfig.model_type, DiffConfig, exist_ok=True)
    DiffConfig.register_for_auto_class()
    for auto_name, class_name in AUTO_MODEL_CLASSES.items():
        model_class = getattr(modeling_diff, class_name)
        getattr(transformers, auto_name).register(DiffConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_name)


register_auto_classes()

__all__ = [
    "__version__",
    "DiffConfig",
    "DiffPreTrainedModel",
    "DiffModel",
    "DiffForCausalLM",
    "DiffForSequenceClassification",
    "DiffForTokenClassification",
    "DiffForQuestionAnswering",
    "capture_branch_attentions",
    "MultiheadDiffAttn",
    "rotary_rel_pos",
]
