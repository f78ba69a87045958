"""Default PEFT targets for `model_type="diff_transformer"`, so `LoraConfig()` works without `target_modules`.

LoRA targets every attention and MLP projection. Other PEFT methods reuse their Llama defaults, since the
module names follow Llama. The differential parameters are not Linear layers: train them with
`modules_to_save=DIFF_TRAINABLE_MODULES`.

peft looks the defaults up in its module-level tables by `model.config.model_type` and consults nothing on the
model itself, so `modeling_diff.py` registers them when it is imported. That covers the package, a folder loaded with
`trust_remote_code=True` (this file ships beside the model code) and tools that never import the package.
"""

from .configuration_diff import DiffConfig

try:
    from peft.utils import constants
except ImportError:  # peft is optional: without it there is nothing to register
    constants = None

LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DIFF_TRAINABLE_MODULES = ["lambda_params", "subln"]


def target_module_mappings() -> dict[str, dict]:
    """peft's per-method `TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING` dictionaries, by name."""
    if constants is None:
        return {}
    return {
        name: mapping
        for name, mapping in vars(constants).items()
        if name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MODULES_MAPPING")
        and isinstance(mapping, dict)
    }


def register_peft_defaults(model_type: str = DiffConfig.model_type) -> None:
    for name, mapping in target_module_mappings().items():
        if name == "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING":
            mapping[model_type] = list(LORA_TARGET_MODULES)
        elif "llama" in mapping:
            mapping.setdefault(model_type, mapping["llama"])


__all__ = ["LORA_TARGET_MODULES", "DIFF_TRAINABLE_MODULES", "register_peft_defaults"]
