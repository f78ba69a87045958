"""Motif-2 checkpoints in the publisher's format, for tests: config.json fields (BASE, CASES), random weights under
its names and row orders, a folder with sharded safetensors and their index, and a float64 reference of the
published math (vLLM 0.10.2's Motif port and its differential backend, mlx-motif's model) that reads these
unconverted weights and uses no package code. `fault` plants one of FAULTS in the reference."""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

FAULTS = ("pairing", "lambda_offset", "polynorm_order", "gda_grouping")

# name -> (config.json fields beyond BASE); Motif-2.6B-format (no num_noise_heads) and Motif-2-12.7B-format (GDA)
CASES = {
    "v1-mha-tied": dict(num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True),
    "v1-gqa-untied-bias": dict(num_attention_heads=8, num_key_value_heads=4, use_bias=True),
    "gda-tied": dict(num_attention_heads=10, num_key_value_heads=4, num_noise_heads=2, k_ratio=1, head_dim=16,
                     tie_word_embeddings=True),
    "gda-shared-kv-untied-bias": dict(num_attention_heads=15, num_key_value_heads=2, num_noise_heads=3, k_ratio=1,
                                      head_dim=8, use_bias=True),
}
# Fields a Motif-2 config.json may omit, with the value the public ports then read (vLLM's Motif port:
# `getattr(config, "rope_theta", 10000)`, `use_bias` False, `num_key_value_heads` = `num_attention_heads`;
# mlx-motif: `attn_rms_norm_eps` 1e-5). BASE writes the first three with these values, so a folder without them has
# the reference of one with them.
OMITTABLE = dict(attn_rms_norm_eps=1e-5, rope_theta=10000.0, use_bias=False)
# Motif-2-12.7B's head layout and sizes (40 q heads of which 8 noise, 16 kv heads of 128; untied), on BASE's
# fields: the publisher's tensors of this config.json hold 12,703,860,896 parameters (`source_shapes`)
REAL_12_7B = dict(vocab_size=219520, hidden_size=4096, intermediate_size=16384, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=16, num_noise_heads=8, k_ratio=1, head_dim=128,
                  max_position_embeddings=16384, tie_word_embeddings=False)
REAL_12_7B_PARAMETERS = 12_703_860_896
# Fields of a Motif-3-style release (mixture of experts, latent attention, hyper-connections) on a Motif config.json
MOTIF_3 = dict(architectures=["Motif3ForCausalLM"], model_type="motif3", mhc_enabled=True, hc_mult=4,
               kv_lora_rank=512, q_lora_rank=1536, n_routed_experts=128, num_experts_per_tok=8)
BASE = dict(model_type="motif", architectures=["MotifForCausalLM"], vocab_size=61, hidden_size=64,
            intermediate_size=96, num_hidden_layers=3, max_position_embeddings=64, rms_norm_eps=1e-6,
            attn_rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, hidden_act="poly_norm",
            tie_word_embeddings=False, use_bias=False, bos_token_id=1, eos_token_id=2, use_cache=True,
            sliding_window=None, use_sliding_window=False, attention_dropout=0.0, torch_dtype="float32",
            auto_map={"AutoConfig": "configuration_motif.MotifConfig",
                      "AutoModelForCausalLM": "modeling_motif.MotifForCausalLM"})


# ---- the publisher's format ------------------------------------------------------------------------------------

def source_shapes(fields: dict) -> dict[str, tuple[int, ...]]:
    """Weight name -> shape of one Motif checkpoint, as the public ports define the modules."""
    hidden, inter, d = fields["hidden_size"], fields["intermediate_size"], head_dim(fields)
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    bias = fields.get("use_bias", False)
    shapes = {"model.embed_tokens.weight": (fields["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not fields["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (fields["vocab_size"], hidden)
    o_in = (heads - fields["num_noise_heads"]) * 2 * d if "num_noise_heads" in fields else heads * d
    for i in range(fields["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                 "self_attn.q_proj.weight": (heads * d, hidden), "self_attn.k_proj.weight": (kv * d, hidden),
                 "self_attn.v_proj.weight": (kv * d, hidden), "self_attn.o_proj.weight": (hidden, o_in),
                 "self_attn.subln.weight": (2 * d,), "mlp.gate_proj.weight": (inter, hidden),
                 "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter),
                 "mlp.act_fn.weight": (3,), "mlp.act_fn.bias": (1,)}
        layer.update({f"self_attn.lambda_{n}": (d,) for n in ("q1", "k1", "q2", "k2")})
        if bias:
            layer.update({f"{m}.bias": (layer[f"{m}.weight"][0],) for m in (
                "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")})
        shapes.update({p + name: shape for name, shape in layer.items()})
    return shapes


def head_dim(fields: dict) -> int:
    return fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]


def random_weights(fields: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight random (gains around 1, PolyNorm coefficients of distinct sizes, lambda vectors fp32 N(0, 0.3)),
    so that no fault hides behind a symmetric value."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in source_shapes(fields).items():
        value = torch.randn(shape, generator=generator)
        if name.endswith(("norm.weight", "subln.weight")):
            value = 1 + 0.2 * value
        elif name.endswith("act_fn.weight"):
            value = torch.tensor([0.2, 0.5, 0.9]) + 0.1 * value
        elif "lambda_" in name:
            value = 0.3 * value
        elif not name.endswith("act_fn.bias"):
            value = 0.15 * value
        weights[name] = value.contiguous()
    return weights


def write_motif_folder(path: Path, fields: dict, weights: dict[str, torch.Tensor]) -> Path:
    """config.json, two safetensors shards with their index, a generation config and a tokenizer file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({key: weights[key] for key in keys}, path / shard, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(w.numel() * 4 for w in weights.values())},
             "weight_map": {key: shard for shard, keys in shards.items() for key in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


# ---- the float64 reference, from the published math ------------------------------------------------------------

def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def polynorm(z: torch.Tensor, w: torch.Tensor, b: torch.Tensor, fault: str | None) -> torch.Tensor:
    powers = (1, 2, 3) if fault == "polynorm_order" else (3, 2, 1)
    return sum(w[i] * rms(z ** p, 1e-6) for i, p in enumerate(powers)) + b


def neox_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, T, d], rotate-half RoPE at positions 0..T-1."""
    d, length = x.shape[-1], x.shape[-2]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention; q [n, T, d], k and v [m, T, *] with n a multiple of m (kv head j // (n / m))."""
    k, v = k.repeat_interleave(q.shape[0] // k.shape[0], 0), v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def split_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fields: dict, fault: str | None):
    """(signal q, noise q, k1, k2, v1, v2, gr): Motif-2.6B splits every tensor's heads "(H two)" (adjacent pairs);
    GDA takes q in groups of (gr signal, 1 noise), k and v in (1, 1) pairs."""
    if "num_noise_heads" not in fields:
        if fault == "pairing":  # halves instead of adjacent pairs
            return (*q.chunk(2), *k.chunk(2), *v.chunk(2), 1)
        return q[0::2], q[1::2], k[0::2], k[1::2], v[0::2], v[1::2], 1
    noise = fields["num_noise_heads"]
    gr = q.shape[0] // noise - 1
    grouped = q.unflatten(0, (noise, gr + 1))  # [groups, gr + 1, T, d]
    return grouped[:, :gr].flatten(0, 1), grouped[:, gr], k[0::2], k[1::2], v[0::2], v[1::2], gr


def reference_attention(x: torch.Tensor, w: dict, p: str, fields: dict, layer: int, fault: str | None):
    d, length = head_dim(fields), x.shape[0]

    def project(name: str) -> torch.Tensor:
        out = x @ w[f"{p}{name}.weight"].T + (w[f"{p}{name}.bias"] if f"{p}{name}.bias" in w else 0)
        return out.view(length, -1, d).transpose(0, 1)  # [heads, T, d]

    theta = fields["rope_theta"]
    q, k, v = neox_rope(project("q_proj"), theta), neox_rope(project("k_proj"), theta), project("v_proj")
    q1, q2, k1, k2, v1, v2, gr = split_heads(q, k, v, fields, fault)
    signal = torch.cat([attend(q1, k1, v1), attend(q1, k1, v2)], -1)  # [signal heads, T, 2d]
    noise = torch.cat([attend(q2, k2, v1), attend(q2, k2, v2)], -1)  # [noise heads, T, 2d]
    noise = noise.repeat(gr, 1, 1) if fault == "gda_grouping" else noise.repeat_interleave(gr, 0)
    lq1, lk1, lq2, lk2 = (w[f"{p}lambda_{n}"] for n in ("q1", "k1", "q2", "k2"))
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * (layer if fault == "lambda_offset" else layer - 1))
    lam = torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + lambda_init
    heads = rms(signal - lam * noise, fields["attn_rms_norm_eps"]) * w[f"{p}subln.weight"] * (1 - lambda_init)
    out = heads.transpose(0, 1).reshape(length, -1)
    return out @ w[f"{p}o_proj.weight"].T + w.get(f"{p}o_proj.bias", 0)


def reference_logits(weights: dict, fields: dict, ids: torch.Tensor, fault: str | None = None) -> torch.Tensor:
    """float64 logits [T, vocab] of one sequence `ids`."""
    w = {name: value.double() for name, value in weights.items()}
    eps = fields["rms_norm_eps"]

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0)

    x = w["model.embed_tokens.weight"][ids]
    for layer in range(fields["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = x + reference_attention(rms(x, eps) * w[p + "input_layernorm.weight"], w, p + "self_attn.", fields,
                                    layer, fault)
        h = rms(x, eps) * w[p + "post_attention_layernorm.weight"]
        gate = polynorm(linear(h, p + "mlp.gate_proj"), w[p + "mlp.act_fn.weight"], w[p + "mlp.act_fn.bias"], fault)
        x = x + linear(gate * linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms(x, eps) * w["model.norm.weight"]
    head = w["model.embed_tokens.weight"] if fields["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
