"""PolyNorm (arXiv 2411.03884), the MLP activation of `hidden_act="poly_norm"` (Motif-2's differential-attention
models), and the MLP of a Differential Transformer layer (arXiv 2410.05258): Llama's gated MLP with either
activation."""

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

from .config_checks import unvalidated_copy
from .configuration_diff import POLY_NORM, DiffConfig
from .kernel_common import upcast

POLY_NORM_EPS = 1e-6  # PolyNorm's epsilon in Motif-2 (and arXiv 2411.03884)


class PolyNorm(nn.Module):
    """`weight[0] N(z^3) + weight[1] N(z^2) + weight[2] N(z) + bias`, `N(u) = u / sqrt(mean(u^2) + eps)` over the
    last dim, computed in fp32 (float64 for float64 inputs)."""

    def __init__(self, eps: float = POLY_NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((3,), 1 / 3))
        self.bias = nn.Parameter(torch.zeros(1))

    def normalized(self, u: torch.Tensor) -> torch.Tensor:
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = upcast(x)
        w = self.weight.to(z.dtype)
        out = w[0] * self.normalized(z**3) + w[1] * self.normalized(z**2) + w[2] * self.normalized(z)
        return (out + self.bias.to(z.dtype)).to(x.dtype)


def build_mlp(config: DiffConfig) -> LlamaMLP:
    """Llama's gated MLP, `down(act(gate x) * up x)`; with `hidden_act="poly_norm"` its activation is `PolyNorm`."""
    if config.hidden_act != POLY_NORM:
        return LlamaMLP(config)
    mlp = LlamaMLP(unvalidated_copy(config, hidden_act="silu"))  # PolyNorm replaces silu below
    mlp.config, mlp.act_fn = config, PolyNorm()
    return mlp
