"""The differential attention kernels of the model's layers and the rule that picks one (Ye et al., "Differential
Transformer", arXiv 2410.05258): per layer and call, `select_kernel` names an entry of `DIFF_KERNELS`.

Each V1 kernel takes (module, q, k, v, lam, attention_mask, scaling, **kwargs) in the packed layout of
kernel_common.py (q [B, 2h, T, d] in halves order, keys packed [B, h_kv, S, 2d] = (k1 | k2), v [B, h_kv, S, dv])
and returns (out [B, T, h, dv] fp32, the differential map [B, h, T, S] or None). The small kernels live here; the
tiled CPU kernel and the fused Triton kernel have files of their own, and kernel_naive.py is the float64 reference
all of them are tested against. `eager_v2_attention` is DIFF V2's kernel. `diff_attention` is what a layer calls.

`diff_flash` is also registered with transformers' attention interface (`DiffFlashBackend` accepts the name) and
`capture_branch_attentions` collects the eager kernel's branch maps.
"""

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import repeat_kv
from transformers.utils import is_torchdynamo_compiling

from .configuration_diff import DiffConfig
from .diff_lambda import DiffLambda
from .kernel_common import (autocast_off, drop_unfilled_keys, expand_noise, masked_scores, per_head, split_branches,
                            upcast)
from .kernel_tiled import tiled_diff_attention, tiled_is_faster
from .paged_cache import PAGED_EAGER

try:
    from .kernel_diff_flash import TileDoesNotFit, diff_flash_attention, triton_available, unfit_reason
except ImportError:  # the Hub copy may lack the kernel file's optional dependencies
    diff_flash_attention = None

    class TileDoesNotFit(RuntimeError):
        """Never raised here: without its module the fused kernel does not run."""

    def triton_available() -> tuple[bool, str]:
        return False, "the diff_flash kernel module could not be imported; use attn_implementation='sdpa'"

    def unfit_reason(head_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device) -> str:
        return ""


DIFF_FLASH = "diff_flash"  # the fused kernel's name as an `attn_implementation`


# `capture_branch_attentions` collects (A1, A2, lambda) of every eager differential layer here.
BRANCH_MAPS: ContextVar[list | None] = ContextVar("diff_branch_maps", default=None)


def noise_group(module: torch.nn.Module) -> int:
    """Differential heads per noise head of the layer (`DiffConfig.noise_group_size`); 1 for a module whose config
    has no grouped noise heads (the authors' module API, `multihead_diffattn.py`)."""
    return getattr(module.config, "noise_group_size", 1)


@autocast_off
def eager_diff_attention(module, q, k, v, lam, attention_mask, scaling, **kwargs):
    """The paper's formula as written: both softmax maps in fp32, their difference A1 - lambda A2, times V; the one
    kernel that returns the map (and feeds `capture_branch_attentions`). Returns (out [B, T, h, dv] fp32, the
    differential map [B, h, T, S])."""
    group = noise_group(module)
    q1, q2, k1, k2 = split_branches(q, k, group)
    k1, v = (repeat_kv(x, q1.shape[1] // k.shape[1]) for x in (k1, v))  # [B, h, S, .]
    k2 = repeat_kv(k2, q2.shape[1] // k.shape[1])  # [B, g, S, d]: one per noise head
    a1 = torch.softmax(masked_scores(q1, k1, attention_mask, scaling), dim=-1)  # [B, h, T, S]
    a2 = torch.softmax(masked_scores(q2, k2, attention_mask, scaling), dim=-1)  # [B, g, T, S]: once per group
    a2 = per_head(a2, group, dim=1)  # [B, h, T, S]: the group's map in each of its heads
    if not is_torchdynamo_compiling() and (branch_maps := BRANCH_MAPS.get()) is not None:  # get() is untraceable
        branch_maps.append((a1.detach(), a2.detach(), lam.detach()))
    diff_map = torch.addcmul(a1, a2, lam, value=-1)  # A1 - lambda A2
    return torch.matmul(diff_map, upcast(v)).transpose(1, 2), diff_map.to(q.dtype)


def branch_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 group: int = 1) -> list[list[tuple[torch.Tensor, ...]]]:
    """Per branch, the (query, key, value) standard-attention calls whose outputs concatenate to A_b V.

    FlashAttention kernels need equal q/k/v head dims (transformers' flash path silently pads/crops a wider V, and
    torch's fused sdpa kernels fall back to the slow math path). When V is as wide as the packed keys (dv = 2d, the
    paper's layout) each branch is ONE call without copying K or V: the zero-padded query [q1, 0] (or [0, q2])
    dotted with (k1 | k2) is exactly q1.k1 (or q2.k2). Otherwise V is split in d-wide chunks against k1 / k2.
    With grouped noise heads (`group` > 1) branch 2 has one query head per noise head.
    """
    q1, q2, k1, k2 = split_branches(q, k, group)
    d = q.shape[-1]
    if v.shape[-1] == k.shape[-1]:
        return [[(F.pad(q1, (0, d)), k, v)], [(F.pad(q2, (d, 0)), k, v)]]  # queries [B, h, T, 2d]
    chunks = v.split(d, dim=-1)
    return [[(q1, k1, chunk) for chunk in chunks], [(q2, k2, chunk) for chunk in chunks]]


class NoiseBranch:
    """A layer as transformers' attention functions see it in the noise branch of grouped noise heads: g query
    heads over the h_kv kv heads (`num_key_value_groups` = g / h_kv); every other attribute is the layer's."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        self.module, self.num_key_value_groups = module, num_key_value_groups

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def standard_attention_calls(module, q, k, v, lam, attention_mask, scaling, **kwargs):
    """Two standard-attention calls per branch through transformers' attention interface (sdpa, flash, flex). With
    grouped noise heads the noise branch attends once per noise head, and each output serves its group."""
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, sdpa_attention_forward)
    group = noise_group(module)
    noise_heads = q.shape[1] - q.shape[1] * group // (group + 1)
    callers = (module, module if group == 1 else NoiseBranch(module, noise_heads // k.shape[1]))
    branch_outputs = []
    for calls, caller in zip(branch_calls(q, k, v, group), callers):
        parts = [attend(caller, *call, attention_mask, dropout=0.0, scaling=scaling, **kwargs)[0] for call in calls]
        branch_outputs.append((parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).float())  # [B, T, h|g, dv]
    return branch_outputs[0] - lam * per_head(branch_outputs[1], group, dim=2), None


def sdpa_decode_step(module, q, k, v, lam, attention_mask, scaling, **kwargs):
    """One query row (T = 1, dv = 2d) in ONE torch sdpa call: per kv head, both branches' zero-padded queries [q1, 0]
    and [0, q2] of its n_rep heads attend the packed keys as 2 n_rep query rows (a decode step's single row sees
    every key, and its [B, 1, 1, S] mask broadcasts over the rows). torch's sdpa is called directly because
    transformers' wrapper expects h query heads of one row."""
    batch, d, h_kv, dv = q.shape[0], q.shape[-1], k.shape[1], v.shape[-1]
    q_BKbRD = q.reshape(batch, 2, h_kv, -1, d).transpose(1, 2)  # [B, h_kv, branch, n_rep, d]
    padded = q.new_zeros(*q_BKbRD.shape[:-1], 2, d)  # [B, h_kv, branch, n_rep, half, d]
    padded.diagonal(dim1=2, dim2=-2).copy_(q_BKbRD.movedim(2, -1))  # branch b's query in half b: [q1, 0], [0, q2]
    padded = padded.view(batch, h_kv, -1, 2 * d)  # [B, h_kv, 2 n_rep, 2d], rows ordered (branch, n_rep)
    out = F.scaled_dot_product_attention(padded, k, v, attn_mask=attention_mask, scale=scaling)  # [B, h_kv, 2n_rep, dv]
    out = out.float().view(batch, h_kv, 2, -1, dv)  # [B, h_kv, branch, n_rep, dv]
    return torch.addcmul(out[:, :, 0], out[:, :, 1], lam, value=-1).view(batch, 1, -1, dv), None


def tiled_kernel(module, q, k, v, lam, attention_mask, scaling, **kwargs):
    """Both branches of a tile of query rows in one softmax and one product with V (`tiled_diff_attention`)."""
    return tiled_diff_attention(q, k, v, lam, scaling, attention_mask, group=noise_group(module)), None


def diff_flash_kernel(module, q, k, v, lam, attention_mask, scaling, **kwargs):
    """The one-pass Triton kernel: both softmaxes once per tile, V read once (`diff_flash_attention`)."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(f"{DIFF_FLASH} expects transformers' boolean sdpa mask, got {attention_mask.dtype}")
    k, v = drop_unfilled_keys(q, k, v, attention_mask)
    return diff_flash_attention(q, k, v, lam, scaling=scaling, causal=True, mask=attention_mask).float(), None


# The differential kernels. Each takes (module, q, k, v, lam, attention_mask, scaling, **kwargs) in the packed
# layout (kernel_common.py) and returns (out [B, T, h, dv] fp32, the differential map or None); `select_kernel` picks
# one.
DIFF_KERNELS: dict[str, Callable] = {
    "eager": eager_diff_attention,  # the spec; the only one that returns the map
    "sdpa_decode_step": sdpa_decode_step,  # T = 1: both branches in one torch sdpa call
    "tiled": tiled_kernel,  # CPU, T > 128: Llama's FLOPs instead of two calls' 2x
    "standard_calls": standard_attention_calls,  # the user's sdpa / flash / flex kernel, twice
    DIFF_FLASH: diff_flash_kernel,  # Triton, one pass for both branches
}

# The kernels that take grouped noise heads' queries (GDA) as they are: they compute each noise head's map once for
# its group (`tiled` without gradients; with them it repeats the queries itself); the others get `expand_noise`'s.
GROUPED_KERNELS = ("eager", "standard_calls", "tiled")


def select_kernel(implementation: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The differential kernel that runs for `attn_implementation` on these inputs. Traced code (torch.compile,
    torch.export, ONNX) always makes the standard calls: a choice by length would become a shape guard. Head dims
    or a GPU that `diff_flash` has no tile for (in the inputs' dtype), or whose launch failed for lack of shared
    memory, make the standard calls too, with a warning; its decode steps (T = 1, untraced) take sdpa's kernel."""
    if implementation == PAGED_EAGER:  # transformers' eager on continuous batching's paged cache
        implementation = "eager"
    if implementation == DIFF_FLASH and q.shape[2] == 1 and not is_torchdynamo_compiling():
        implementation = "sdpa"  # a decode step: one query row leaves the fused kernel's tiles idle (RESULTS.md)
    if implementation == DIFF_FLASH:
        reason = unfit_reason(q.shape[-1], v.shape[-1], q.dtype, q.device)
        if reason:
            warn_unfit(reason)
            return "standard_calls"
        if q.dtype == torch.float32 and q.device.type == "cuda" and not is_torchdynamo_compiling():
            warnings.warn(f"{DIFF_FLASH} multiplies fp32 inputs as TF32 on a GPU (a 10-bit mantissa, as torch does "
                          "with allow_tf32=True): for exact fp32 use attn_implementation='sdpa', or run in bf16",
                          stacklevel=3)
    if implementation in ("eager", DIFF_FLASH):
        return implementation
    if implementation != "sdpa" or is_torchdynamo_compiling():
        return "standard_calls"
    if q.shape[2] == 1 and v.shape[-1] == k.shape[-1]:
        return "sdpa_decode_step"
    if q.shape[2] == 1 or (q.device.type == "cpu" and tiled_is_faster(q)):
        return "tiled"
    return "standard_calls"


def diff_attention(module, q, k, v, lam, attention_mask, scaling, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The differential heads of a V1 layer under its model's backend: `select_kernel`'s kernel, called."""
    name = select_kernel(module.config._attn_implementation, q, k, v)
    return run_selected(name, module, q, k, v, lam, attention_mask, scaling, **kwargs)


def warn_unfit(reason: str) -> None:
    """The warning of layers that make the standard calls where `diff_flash` was asked for; one text per reason, so
    Python shows it once."""
    warnings.warn(f"{DIFF_FLASH} cannot run {reason}; these layers make two standard attention calls instead",
                  stacklevel=3)


def run_selected(name: str, module, q, k, v, lam, attention_mask, scaling, **kwargs):
    """`run_kernel`; where a `diff_flash` launch finds that its tile does not fit this GPU (TileDoesNotFit: a GPU or
    Triton release the ahead-of-time fit check did not cover), the standard calls instead, with a warning, and
    `select_kernel` routes later calls there."""
    try:
        return run_kernel(name, module, q, k, v, lam, attention_mask, scaling, **kwargs)
    except TileDoesNotFit as error:
        warn_unfit(str(error))
        return run_kernel("standard_calls", module, q, k, v, lam, attention_mask, scaling, **kwargs)


def run_kernel(name: str, module, q, k, v, lam, attention_mask, scaling, **kwargs):
    """`DIFF_KERNELS[name]` on a layer's inputs. With grouped noise heads (GDA), a kernel that takes one noise query
    per head gets each noise query repeated over its group at call time (`expand_noise`: exact, no parameters
    added); `GROUPED_KERNELS` take them as they are."""
    if name not in GROUPED_KERNELS:
        q = expand_noise(q, noise_group(module))
    return DIFF_KERNELS[name](module, q, k, v, lam, attention_mask, scaling, **kwargs)


@autocast_off
def eager_v2_attention(module, q, k, v, gate, attention_mask, scaling):
    """DIFF V2 with materialised maps: softmax of the 2h heads in fp32, head pair (2j, 2j+1) differenced with the
    per-token gate, A_2j - gate_j A_2j+1, times the pair's V. Returns (out [B, T, h, d] fp32, map [B, h, T, S])."""
    batch, _, length, _ = q.shape
    k = repeat_kv(k, q.shape[1] // k.shape[1])  # [B, 2h, S, d]
    v = repeat_kv(v, q.shape[1] // 2 // v.shape[1])  # [B, h, S, d]: a pair shares its kv head
    scores = masked_scores(q, k, attention_mask, scaling)  # [B, 2h, T, S]
    pairs = torch.softmax(scores, dim=-1).view(batch, -1, 2, length, k.shape[-2])  # [B, h, pair, T, S]
    diff_map = pairs[:, :, 0] - gate.transpose(1, 2)[..., None] * pairs[:, :, 1]  # [B, h, T, S]
    return torch.matmul(diff_map, v.float()).transpose(1, 2), diff_map.to(q.dtype)


@contextmanager
def capture_branch_attentions(model: torch.nn.Module) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """Collect (A1 [B, h, T, S], A2, lambda) of every differential layer, in layer order, during forwards of `model`
    inside the block. Only `eager` materialises the maps.

    The maps are released when the caller drops the yielded list; nothing is held between calls otherwise.
    """
    differential = any(isinstance(module, DiffLambda) for module in model.modules())
    if differential and model.config._attn_implementation != "eager":
        raise ValueError(
            f"capture_branch_attentions needs the eager attention maps, but the model runs "
            f"'{model.config._attn_implementation}': load it with attn_implementation=\"eager\" or call "
            "model.set_attn_implementation(\"eager\") first"
        )
    maps: list = []
    token = BRANCH_MAPS.set(maps)
    try:
        yield maps
    finally:
        BRANCH_MAPS.reset(token)


def diff_flash_standard_attention(module: torch.nn.Module, *args, **kwargs):
    """What `diff_flash` runs in layers without V1 differential attention (DIFF V2, standard layers of a hybrid
    stack): sdpa. Registered under our name (registration.py) so that transformers accepts
    `attn_implementation="diff_flash"`; any other model that asks for it gets this error instead of a silent
    substitute."""
    if getattr(getattr(module, "config", None), "model_type", None) != DiffConfig.model_type:
        raise ValueError(
            f"attn_implementation='{DIFF_FLASH}' is the Differential Transformer's fused kernel and has no "
            f"meaning for {type(module).__name__}; use 'sdpa', 'eager' or another transformers backend"
        )
    return sdpa_attention_forward(module, *args, **kwargs)


def unknown_backend(name: str | None) -> bool:
    """Whether transformers has no attention function called `name`: neither `eager` nor a key of its registry
    (`ALL_ATTENTION_FUNCTIONS`, ours included), with or without the `paged|` prefix, nor a Hub kernel's repository
    name (`org/repo`, which transformers fetches and judges)."""
    known = {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
    return name is not None and "/" not in name and name.removeprefix("paged|") not in known


class DiffFlashBackend:
    """A model class's backend check, which accepts `diff_flash` where Triton can run it and names it beside
    transformers' own backends when a name is unknown."""

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, *args, **kwargs) -> str:
        if attn_implementation == DIFF_FLASH:
            ok, reason = triton_available()
            if not ok:
                raise ValueError(f"attn_implementation='{DIFF_FLASH}' is unavailable: {reason}")
            return attn_implementation
        try:
            return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)
        except ValueError as error:
            if not unknown_backend(attn_implementation):  # a backend transformers knows, refused for its own reason
                raise
            # transformers' error lists its own backends, which lack ours
            raise ValueError(f"{error} The DIFF Transformer adds `attn_implementation=\"{DIFF_FLASH}\"` (its fused "
                             "Triton kernel).") from None
