"""Configuration of the Differential Transformer (Ye et al., "Differential Transformer", arXiv 2410.05258)."""

import dataclasses
import logging
import math

import torch
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .config_checks import (RopeProblems, has_type, misspelled_fields, misspelled_saved_fields, type_name,
                            unvalidated_copy)
from .saved_folder import MODEL_TYPE, check_local_path, check_model_type

ATTENTION_TYPES = ("differential", "standard")
POLY_NORM = "poly_norm"  # `hidden_act` of the PolyNorm MLP (poly_norm.PolyNorm)
# The private keyword `from_dict` passes: a saved config's extra keys (other tools add some, e.g. transformers' tests
# add `*_eps` fields) are kept as transformers keeps them; only a DiffConfig built in code gets the typo check. A
# keyword, not module state, so that the class pickles by value (vLLM ships remote-code configs so) and nests.
LOADING_SAVED = "_loading_saved"
# Fields whose default for a new config differs from what a config.json without them was saved with.
SAVED_DEFAULTS = {"embedding_multiplier": 1.0}


def rope_parameter_sets(config_dict: dict) -> list[tuple[str, dict]]:
    """(where, parameters) of each RoPE parameter set of a config dict: `rope_parameters` (one set, or one per layer
    type) and the older `rope_scaling`."""
    found = []
    for key in ("rope_parameters", "rope_scaling"):
        value = config_dict.get(key)
        if not isinstance(value, dict):
            continue
        nested = value and all(isinstance(inner, dict) for inner in value.values())
        found += [(f"{key}.{name}.", inner) for name, inner in value.items()] if nested else [(f"{key}.", value)]
    return found


def unsupported_fields(config_dict: dict) -> list[str]:
    """Fields of a config (as a dict: a config.json's or a constructor's keywords) that the DIFF model does not
    implement although Llama-family code acts on them, each as "name=value (what the model does instead)": a
    `sliding_window` (0 means none, as vLLM reads it), and a `partial_rotary_factor` other than 1 (top level, or in
    any RoPE parameter set). transformers' model would ignore them and vLLM's apply them, so they are refused rather
    than kept. Empty when there is none."""
    found = []
    if config_dict.get("sliding_window") not in (None, 0):
        found.append(f"sliding_window={config_dict['sliding_window']!r} (the model attends to the whole context)")
    for where, params in [("", config_dict), *rope_parameter_sets(config_dict)]:
        factor = params.get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            found.append(f"{where}partial_rotary_factor={factor!r} (the model rotates every dimension of a head)")
    return found


def lambda_init_fn(depth: float) -> float:
    """Paper §2.1: lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)), with `depth` the 0-based layer index l - 1 (the name
    and argument of the published code's function)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """What one attention layer caches per token: `kv_heads` heads of keys `key_dim` wide and of values `value_dim`
    wide (`DiffConfig.layer_cache`). The one description every cache consumer reads: transformers' per-layer
    configs, the paged cache, PEFT's prefix, the vLLM layout."""

    kv_heads: int
    key_dim: int
    value_dim: int

    @property
    def key_elements(self) -> int:
        return self.kv_heads * self.key_dim

    @property
    def value_elements(self) -> int:
        return self.kv_heads * self.value_dim


# Tensor parallelism (`tp_plan="auto"`): rank r of n holds whole heads [r h/n, (r+1) h/n), i.e. both branches' q/k rows
# of them in a V1 layer ("diff_colwise", diff_tensor_parallel.py), their kv heads' v rows and their o_proj columns;
# lambda and SubLN whole ("diff_replicated"). n must divide h_kv.
MLP_TP_PLAN = {
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
V1_TP_PLAN = {
    "layers.*.self_attn.q_proj": "diff_colwise",
    "layers.*.self_attn.k_proj": "diff_colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.lambda_params": "diff_replicated",
    "layers.*.self_attn.subln": "diff_replicated",
    **MLP_TP_PLAN,
}
V2_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.lambda_proj": "colwise",
    **MLP_TP_PLAN,
}


class DiffConfig(PreTrainedConfig):
    r"""
    Configuration of a Llama-style decoder with differential attention (arXiv 2410.05258).

    Differential fields (the rest follow `LlamaConfig`):
        num_attention_heads (`int`): differential heads h. Each has two q/k sub-heads of dim `head_dim`.
        num_key_value_heads (`int`, *optional*): kv heads h_kv (GQA); must divide h. Defaults to h.
        head_dim (`int`, *optional*): q/k sub-head dim d. Paper default `hidden_size // (2 h)`.
        value_head_dim (`int`, *optional*): value/output width of a differential head. Defaults to 2d (paper);
            converted pretrained models use d.
        num_noise_heads (`int`, *optional*): grouped differential attention (GDA, arXiv 2510.06949; Motif-2-12.7B):
            the branch-2 ("noise") query heads g. Each serves h / g consecutive differential heads: its map A2 is
            computed once and subtracted, with the layer's lambda, in each of them. It reads the k2 of kv head
            `i // (g / h_kv)`, so g must divide h and be a multiple of h_kv. Defaults to h (one noise head per
            head: the paper's DIFF); V1 only.
        lambda_init (`float`, *optional*): constant lambda_init in [0, 1); `None` uses the paper schedule
            `0.8 - 0.6 exp(-0.3 (layer_idx + lambda_init_offset))`.
        lambda_init_offset (`int`): added to the 0-based layer index in that schedule. 0 is the paper; Motif-2
            checkpoints use -1 (their layer 0 gets 0.8 - 0.6 e^0.3 = -0.0099). Every layer's value must lie in
            (-1, 1), so that the output scale 1 - lambda_init stays in (0, 2); ignored when `lambda_init` is set.
        subln_eps (`float`, *optional*): epsilon of the per-head SubLN. `None` (and a config.json without it) is
            `rms_norm_eps`; Motif-2 checkpoints set it apart (their `attn_rms_norm_eps`).
        lambda_std_dev (`float`): std of the N(0, sigma) init of the lambda vectors.
        use_subln (`bool`): apply the per-head RMSNorm (SubLN) and the `(1 - lambda_init)` scale.
        diff_version (`int`): 1 (paper) or 2 (DIFF V2: one attention call, per-token sigmoid lambda, no SubLN).
        attention_types (`list[str]`, *optional*): per layer `"differential"` or `"standard"` (hybrid stacks).
            A standard layer is Llama attention with `h * value_head_dim / head_dim` heads of dim d, which has the
            same projection shapes as a differential layer when `value_head_dim == 2 * head_dim`.
        attention_bias (`bool`): bias on q/k/v projections. attention_out_bias (`bool`): bias on o_proj.
        hidden_act (`str`): the MLP's gate activation, `down(act(gate x) * up x)`: any of transformers' `ACT2FN`
            names, or `"poly_norm"` (PolyNorm, arXiv 2411.03884, as Motif-2 uses it: `w0 N(z^3) + w1 N(z^2) +
            w2 N(z) + b` with `N(z) = z / rms(z)` over the last dim, eps 1e-6; learnable `mlp.act_fn.weight` [3]
            and `mlp.act_fn.bias` [1], initialised to 1/3 and 0).
        embedding_multiplier (`float`, *optional*): the token embeddings are multiplied by it in the forward (the
            input embedding module does, as Gemma's; the tied output head is not scaled). `None` (the default for
            a new config) is `sqrt(hidden_size)`: with Llama's N(0, 0.02) init, SubLN's unit-RMS head outputs
            would otherwise start several times larger than the embeddings they are added to (the
            project's single-epoch language-modelling benchmark measured this start as DIFF's best). A
            config.json without the field (saved before it existed) loads with 1.0, as it was trained; converted
            checkpoints keep their source's scaling (1.0 for Llama-family models).

    Invalid combinations raise `ValueError` at construction, naming the field and the fix.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the output's cache, under either name
    base_model_tp_plan = V1_TP_PLAN  # `V2_TP_PLAN` when diff_version=2 (set in `__post_init__`)
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    value_head_dim: int | None = None
    num_noise_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    lambda_init: float | None = None
    lambda_init_offset: int = 0
    subln_eps: float | None = None
    lambda_std_dev: float = 0.1
    use_subln: bool = True
    diff_version: int = 1
    attention_types: list[str] | None = None
    embedding_multiplier: float | None = None

    def __post_init__(self, **kwargs):
        saved = kwargs.pop(LOADING_SAVED, False)
        unsupported = unsupported_fields({**kwargs, "rope_parameters": self.rope_parameters})
        self._check(
            not unsupported,
            f"{' and '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported; remove "
            + ("them" if len(unsupported) > 1 else "it") + (" from config.json" if saved else ""),
        )
        if not saved:
            self.check_unknown(kwargs)
        self.check_types(saved)
        self.check_dtype(kwargs.get("torch_dtype"))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self._check(
                self.hidden_size % (2 * self.num_attention_heads) == 0,
                f"hidden_size ({self.hidden_size}) must be divisible by 2 * num_attention_heads "
                f"({2 * self.num_attention_heads}) for the paper default head_dim; set head_dim explicitly",
            )
            self.head_dim = self.hidden_size // (2 * self.num_attention_heads)
        if self.value_head_dim is None:
            self.value_head_dim = 2 * self.head_dim
        if self.num_noise_heads is None:
            self.num_noise_heads = self.num_attention_heads
        if self.attention_types is None:
            self.attention_types = ["differential"] * self.num_hidden_layers
        if self.embedding_multiplier is None:
            self.embedding_multiplier = math.sqrt(self.hidden_size)
        if self.subln_eps is None:
            self.subln_eps = self.rms_norm_eps
        self.validate_diff()
        if self.diff_version == 2:
            self.base_model_tp_plan = V2_TP_PLAN  # an instance attribute; transformers never serializes the plan
        super().__post_init__(**kwargs)
        self.validate_rope()

    def validate_rope(self) -> None:
        """transformers' rope checks, which `@strict` runs after init for LlamaConfig, but refusing what they only
        log (a `factor` below 1 scales positions by a negative or tiny number: wrong outputs, no error) and with a
        `ValueError` for a missing key (transformers raises `KeyError`)."""
        logger = logging.getLogger("transformers.modeling_rope_utils")
        problems, level = RopeProblems(logger.getEffectiveLevel()), logger.level
        logger.addFilter(problems)
        logger.setLevel(logging.WARNING)
        try:
            super().validate_rope()
        except KeyError as error:
            problems.problems.append(str(error.args[0]))
        finally:
            logger.setLevel(level)
            logger.removeFilter(problems)
        self._check(
            not problems.problems,
            f"invalid rope_parameters {self.rope_parameters}: {'; '.join(problems.problems)}; fix or remove them "
            "(rope_parameters, or rope_scaling in an older config.json)",
        )

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "DiffConfig":
        """transformers' `from_dict`, with the saved keys' typo check (`misspelled_saved_fields`: a misspelt field
        such as `"num_heads": 8` would be kept as an unused attribute) in place of the constructor's (`LOADING_SAVED`);
        a config saved before `embedding_multiplier` existed keeps the 1.0 it was trained with (`SAVED_DEFAULTS`)."""
        for key, matches in misspelled_saved_fields(config_dict, list(cls.own_fields())).items():
            cls._check(False, f"unknown field {key!r} in config.json; did you mean {' or '.join(map(repr, matches))}? "
                              "(transformers would keep it as an unused attribute); fix or remove it")
        return super().from_dict({**SAVED_DEFAULTS, **config_dict, LOADING_SAVED: True}, **kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """transformers' lookup, but a missing local folder and a checkpoint of another architecture are refused
        with the fix. The model classes' `from_pretrained` checks the folder itself first (transformers resolves
        files before it reads the config) and comes through here for the architecture."""
        check_local_path(pretrained_model_name_or_path)
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        check_model_type(config_dict, pretrained_model_name_or_path)
        return config_dict, kwargs

    @staticmethod
    def own_fields() -> dict[str, object]:
        """DiffConfig's fields (not PreTrainedConfig's) and their annotations."""
        return {name: kind for name, kind in DiffConfig.__annotations__.items() if not name.startswith("_")}

    def check_unknown(self, kwargs: dict) -> None:
        for key, matches in misspelled_fields(kwargs, list(self.own_fields())).items():
            self._check(
                False,
                f"unknown field {key!r}; did you mean {' or '.join(map(repr, matches))}? (transformers would keep "
                "it as an unused attribute)",
            )

    def check_types(self, saved: bool) -> None:
        """Refuse a field of the wrong type (`"num_hidden_layers": "two"` or `null` in config.json), which would
        otherwise fail later with a TypeError or a misleading message."""
        for name, annotation in self.own_fields().items():
            value, expected = getattr(self, name), type_name(annotation)
            self._check(
                has_type(value, annotation),
                f"{name} must be {expected}, got {value!r} ({type(value).__name__}); "
                + ("fix it in config.json" if saved else f"pass {expected}"),
            )

    def check_dtype(self, torch_dtype: object = None) -> None:
        """Refuse a `dtype` (or older `torch_dtype`) string that names no torch dtype (`"fp16"`), which transformers
        would answer with `module 'torch' has no attribute 'fp16'`."""
        for dtype in (getattr(self, "dtype", None), torch_dtype):
            if isinstance(dtype, str) and dtype != "auto":
                self._check(isinstance(getattr(torch, dtype, None), torch.dtype),
                            f"dtype {dtype!r} is no torch dtype; use 'float16', 'bfloat16' or 'float32' (or 'auto': "
                            "the checkpoint's)")

    @staticmethod
    def _check(condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(f"DiffConfig: {message}.")

    def validate_diff(self) -> None:
        """Raise `ValueError` for field combinations the model cannot build."""
        check = self._check
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "value_head_dim", "num_noise_heads", "max_position_embeddings")
        for name in sizes:
            check(getattr(self, name) > 0, f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("rms_norm_eps", "subln_eps"):
            check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        check(self.hidden_act == POLY_NORM or self.hidden_act in ACT2FN,
              f"hidden_act {self.hidden_act!r} is unknown; use '{POLY_NORM}' or one of transformers' activations "
              "such as 'silu'")
        for name in ("initializer_range", "lambda_std_dev"):
            check(getattr(self, name) >= 0, f"{name} is a standard deviation, so >= 0; got {getattr(self, name)}")
        check(self.embedding_multiplier > 0, f"embedding_multiplier must be > 0 (1.0: unscaled embeddings, None: "
              f"sqrt(hidden_size)), got {self.embedding_multiplier}")
        check(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
            f"({self.num_attention_heads}); pick a divisor such as {self.num_attention_heads}",
        )
        check(self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        self.check_noise_heads()
        check(self.diff_version in (1, 2), f"diff_version must be 1 or 2, got {self.diff_version}")
        check(not self.attention_dropout, "attention_dropout is not defined by the paper; set it to 0.0")
        check(
            self.lambda_init is None or 0.0 <= self.lambda_init < 1.0,
            f"lambda_init must be in [0, 1) or None for the paper schedule, got {self.lambda_init}",
        )
        self.check_lambda_schedule()
        check(
            len(self.attention_types) == self.num_hidden_layers,
            f"attention_types has {len(self.attention_types)} entries; give one per layer "
            f"(num_hidden_layers={self.num_hidden_layers})",
        )
        check(
            set(self.attention_types) <= set(ATTENTION_TYPES),
            f"attention_types entries must be one of {ATTENTION_TYPES}, got {sorted(set(self.attention_types))}",
        )
        if self.diff_version == 2:
            check(
                "standard" not in self.attention_types,
                "hybrid stacks (attention_types with 'standard') need diff_version=1",
            )
            check(
                self.value_head_dim == 2 * self.head_dim,
                "value_head_dim does not apply to diff_version=2 (its heads are head_dim wide); leave it unset",
            )
        elif "standard" in self.attention_types:
            check(
                self.value_head_dim % self.head_dim == 0,
                f"standard layers need value_head_dim ({self.value_head_dim}) to be a multiple of head_dim "
                f"({self.head_dim})",
            )

    def check_noise_heads(self) -> None:
        """Grouped noise heads (GDA): V1 only; g divides h (whole groups) and is a multiple of h_kv (each noise head
        reads the k2 of one kv head, as the publisher's layout has it)."""
        h, g, h_kv = self.num_attention_heads, self.num_noise_heads, self.num_key_value_heads
        if g == h:
            return
        self._check(self.diff_version == 1, f"num_noise_heads ({g}) applies to diff_version=1 only (grouped "
                    "differential attention); leave it unset for diff_version=2")
        self._check(h % g == 0 and g % h_kv == 0,
                    f"num_noise_heads ({g}) must divide num_attention_heads ({h}) and be a multiple of "
                    f"num_key_value_heads ({h_kv}), since each noise head reads the k2 of one kv head; pick one "
                    f"of {[n for n in range(h_kv, h + 1, h_kv) if h % n == 0]}")

    @property
    def noise_group_size(self) -> int:
        """Differential heads per noise head, h / num_noise_heads (1: the paper's DIFF)."""
        return self.num_attention_heads // self.num_noise_heads

    @property
    def per_layer_config(self) -> list["DiffConfig"]:
        """Each layer's config as transformers reads it to allocate a cache before the first forward (`generate`'s
        static cache, the ExecuTorch recipe): `num_key_value_heads` x `head_dim` of the cached keys and values.

        A differential layer's cache is not its query shape: V1 caches packed keys (k1 | k2)
        and values 2d wide per kv head, V2 h_kv heads of d, and a standard layer of a hybrid stack h_kv dv / d
        heads of d. Where keys and values differ in width (V1 with dv != 2d), `qk_head_dim` / `v_head_dim` mark
        the layer as transformers marks MLA layers, and the cache is allocated by the first forward instead."""
        return [self.layer_cache_config(kind) for kind in self.attention_types]

    @per_layer_config.setter
    def per_layer_config(self, value: dict | None) -> None:
        self._check(value is None, "per_layer_config is not supported; hybrid stacks are set by attention_types")

    @property
    def per_layer_attributes(self) -> set[str]:
        """The fields `per_layer_config` sets per layer (those transformers reads from each layer's config)."""
        return {"num_key_value_heads", "head_dim"}

    def layer_cache(self, kind: str) -> LayerCache:
        """What a layer of `kind` (an `attention_types` entry) caches per token: a V1 differential layer packed keys
        (k1 | k2) 2d wide and values dv wide per kv head; a V2 layer h_kv heads of d; a standard layer of a hybrid
        stack h_kv dv / d heads of d (Llama attention with the projection shapes of a differential layer). Grouped
        noise heads (`num_noise_heads`) change none of these: each reads the k2 of one kv head."""
        d, dv, h_kv = self.head_dim, self.value_head_dim, self.num_key_value_heads
        if kind == "standard":
            return LayerCache(h_kv * dv // d, d, d)
        if self.diff_version == 2:
            return LayerCache(h_kv, d, d)
        return LayerCache(h_kv, 2 * d, dv)

    def widest_cached_row(self) -> int:
        """Per token, the most elements any layer's keys or values take (`layer_cache`)."""
        caches = [self.layer_cache(kind) for kind in set(self.attention_types)]
        return max(max(cache.key_elements, cache.value_elements) for cache in caches)

    def layer_cache_config(self, kind: str) -> "DiffConfig":
        """A copy of the config describing a layer's cache as transformers reads it: `num_key_value_heads` x
        `head_dim`, and, where keys and values differ in width, `qk_head_dim` / `v_head_dim` (as transformers marks
        MLA layers)."""
        cache = self.layer_cache(kind)
        shape = {"num_key_value_heads": cache.kv_heads, "head_dim": cache.key_dim}
        if cache.key_dim != cache.value_dim:
            shape |= {"qk_head_dim": cache.key_dim, "v_head_dim": cache.value_dim}
        return unvalidated_copy(self, **shape)

    def check_lambda_schedule(self) -> None:
        """Refuse a `lambda_init_offset` that gives a layer a lambda_init outside (-1, 1) (output scale
        1 - lambda_init outside (0, 2)); the schedule rises with the layer index, so layer 0 is the one to check."""
        if self.lambda_init is not None:
            return
        first = self.layer_lambda_init(0)
        self._check(
            -1.0 < first < 1.0,
            f"lambda_init_offset={self.lambda_init_offset} gives layer 0 lambda_init = 0.8 - 0.6 exp(-0.3 "
            f"({self.lambda_init_offset})) = {first:.4g}, outside (-1, 1); use an offset >= -3 (0: the paper, "
            "-1: Motif-2)",
        )

    def layer_lambda_init(self, layer_idx: int) -> float:
        """lambda_init of a layer: the constant override, else `0.8 - 0.6 exp(-0.3 (layer_idx +
        lambda_init_offset))` (0-based layer_idx)."""
        if self.lambda_init is not None:
            return self.lambda_init
        return lambda_init_fn(layer_idx + self.lambda_init_offset)


__all__ = ["DiffConfig", "LayerCache", "unsupported_fields"]
