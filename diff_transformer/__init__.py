"""diff-transformer: the Differential Transformer (arXiv 2410.05258) as a Hugging Face model.

Importing the package registers `DiffConfig` and the model classes with transformers' Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .configuration_diff import DiffConfig
from .modeling_diff import (
    DiffForCausalLM,
    DiffForSequenceClassification,
    DiffModel,
    DiffPreTrainedModel,
    capture_branch_attentions,
)
from .multihead_diffattn import MultiheadDiffAttn, rotary_rel_pos

AutoConfig.register(DiffConfig.model_type, DiffConfig, exist_ok=True)
AutoModel.register(DiffConfig, DiffModel, exist_ok=True)
AutoModelForCausalLM.register(DiffConfig, DiffForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(DiffConfig, DiffForSequenceClassification, exist_ok=True)

# save_pretrained writes `auto_map` and copies the model code, so saved folders load with trust_remote_code.
DiffConfig.register_for_auto_class()
DiffModel.register_for_auto_class("AutoModel")
DiffForCausalLM.register_for_auto_class("AutoModelForCausalLM")
DiffForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "DiffConfig",
    "DiffPreTrainedModel",
    "DiffModel",
    "DiffForCausalLM",
    "DiffForSequenceClassification",
    "capture_branch_attentions",
    "MultiheadDiffAttn",
    "rotary_rel_pos",
]
