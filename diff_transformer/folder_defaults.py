"""What a saved DIFF Transformer folder (arXiv 2410.05258) gives its clients: the KV cache on, generation defaults
that stop within the context, and an `auto_map` naming every model class; and what loading one reports. The model
classes take `save_pretrained` and `from_pretrained` from `SavedFolderMixin`, so these hold for every folder they
write or read, with the Hub code too."""

import copy
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel

from .saved_folder import check_local_path, write_weights_manifest

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# The Auto class of each model class in modeling_diff.py. A folder saved with the model code lists them all in
# `auto_map`, so that it loads as any of them with trust_remote_code=True (a causal LM checkpoint as a token
# classifier, say, with a new head), not only as the class that saved it.
AUTO_MODEL_CLASSES = {
    "AutoModel": "DiffModel",
    "AutoModelForCausalLM": "DiffForCausalLM",
    "AutoModelForSequenceClassification": "DiffForSequenceClassification",
    "AutoModelForTokenClassification": "DiffForTokenClassification",
    "AutoModelForQuestionAnswering": "DiffForQuestionAnswering",
}


def generation_defaults(generation: GenerationConfig, config: PreTrainedConfig) -> GenerationConfig:
    """In place: the model config's special token ids where unset, and `max_new_tokens` = half the context where no
    length is set, or where `max_length` is the context (as older folders saved it). generate() without a length is
    then not cut at transformers' 20 tokens (`pipeline` would add 256, past a small model's context), a prompt of up
    to half the context stays within it, and a call passing `max_new_tokens` gets no warning about a second length
    (a saved `max_length` gave one on every such call)."""
    for name in SPECIAL_IDS:
        if getattr(generation, name) is None:
            setattr(generation, name, getattr(config, name, None))
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and generation.max_new_tokens is None and generation.max_length in (None, context):
        generation.max_length, generation.max_new_tokens = None, context // 2
    return generation


def given_max_length(args: tuple, kwargs: dict) -> bool:
    """Whether a `generate(*args, **kwargs)` call sets its own `max_length` and no `max_new_tokens` (lm-eval's
    `generate_until` does: prompt + the task's tokens), as a keyword or in the `generation_config` it passes."""
    generation = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    if kwargs.get("max_new_tokens") is not None:
        return False
    if kwargs.get("max_length") is not None:
        return True
    return generation is not None and generation.max_new_tokens is None and "max_length" in generation.to_diff_dict()


@contextmanager
def callers_length(model: PreTrainedModel, args: tuple, kwargs: dict) -> Iterator[None]:
    """While `model.generate(*args, **kwargs)` runs: where the call sets its own `max_length` (`given_max_length`),
    the model's generation config holds no `max_new_tokens` (the default a saved folder carries,
    `generation_defaults`), which transformers would let override the caller's length; restored afterwards."""
    generation = getattr(model, "generation_config", None)
    if generation is None or generation.max_new_tokens is None or not given_max_length(args, kwargs):
        yield
        return
    model.generation_config = copy.deepcopy(generation)
    model.generation_config.max_new_tokens = None
    try:
        yield
    finally:
        model.generation_config = generation


def full_auto_map(model: PreTrainedModel) -> dict[str, str]:
    """`model.config.auto_map` with every entry of `AUTO_MODEL_CLASSES`, in the module of `model`'s class."""
    module = type(model).__module__.rpartition(".")[2]
    entries = {auto: f"{module}.{name}" for auto, name in AUTO_MODEL_CLASSES.items()}
    return {**getattr(model.config, "auto_map", {}), **entries}


@contextmanager
def saved_folder_defaults(model: PreTrainedModel) -> Iterator[None]:
    """While saving: `use_cache=True` (Trainer turns the cache off for training, and exporters such as ExecuTorch
    refuse a model without it), `generation_defaults` and, where the model code is copied into the folder (a class
    registered for an Auto class), `full_auto_map`; the model in memory is left as it was."""
    config = model.config
    use_cache, generation = config.use_cache, getattr(model, "generation_config", None)
    auto_map = vars(config).get("auto_map")
    config.use_cache = True
    if generation is not None:
        model.generation_config = generation_defaults(copy.deepcopy(generation), config)
    if model._auto_class is not None:
        config.auto_map = full_auto_map(model)
    try:
        yield
    finally:
        config.use_cache = use_cache
        if generation is not None:
            model.generation_config = generation
        if auto_map is None:
            vars(config).pop("auto_map", None)
        else:
            config.auto_map = auto_map


def match_weight_file_modes(folder: str | os.PathLike) -> None:
    """safetensors writes weights through a temporary file made 0600 and renamed into place; give the folder's
    *.safetensors files the mode of its config.json (written like any new file, under the umask), so that whoever
    may read the config may read the weights."""
    mode = (Path(folder) / "config.json").stat().st_mode & 0o777
    for path in Path(folder).glob("*.safetensors"):
        os.chmod(path, mode)


class SavedFolderMixin:
    """`from_pretrained` and `save_pretrained` of the model classes: transformers' own, with the checks and defaults
    above."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loading; a missing local folder fails at once (not after a minute of Hub retries), a
        truncated or corrupt safetensors file is reported with its folder and the fix (safetensors' own message
        names neither), and a pickle torch refuses with the fix that runs none of its code."""
        if pretrained_model_name_or_path is not None:
            check_local_path(pretrained_model_name_or_path)
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            raise OSError(
                f"the safetensors weights in {pretrained_model_name_or_path} are truncated or corrupt ({error}); "
                "download them again, or re-save the model with model.save_pretrained"
            ) from error
        except pickle.UnpicklingError as error:  # torch's own message suggests weights_only=False
            raise OSError(
                f"refused to load the pickled weights in {pretrained_model_name_or_path}: they hold more than tensors, "
                "and loading a pickle runs code its author chose; do not pass weights_only=False: use the model's "
                "safetensors weights, or convert it to safetensors with a tool you trust"
            ) from error

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' saving; the folder gets the defaults clients expect (`saved_folder_defaults`: cache on,
        generation within the context), weights as readable as its other files (`match_weight_file_modes`) and
        their checksums (`saved_folder.write_weights_manifest`, which the command line verifies when it loads)."""
        with saved_folder_defaults(self):
            result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            match_weight_file_modes(save_directory)
            write_weights_manifest(save_directory)
        return result
