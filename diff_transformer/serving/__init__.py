"""Serving DIFF Transformer folders with vLLM. `register` is the `vllm.general_plugins` entry point, which vLLM runs
in each of its processes; `serve` starts vLLM's OpenAI-compatible server on a folder. vLLM is imported only inside
these functions, so `import diff_transformer` never needs it."""

import warnings

from .server import serve

ARCHITECTURE = "DiffForCausalLM"
MODEL_CLASS = "diff_transformer.serving.vllm_model:DiffForCausalLM"
TRANSFORMERS_BACKEND_ERROR = (
    "DIFF Transformer folders cannot run on vLLM's Transformers backend (it sizes attention from "
    "num_attention_heads and would give wrong tokens); drop model_impl='transformers' / --model-impl transformers "
    "and vLLM serves them with the diff-transformer plugin"
)


def register() -> None:
    """Register `DiffConfig` with transformers' AutoConfig (so vLLM reads a folder without trust_remote_code), the
    native model with vLLM's registry, and refuse vLLM's Transformers backend for DIFF folders."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ..configuration_diff import DiffConfig

    AutoConfig.register(DiffConfig.model_type, DiffConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    guard_transformers_backend(ModelRegistry, DiffConfig.model_type)
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, EngineConfigCheck)


class EngineConfigCheck:
    """vLLM's per-architecture config hook (`MODELS_CONFIG_MAP`), which vLLM runs in the calling process when it
    builds the engine's config: what the model would refuse in the engine's worker (parallelism, config fields, head
    sizes), pipeline parallelism in eager mode on the CPU build, and LoRA, refused here, before any engine process
    starts; on a GPU, a warning when vLLM will not run these heads with FlashAttention, and an error when the chosen
    --attention-backend cannot run them."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        from vllm.platforms import current_platform

        from .layout import MERGE_ADVICE, check_pipeline_mode, check_servable, gpu_backend_note, gpu_widths

        if vllm_config.lora_config is not None:
            raise ValueError(f"LoRA adapters are not served for DIFF models: {MERGE_ADVICE}")
        parallel, config = vllm_config.parallel_config, vllm_config.model_config.hf_config
        cpu = current_platform.is_cpu()
        check_servable(config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, cpu)
        check_pipeline_mode(parallel.pipeline_parallel_size, vllm_config.model_config.enforce_eager, cpu)
        if not cpu:  # the CUDA attention backend vLLM will pick, or refuse an unfit choice
            selected = getattr(vllm_config.attention_config.backend, "name", None)
            dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
            if note := gpu_backend_note(gpu_widths(config), dtype, selected):
                warnings.warn(note, stacklevel=2)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None


def guard_transformers_backend(registry, model_type: str) -> None:
    """Make the registry's Transformers-backend resolution raise `TRANSFORMERS_BACKEND_ERROR` for `model_type`."""
    resolve = registry._try_resolve_transformers
    if getattr(resolve, "diff_guard", False):
        return

    def guarded(architecture, model_config):
        if getattr(model_config.hf_config, "model_type", None) == model_type:
            raise ValueError(TRANSFORMERS_BACKEND_ERROR)
        return resolve(architecture, model_config)

    guarded.diff_guard = True
    registry._try_resolve_transformers = guarded


__all__ = ["register", "serve"]
