"""diff-transformer: the Differential Transformer (arXiv 2410.05258) as a Hugging Face model.

Importing the package makes its entries in transformers' and peft's tables (`registration.register`, which lists
every one): `DiffConfig` and the model classes with the Auto classes, the `diff_flash` backend, the tensor-parallel
styles, peft's defaults.
"""

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
from .registration import register

register(DiffConfig, {auto_name: getattr(modeling_diff, name) for auto_name, name in AUTO_MODEL_CLASSES.items()})

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
