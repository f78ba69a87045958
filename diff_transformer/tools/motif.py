"""Importing Motif Technologies' Motif-2 checkpoints (Motif-2.6B: differential attention V1, arXiv 2410.05258;
Motif-2-12.7B: grouped differential attention, GDA, arXiv 2510.06949) as `DiffForCausalLM` folders.

Both are Llama-shaped decoders with a PolyNorm MLP (`hidden_act="poly_norm"`), NeoX (rotate-half) RoPE, a per-head
SubLN over 2d with its own epsilon (`attn_rms_norm_eps`) and `lambda_init(l) = 0.8 - 0.6 exp(-0.3 (l - 1))`
(0-based l: `lambda_init_offset=-1`). Their attention, as the public ports (vLLM 0.10.2, mlx-motif) compute it:

- q heads come in groups of (gr signal heads + 1 noise head) ("stripe" order, q_proj rows of d per head); k heads
  in pairs (k1, k2) per kv group and v heads in pairs (v1, v2) per kv group. Signal head i attends with its own q
  over k1 of its kv group, the noise head of its q group (i // gr) with its q over k2, both read V = [v1 | v2] (2d):
  `out_i = (1 - lambda_init) SubLN(A_signal V - lambda A_noise V)`. Motif-2.6B is the case gr = 1 (adjacent
  pairing: q1 = heads 0, 2, 4, ..., q2 = heads 1, 3, ...), with no parameter more than this package's V1 layer.
- In our layout (docs/design.md §2) differential head i is signal head i; branch 2 holds the groups' noise-q
  rows once each (`num_noise_heads` = the groups: grouped differential attention natively, each group's noise map
  computed once), and kv head m holds (k1[m], k2[m]) and v = [v1[m] | v2[m]], which are already adjacent in the
  source. The parameters are the publisher's, tensor for tensor. On request (`expand_noise_heads`, CLI
  `convert --expand-noise-heads`) each noise-q row block is instead copied to every signal head of its group: plain
  DIFF (every backend and server that takes DIFF), exact for inference, gr - 1 extra copies per group, which
  fine-tuning lets drift apart.
- Other Motif releases (Motif-3: mixture of experts, grouped differential latent attention, hyper-connections) are
  refused by their fields before any work (`UNSUPPORTED_RELEASE_FIELDS`).

The converter reads config.json and (sharded) safetensors directly, so the publisher's remote code is never run.
config.json fields it does not know are refused by name unless unset (null / false), since a field the public ports
do not read might still change the forward; `ignore_fields` acknowledges ones the user has checked.
These are tools, not Hub code: `modeling_diff.py` does not import this module.
"""

import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GenerationConfig

from ..configuration_diff import POLY_NORM, DiffConfig
from ..modeling_diff import DiffForCausalLM
from ..saved_folder import read_config, read_json
from .target import copy_tokenizer, load_target
from .unilm import sub_head_rows

MOTIF_ARCHITECTURES = ("MotifForCausalLM",)
# config.json fields that only describe the file or the training run
METADATA = {
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "_name_or_path", "name_or_path", "initializer_range", "max_window_layers", "fused_rope",
}
# fields this converter maps (the values are checked where they are read)
MAPPED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "attn_rms_norm_eps", "rope_theta",
    "rope_scaling", "hidden_act", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "use_bias",
    "attention_bias", "qkv_bias", "num_noise_heads", "k_ratio", "attention_dropout", "sliding_window",
    "use_sliding_window", "partial_rotary_factor", "is_causal",
}
# Fields that mark a Motif release other than Motif-2, with what they add: refused before any work.
UNSUPPORTED_RELEASE_FIELDS = {
    "mhc_enabled": "hyper-connections", "hc_mult": "hyper-connections",
    "kv_lora_rank": "latent attention", "q_lora_rank": "latent attention",
    "n_routed_experts": "mixture of experts", "num_experts": "mixture of experts",
    "num_local_experts": "mixture of experts", "n_shared_experts": "mixture of experts",
    "num_experts_per_tok": "mixture of experts", "moe_intermediate_size": "mixture of experts",
}
ATTN_RMS_NORM_EPS = 1e-5  # the publisher's default where config.json omits attn_rms_norm_eps (as mlx-motif reads it)
INERT_BUFFERS = ("rotary_emb.inv_freq",)  # buffers some exports carry; recomputed from rope_theta


class MotifFormatError(ValueError):
    """A Motif folder this converter cannot import exactly; the message names the field or weight."""


def is_motif_config(fields: dict) -> bool:
    """Whether a config.json (as a dict) is a Motif checkpoint's (any release: `check_release` refuses all but
    Motif-2)."""
    return str(fields.get("model_type", "")).lower().startswith("motif") or any(
        str(name).startswith("Motif") for name in fields.get("architectures") or [])


def check_release(fields: dict) -> None:
    """Refuse, in one line naming the architecture, a Motif release other than Motif-2: by the fields its
    architecture adds (`UNSUPPORTED_RELEASE_FIELDS`), or by an architecture name that is not Motif-2's."""
    architecture = ", ".join(fields.get("architectures") or []) or fields.get("model_type", "?")
    found = [name for name in UNSUPPORTED_RELEASE_FIELDS if fields.get(name) not in (None, False, 0)]
    if found:
        parts = sorted({UNSUPPORTED_RELEASE_FIELDS[name] for name in found})
        raise MotifFormatError(f"{architecture} with {', '.join(parts)} ({', '.join(found)}) is not a Motif-2 "
                               "model (Motif-3 has these) and is not supported: only Motif-2 checkpoints "
                               "(Motif-2.6B, Motif-2-12.7B) convert")
    if str(fields.get("model_type", "motif")).lower() != "motif" or not set(
            fields.get("architectures") or MOTIF_ARCHITECTURES) <= set(MOTIF_ARCHITECTURES):
        raise MotifFormatError(f"{architecture} (model_type {fields.get('model_type')!r}) is not a Motif-2 model "
                               "and is not supported: only MotifForCausalLM checkpoints (Motif-2.6B, "
                               "Motif-2-12.7B) convert")


def is_motif_folder(folder: str | Path) -> bool:
    return (Path(folder) / "config.json").is_file() and is_motif_config(read_config(folder))


def check_fields(fields: dict, ignore_fields: tuple[str, ...] = ()) -> None:
    """Refuse, by name, fields that change the forward in a way the DIFF model does not compute, and unknown fields
    that are set (not null / false) unless listed in `ignore_fields`."""
    check_release(fields)
    problems = []
    if fields.get("use_sliding_window"):
        problems.append(f"use_sliding_window=true (sliding_window={fields.get('sliding_window')}): the DIFF model "
                        "attends to the whole context")
    if fields.get("partial_rotary_factor", 1) not in (1, 1.0):
        problems.append(f"partial_rotary_factor={fields['partial_rotary_factor']}: the DIFF model rotates every "
                        "dimension")
    if fields.get("is_causal", True) is not True:
        problems.append("is_causal=false: the DIFF model is a causal decoder")
    if fields.get("attention_dropout") not in (None, 0, 0.0):
        problems.append(f"attention_dropout={fields['attention_dropout']}: set it to 0")
    if fields.get("k_ratio", 1) != 1:
        problems.append(f"k_ratio={fields['k_ratio']}: only k_ratio=1 (one k1 and one k2 head per kv group, every "
                        "published Motif-2 model) is mapped")
    if fields.get("hidden_act", POLY_NORM) != POLY_NORM:
        problems.append(f"hidden_act={fields['hidden_act']!r}: Motif-2 models use 'poly_norm'")
    unknown = sorted(name for name, value in fields.items()
                     if name not in METADATA | MAPPED | set(ignore_fields) and value not in (None, False))
    if unknown:
        shown = ", ".join(f"{name}={fields[name]!r}" for name in unknown)
        problems.append(f"unknown field(s) {shown}: this converter cannot tell whether they change the model's "
                        "outputs; if you have checked that they do not, pass ignore_fields (CLI: --ignore-field NAME)")
    if problems:
        raise MotifFormatError("cannot convert this Motif checkpoint exactly: " + "; ".join(problems))


def head_layout(fields: dict) -> dict[str, int]:
    """The source's head counts: q groups (`groups`, one noise head each), signal heads per group (`gr`), kv groups
    (`kv_groups`, one (k1, k2) and one (v1, v2) pair each) and the head dim d. Motif-2.6B (no `num_noise_heads`)
    pairs adjacent heads: H/2 groups of gr = 1 over H_kv/2 kv groups."""
    heads = fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    d = fields.get("head_dim") or fields["hidden_size"] // heads
    noise = fields.get("num_noise_heads") or heads // 2
    problems = []
    if heads % noise or heads == noise:
        problems.append(f"num_attention_heads ({heads}) must be a multiple (> 1) of the noise heads ({noise})")
    if kv_heads % 2:
        problems.append(f"num_key_value_heads ({kv_heads}) must be even: (k1, k2) pairs")
    groups, gr, kv_groups = noise, heads // noise - 1, kv_heads // 2
    if not problems and (groups % kv_groups):
        problems.append(f"the {kv_groups} kv groups must divide the {groups} q groups")
    if problems:
        raise MotifFormatError("unsupported Motif head layout: " + "; ".join(problems))
    return {"groups": groups, "gr": gr, "kv_groups": kv_groups, "d": d}


def biases(fields: dict) -> dict[str, bool]:
    """Which projections carry biases, as vLLM's Motif port reads config.json: `attention_bias` or `use_bias` for
    q/k/v and o_proj, `qkv_bias` (where present) for q/k/v alone, `use_bias` for the MLP."""
    attention = bool(fields.get("attention_bias") or fields.get("use_bias"))
    return {"qkv": bool(fields.get("qkv_bias", attention)), "out": attention, "mlp": bool(fields.get("use_bias"))}


def rope_parameters(fields: dict) -> dict:
    scaling = dict(fields.get("rope_scaling") or {})
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_type": "default", **scaling, "rope_theta": float(fields.get("rope_theta", 10000.0))}


def motif_config(fields: dict, expand_noise_heads: bool = False) -> DiffConfig:
    """The `DiffConfig` computing the Motif checkpoint of config.json `fields` (module docstring): grouped noise
    heads as the source has them, or one per head with `expand_noise_heads`."""
    layout, bias = head_layout(fields), biases(fields)
    return DiffConfig(
        num_noise_heads=None if expand_noise_heads else layout["groups"],
        vocab_size=fields["vocab_size"], hidden_size=fields["hidden_size"],
        intermediate_size=fields["intermediate_size"], num_hidden_layers=fields["num_hidden_layers"],
        num_attention_heads=layout["groups"] * layout["gr"], num_key_value_heads=layout["kv_groups"],
        head_dim=layout["d"], value_head_dim=2 * layout["d"], hidden_act=POLY_NORM,
        max_position_embeddings=fields.get("max_position_embeddings", 8192),
        rms_norm_eps=fields.get("rms_norm_eps", 1e-6), subln_eps=fields.get("attn_rms_norm_eps", ATTN_RMS_NORM_EPS),
        rope_parameters=rope_parameters(fields), tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
        bos_token_id=fields.get("bos_token_id"), eos_token_id=fields.get("eos_token_id"),
        pad_token_id=fields.get("pad_token_id"), attention_bias=bias["qkv"], attention_out_bias=bias["out"],
        mlp_bias=bias["mlp"], lambda_init=None, lambda_init_offset=-1, use_subln=True,
        embedding_multiplier=1.0,  # Motif adds unscaled embeddings (both public ports)
    )


def query_rows(groups: int, gr: int, d: int, expand_noise_heads: bool = False) -> torch.Tensor:
    """Source q_proj rows in our order [branch 1 | branch 2]: branch 1 = the groups' signal heads in order (source
    head g (gr + 1) + p), branch 2 = each group's noise head (source head g (gr + 1) + gr), once per group, or with
    `expand_noise_heads` once per signal head of the group."""
    signal = torch.arange(groups * gr)  # our head i
    branch1 = signal // gr * (gr + 1) + signal % gr
    noise_groups = signal // gr if expand_noise_heads else torch.arange(groups)
    return sub_head_rows(torch.cat([branch1, noise_groups * (gr + 1) + gr]), d)


def key_rows(kv_groups: int, d: int) -> torch.Tensor:
    """Source k_proj rows in our order [k1 of every kv group | k2 of every kv group]: source heads 0, 2, ... | 1,
    3, ...; v_proj's (v1, v2) pairs are already our [v1 | v2] rows."""
    pairs = torch.arange(kv_groups) * 2
    return sub_head_rows(torch.cat([pairs, pairs + 1]), d)


def shard_name(folder: Path, name: object) -> str:
    """A shard the index of `folder` names, once it is a file of `folder` itself: `MotifFormatError` for an absolute
    path, a `..`, or a name that resolves (through a link) outside the folder, which the converter would read."""
    path = Path(name) if isinstance(name, str) else None
    if path is None or path.is_absolute() or ".." in path.parts or not (
            (folder / path).resolve().is_relative_to(folder.resolve())):
        raise MotifFormatError(f"{folder}/model.safetensors.index.json names the shard {name!r}, which is not a file "
                               f"of {folder}; an index lists its own folder's files: fix its weight_map")
    return str(path)


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors: model.safetensors, or the shards its index lists."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted({shard_name(folder, name) for name in read_json(index).get("weight_map", {}).values()})
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json; the converter "
                                "reads safetensors weights only")
    state = {}
    for shard in shards:
        state.update(load_file(folder / shard))
    return state


def attention_weight(name: str, value: torch.Tensor, rows: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """One `self_attn.` weight under our name, q/k rows in our order."""
    if name.startswith("lambda_"):
        return f"lambda_params.{name.removeprefix('lambda_')}", value
    projection = name.split(".")[0]
    return name, value[rows[projection]] if projection in rows else value


def motif_state(state: dict[str, torch.Tensor], config: DiffConfig, layout: dict[str, int]) -> dict:
    """The source's weights under our names and in our row order (module docstring)."""
    expand = config.num_noise_heads != layout["groups"]
    rows = {"q_proj": query_rows(layout["groups"], layout["gr"], layout["d"], expand),
            "k_proj": key_rows(layout["kv_groups"], layout["d"])}
    target = {}
    for key, value in state.items():
        if key.endswith(INERT_BUFFERS):
            continue
        prefix, marker, name = key.partition(".self_attn.")
        if marker:
            name, value = attention_weight(name, value, rows)
            key = f"{prefix}.self_attn.{name}"
        target[key] = value
    if config.tie_word_embeddings:
        embed = target.get("model.embed_tokens.weight")
        head = target.setdefault("lm_head.weight", embed)
        if embed is not None and not torch.equal(head, embed):
            raise MotifFormatError("config.json ties the embeddings, but lm_head.weight differs from "
                                   "model.embed_tokens.weight; set tie_word_embeddings to false in config.json")
    return target


def check_weight_names(state: dict, model: DiffForCausalLM) -> None:
    """Name the weights the source has and the model lacks (or the reverse) before loading."""
    expected = set(model.state_dict())
    unexpected, missing = sorted(set(state) - expected), sorted(expected - set(state))
    if unexpected or missing:
        raise MotifFormatError(f"the weights do not fit a Motif model of this config.json: unexpected "
                               f"{unexpected[:8]}, missing {missing[:8]}")


def source_dtype(state: dict, dtype: str) -> torch.dtype:
    return state["model.embed_tokens.weight"].dtype if dtype == "auto" else getattr(torch, dtype)


def import_motif(folder: str | Path, dtype: str = "auto", ignore_fields: tuple[str, ...] = (),
                 expand_noise_heads: bool = False) -> DiffForCausalLM:
    """`DiffForCausalLM` computing the Motif-2 checkpoint in `folder` (its config.json and safetensors).
    `dtype` "auto" keeps the checkpoint's (its embedding's) dtype; `expand_noise_heads` gives plain DIFF (module
    docstring)."""
    fields = read_config(folder)
    check_fields(fields, tuple(ignore_fields))
    config = motif_config(fields, expand_noise_heads)
    state = read_weights(folder)
    target = motif_state(state, config, head_layout(fields))
    model = load_target(config, target, source_dtype(state, dtype), check_weight_names)
    if (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def convert_motif(src: str | Path, out: str | Path, dtype: str = "auto", ignore_fields: tuple[str, ...] = (),
                  expand_noise_heads: bool = False) -> DiffForCausalLM:
    """Import the Motif-2 folder `src` and save it to `out` as a DIFF folder (weights, config, generation config,
    the model code, the tokenizer files)."""
    model = import_motif(src, dtype, ignore_fields, expand_noise_heads)
    model.save_pretrained(out)
    if not copy_tokenizer(str(src), str(out)):
        warnings.warn(f"no tokenizer files found in {src}; save the Motif tokenizer into {out} yourself",
                      stacklevel=2)
    return model


def added_parameters(fields: dict, expand_noise_heads: bool = False) -> int:
    """Parameters the import adds to the checkpoint of config.json `fields`: none natively; with
    `expand_noise_heads`, per layer gr - 1 more copies of each group's noise-q rows (and biases), 0 for Motif-2.6B
    (gr = 1)."""
    if not expand_noise_heads:
        return 0
    layout = head_layout(fields)
    inputs = fields["hidden_size"] + int(biases(fields)["qkv"])
    return (layout["gr"] - 1) * layout["groups"] * layout["d"] * inputs * fields["num_hidden_layers"]


__all__ = ["convert_motif", "import_motif", "is_motif_folder", "added_parameters", "MotifFormatError"]
