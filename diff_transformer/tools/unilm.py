"""Moving weights between the paper's published `MultiheadDiffAttn` (arXiv 2410.05258) and `DiffForCausalLM`.

The source is a Llama-shaped decoder whose attention modules are `MultiheadDiffAttn` (embeddings, pre-RMSNorm,
SwiGLU, final norm, as the paper's models), saved with Llama's names apart from the attention's own:

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent: tied embeddings)
    model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight
    model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight
    model.layers.{i}.self_attn.{q_proj,k_proj,v_proj,out_proj}.weight
    model.layers.{i}.self_attn.{lambda_q1,lambda_k1,lambda_q2,lambda_k2,subln.weight}

Two layouts differ (`MultiheadDiffAttn`'s docstring):
- q/k rows: sub-head 2i + b in interleaved RoPE order there; branch-major halves in rotate-half order here. A row
  permutation of each d-wide sub-head (pair (2m, 2m + 1) -> (m, m + d/2)) maps one RoPE convention onto the other
  with the same frequencies.
- GQA: there, both branches of head i read key sub-head (2i + b) // n_rep; here a kv head holds its own (k1, k2)
  pair. No `DiffForCausalLM` GQA layout computes the former, so a GQA source becomes an MHA model whose heads hold
  copies of the shared keys and values (same function, n_rep times the k/v projection rows; fine-tuning may let
  the copies drift apart). `diff_to_unilm(model, num_kv_heads=...)` folds equal copies back.
"""

import warnings

import torch

from ..configuration_diff import DiffConfig
from ..modeling_diff import DiffAttention, DiffForCausalLM
from ..multihead_diffattn import SUBLN_EPS, key_sub_heads

ATTENTION = "model.layers.{}.self_attn."


def rotate_half_order(head_dim: int) -> torch.Tensor:
    """[d]: the interleaved index of each rotate-half index: r < d/2 -> 2r, r >= d/2 -> 2(r - d/2) + 1."""
    half = torch.arange(head_dim // 2)
    return torch.cat([2 * half, 2 * half + 1])


def sub_head_rows(sub_heads: torch.Tensor, head_dim: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """Weight rows of the d-wide sub-heads `sub_heads` (any shape), each in `order` (default: as stored), flat."""
    within = torch.arange(head_dim) if order is None else order
    return (sub_heads.reshape(-1, 1) * head_dim + within).flatten()


def unilm_config(state: dict, rope_theta: float, rms_norm_eps: float, **config_kwargs) -> tuple[DiffConfig, int]:
    """The `DiffConfig` of a unilm decoder state_dict (read from the shapes) and the source's n_rep."""
    embed = state["model.embed_tokens.weight"]
    layers = 1 + max(int(key.split(".")[2]) for key in state if key.startswith("model.layers."))
    head_dim = state[ATTENTION.format(0) + "lambda_q1"].numel()
    hidden = embed.shape[1]
    num_heads = hidden // (2 * head_dim)
    n_rep = hidden // state[ATTENTION.format(0) + "k_proj.weight"].shape[0]
    if rms_norm_eps != SUBLN_EPS:
        warnings.warn(f"SubLN takes rms_norm_eps={rms_norm_eps} here, the published module {SUBLN_EPS}: outputs "
                      "differ by that epsilon's effect", stacklevel=3)
    config = DiffConfig(
        vocab_size=embed.shape[0], hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, head_dim=head_dim, value_head_dim=2 * head_dim,
        intermediate_size=state["model.layers.0.mlp.gate_proj.weight"].shape[0], rms_norm_eps=rms_norm_eps,
        tie_word_embeddings="lm_head.weight" not in state,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        **{"embedding_multiplier": 1.0, **config_kwargs},  # the published decoders add unscaled embeddings
    )
    return config, n_rep


def unilm_to_diff(state: dict, rope_theta: float = 10000.0, rms_norm_eps: float = SUBLN_EPS,
                  **config_kwargs) -> DiffForCausalLM:
    """A `DiffForCausalLM` computing the unilm decoder `state` (module docstring); `rope_theta` is the base of the
    source's `rel_pos` (Llama frequencies, as `rotary_rel_pos` builds them), `rms_norm_eps` its norms' epsilon."""
    config, n_rep = unilm_config(state, rope_theta, rms_norm_eps, **config_kwargs)
    h, d = config.num_attention_heads, config.head_dim
    order = rotate_half_order(d)
    q_rows = sub_head_rows(torch.arange(2 * h).view(h, 2).T, d, order)  # ours (branch, head, r) <- 2i + b
    k_rows = sub_head_rows(key_sub_heads(h, n_rep), d, order)  # ours (branch, head, r) <- (2i + b) // n_rep
    v_rows = sub_head_rows(torch.arange(h) // n_rep, 2 * d)  # ours (head, c) <- value head i // n_rep
    target = {}
    for key, value in state.items():
        prefix, _, name = key.rpartition("self_attn.")
        if not prefix:
            target[key] = value
        elif name.startswith("lambda_"):
            target[f"{prefix}self_attn.lambda_params.{name.removeprefix('lambda_')}"] = value
        else:
            rows = {"q_proj.weight": q_rows, "k_proj.weight": k_rows, "v_proj.weight": v_rows}.get(name)
            name = "o_proj.weight" if name == "out_proj.weight" else name
            target[f"{prefix}self_attn.{name}"] = value if rows is None else value[rows]
    if config.tie_word_embeddings:
        target["lm_head.weight"] = target["model.embed_tokens.weight"]
    model = DiffForCausalLM._from_config(config, dtype=state["model.embed_tokens.weight"].dtype)
    model.load_state_dict(target, strict=True)
    return model.eval()


def folded_rows(ours: torch.Tensor, rows: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """`ours` [n * width, ...] -> the [m * width, ...] unilm weight whose row block s is our block rows[s][0], after
    checking every block listed in rows[s] is an exact copy of it (a fold of tied copies, never an average)."""
    blocks = ours.view(-1, width, *ours.shape[1:])
    for group in rows:
        copies = blocks[group]
        if not torch.equal(copies, copies[:1].expand_as(copies)):
            gap = (copies - copies[:1]).abs().max().item()
            raise ValueError(f"{name}: the heads that share a key/value head in the requested unilm GQA layout hold "
                             f"different weights (max difference {gap:.3g}); export with num_kv_heads=None (MHA)")
    return blocks[rows[:, 0]].flatten(0, 1)


def diff_to_unilm(model: DiffForCausalLM, num_kv_heads: int | None = None) -> dict[str, torch.Tensor]:
    """The unilm decoder state_dict (module docstring) computing `model`, a V1 differential stack with SubLN and
    `value_head_dim = 2 head_dim`. `num_kv_heads=None` exports MHA (always exact; a GQA model's shared k1/k2/v become
    copies); a smaller `num_kv_heads` folds copies that are exactly equal (models imported by `unilm_to_diff`)."""
    config = model.config
    check_exportable(model)
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    num_kv_heads = h if num_kv_heads is None else num_kv_heads
    if h % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_attention_heads={h}")
    n_rep, ours_rep = h // num_kv_heads, h // h_kv
    order = torch.argsort(rotate_half_order(d))  # ours -> interleaved within a sub-head
    heads = torch.arange(h)
    # our sub-head (b * h_kv + head // ours_rep) of every (branch, head) pair, grouped by the unilm sub-head it feeds
    ours_keys = (torch.arange(2)[:, None] * h_kv + heads // ours_rep).T.reshape(-1)  # in unilm order 2i + b
    key_groups = ours_keys.view(2 * num_kv_heads, n_rep)
    value_groups = (heads // ours_rep).view(num_kv_heads, n_rep)
    q_order = (torch.arange(2)[:, None] * h + heads).T.reshape(-1)  # our q sub-head of unilm sub-head 2i + b
    state = {}
    for key, value in model.state_dict().items():
        prefix, _, name = key.rpartition("self_attn.")
        if not prefix:
            if not (key == "lm_head.weight" and config.tie_word_embeddings):
                state[key] = value
            continue
        out = f"{prefix}self_attn."
        if name.startswith("lambda_params."):
            state[out + "lambda_" + name.removeprefix("lambda_params.")] = value
        elif name == "q_proj.weight":
            state[out + name] = value.view(2 * h, d, -1)[q_order][:, order].flatten(0, 1)
        elif name == "k_proj.weight":
            keys = folded_rows(value, key_groups, d, key)
            state[out + name] = keys.view(2 * num_kv_heads, d, -1)[:, order].flatten(0, 1)
        elif name == "v_proj.weight":
            state[out + name] = folded_rows(value, value_groups, 2 * d, key)
        else:
            state[out + ("out_proj.weight" if name == "o_proj.weight" else name)] = value
    return state


def check_exportable(model: DiffForCausalLM) -> None:
    config = model.config
    problems = []
    if config.diff_version != 1 or any(not isinstance(layer.self_attn, DiffAttention) for layer in model.model.layers):
        problems.append("every layer must be a V1 differential attention (no DIFF V2, no hybrid standard layers)")
    if not config.use_subln or config.value_head_dim != 2 * config.head_dim:
        problems.append("use_subln=True and value_head_dim = 2 * head_dim are required")
    if config.attention_bias or config.attention_out_bias or config.mlp_bias:
        problems.append("the published module has no biases")
    if config.lambda_init is not None:
        problems.append("lambda_init must follow the paper schedule (lambda_init=None)")
    if config.embedding_multiplier != 1.0:
        problems.append(f"embedding_multiplier is {config.embedding_multiplier:g}, and these decoders add unscaled "
                        "embeddings (train with DiffConfig(embedding_multiplier=1.0) to export)")
    if problems:
        raise ValueError("cannot export as unilm MultiheadDiffAttn layers: " + "; ".join(problems))
