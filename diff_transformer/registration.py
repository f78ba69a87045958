"""Everything the package adds to other libraries' tables, in one place.

`register` runs once, when `diff_transformer` is imported; running it again changes nothing (each table is keyed by
our names, and peft's wrapped functions mark themselves). `register_model_code` is the part the model code needs on
its own: `modeling_diff.py` calls it when it is imported, so that a saved folder loaded with
`trust_remote_code=True` (this file ships beside the model code, and no package is imported) makes the same
entries. Two entries are made elsewhere, for reasons named where `register` lists them. The package's versions page
lists the private parts of transformers, peft and vLLM it relies on besides these tables.
"""

import transformers
from transformers import AutoConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto import AutoModel

from .attention_kernels import DIFF_FLASH, diff_flash_standard_attention
from .diff_tensor_parallel import PARALLEL_STYLES
from .peft_defaults import register_peft_defaults


def register_model_code() -> None:
    """The entries the model classes need, made when `modeling_diff.py` is imported (by the package, or as a saved
    folder's remote code)."""
    ALL_ATTENTION_FUNCTIONS.register(DIFF_FLASH, diff_flash_standard_attention)  # transformers' attention functions:
    # "diff_flash" (sdpa in the layers the fused kernel does not run), so that from_pretrained accepts the name
    ALL_MASK_ATTENTION_FUNCTIONS.register(DIFF_FLASH, sdpa_mask)  # transformers' mask builders: sdpa's mask for it
    if PARALLEL_STYLES:  # torch built with torch.distributed
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

        for name, style in PARALLEL_STYLES.items():
            ALL_PARALLEL_STYLES.register(name, style)  # transformers' TP styles: "diff_colwise", "diff_replicated"
    register_peft_defaults()  # peft's TRANSFORMERS_MODELS_TO_*_MAPPING tables (LoRA targets, prefix post-processing)
    # and two wrapped functions: peft_model._prepare_prompt_learning_config, PeftModelForCausalLM's
    # prepare_inputs_for_generation (a no-op without peft)


def register_backbone(config_class: type, model_class: type) -> None:
    """AutoModel: `config_class` -> `model_class`. The task heads call it in their constructor
    (`DiffTaskHead`): transformers' generic heads build their backbone with `AutoModel.from_config`, and a folder
    loaded with trust_remote_code=True may hand them a second DiffConfig class (imported apart from the model code)
    that no Auto class knows."""
    AutoModel.register(config_class, model_class, exist_ok=True)


def register_auto_classes(config_class: type, model_classes: dict[str, type]) -> None:
    """`config_class` with AutoConfig and each of `model_classes` (Auto class name -> model class) with its Auto
    class; marked for the Auto classes too, so that save_pretrained writes `auto_map` and copies the model code."""
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)  # AutoConfig: "diff_transformer"
    config_class.register_for_auto_class()  # the config's `auto_map` entry in a saved config.json
    for auto_name, model_class in model_classes.items():
        auto_class = getattr(transformers, auto_name)
        auto_class.register(config_class, model_class, exist_ok=True)  # AutoModel, AutoModelForCausalLM, ...
        model_class.register_for_auto_class(auto_name)  # its `auto_map` entry


def register(config_class: type, model_classes: dict[str, type]) -> None:
    """Every entry the package makes in transformers', peft's and vLLM's tables (called by `diff_transformer`'s
    `__init__` with `DiffConfig` and the model classes by Auto class)."""
    register_model_code()  # attention functions, mask builders, TP styles, peft defaults (also on modeling_diff import)
    register_auto_classes(config_class, model_classes)  # AutoConfig, AutoModel*, the classes' auto_map entries
    # Made elsewhere:
    # - DiffTaskHead.__init__ (modeling_diff.py) calls register_backbone(type(config), DiffModel): AutoModel for the
    #   config class a remote-code folder hands the task heads, known only when a head is built.
    # - vLLM runs the package's `vllm.general_plugins` entry point, diff_transformer.serving:register, in each of
    #   its processes: vLLM's ModelRegistry ("DiffForCausalLM", the native vLLM model), MODELS_CONFIG_MAP (the
    #   engine's config check), AutoConfig, and a guard on ModelRegistry._try_resolve_transformers (vLLM's
    #   Transformers backend refused for DIFF folders). vLLM is imported only there.


__all__ = ["register", "register_model_code", "register_backbone", "register_auto_classes"]
