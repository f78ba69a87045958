"""Generic checks of a model config's fields (the Differential Transformer's `DiffConfig`, arXiv 2410.05258, uses
them): misspelt keyword arguments and saved keys, each field's type by its annotation, the rope problems transformers
only logs, and a copy of a config without validation for code that reads other shapes from it."""

import copy
import difflib
import logging
import math
import re
import types
import typing

from huggingface_hub.dataclasses import type_validator
from transformers.configuration_utils import PreTrainedConfig
from transformers.generation import GenerationConfig
from transformers.models.llama.configuration_llama import LlamaConfig

# keyword arguments PreTrainedConfig itself consumes, which may look like one of our fields
BASE_KWARGS = {"output_attentions", "attn_implementation", "experts_implementation", "name_or_path", "torch_dtype"}
# The keys transformers itself writes into a config.json: those of a default `PreTrainedConfig` and `LlamaConfig`
# (transformers_version, architectures, dtype, model_type, ...). Others it may write (auto_map, torch_dtype,
# rope_scaling, quantization_config) resemble no DiffConfig field, so the typo check passes them anyway.
WRITTEN_FIELDS = frozenset({*PreTrainedConfig().to_dict(), *LlamaConfig().to_dict()})
# A norm's epsilon under another model's name (`layer_norm_eps`, `norm_epsilon`, ...): close to `rms_norm_eps` by
# spelling, but what other models' configs (and transformers' own tests, which set each such name) save, not a typo.
EPSILON_NAME = re.compile(r"(^|_)(eps|epsilon)$")


class RopeProblems(logging.Filter):
    """Collects the problems transformers' rope validation logs as warnings ("factor field must be a float or int >=
    1", "Missing ..."), which do not reach the user at the usual verbosity; other records pass as they would."""

    REFUSED = ("must be", "must have", "Missing")

    def __init__(self, level: int):
        super().__init__()
        self.level, self.problems = level, []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(word in message for word in self.REFUSED):
            self.problems.append(message.replace("`rope_parameters`'s ", ""))
            return False
        return record.levelno >= self.level


def misspelled_fields(kwargs: dict, fields: list[str]) -> dict[str, list[str]]:
    """Unknown keyword arguments that closely match a field (`num_heads` -> `num_attention_heads`): transformers
    keeps unknown keys as plain attributes, so such a typo would be silently ignored."""
    ignored = BASE_KWARGS | set(GenerationConfig._get_default_generation_params())
    matches = {key: difflib.get_close_matches(key, fields, n=3, cutoff=0.6) for key in kwargs if key not in ignored}
    return {key: found for key, found in matches.items() if found and not key.startswith("_")}


def misspelled_saved_fields(config_dict: dict, fields: list[str]) -> dict[str, list[str]]:
    """`misspelled_fields` of a saved config.json: its keys transformers does not write itself (`WRITTEN_FIELDS`)
    that closely match a field, except another model's name for a norm's epsilon (`EPSILON_NAME`)."""
    extra = {key: value for key, value in config_dict.items() if key not in WRITTEN_FIELDS and key not in fields
             and not EPSILON_NAME.search(key)}
    return misspelled_fields(extra, fields)


def has_type(value: object, annotation: object) -> bool:
    """Whether `value` fits a field's annotation by huggingface_hub's check (the one transformers' `@strict` configs
    run), except that a float field also takes an int, as JSON may write it, and a float must be finite."""
    if isinstance(value, int) and not isinstance(value, bool) and float in (annotation, *typing.get_args(annotation)):
        value = float(value)
    try:
        type_validator("", value, annotation)
    except TypeError:
        return False
    return not isinstance(value, float) or math.isfinite(value)


def type_name(annotation: object) -> str:
    """`int | list[int] | None` -> "an int or a list of int or None"."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(map(type_name, typing.get_args(annotation)))
    if typing.get_origin(annotation) is list:
        return f"a list of {typing.get_args(annotation)[0].__name__}"
    names = {int: "an int", float: "a finite float", type(None): "None"}
    return names.get(annotation, f"a {getattr(annotation, '__name__', annotation)}")


def unvalidated_copy(config: PreTrainedConfig, **fields) -> PreTrainedConfig:
    """A shallow copy of `config` with `fields` set and no field validation: a description for code that reads
    other shapes from a config (a layer's cache, Llama's modules built with other head counts), not a model config."""
    view = copy.copy(config)
    view.__dict__.update(fields)
    return view
