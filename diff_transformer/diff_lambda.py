"""The re-parameterised lambda of a differential attention layer (Ye et al., "Differential Transformer", arXiv
2410.05258, eq. (1)), and `frozen_lambdas`, which computes it once per `generate` call instead of once per forward.

    lambda = exp(<lq1, lk1>) - exp(<lq2, lk2>) + lambda_init
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .kernel_common import upcast


def compute_lambda(q1: torch.Tensor, k1: torch.Tensor, q2: torch.Tensor, k2: torch.Tensor, lambda_init: float):
    """Paper eq. (1): lambda = exp(<lq1, lk1>) - exp(<lq2, lk2>) + lambda_init, in fp32 (float64 for float64)."""
    return torch.exp(torch.dot(upcast(q1), upcast(k1))) - torch.exp(torch.dot(upcast(q2), upcast(k2))) + lambda_init


class DiffLambda(nn.Module):
    """The re-parameterised lambda of one layer: four d-sized vectors shared by all heads."""

    def __init__(self, head_dim: int, lambda_init: float, std: float):
        super().__init__()
        self.lambda_init = lambda_init
        self.std = std
        self.q1 = nn.Parameter(torch.zeros(head_dim))
        self.k1 = nn.Parameter(torch.zeros(head_dim))
        self.q2 = nn.Parameter(torch.zeros(head_dim))
        self.k2 = nn.Parameter(torch.zeros(head_dim))
        self.frozen: torch.Tensor | None = None  # set only inside `frozen_lambdas`
        self.frozen_depth = 0  # how many `frozen_lambdas` blocks are open on this module

    def forward(self) -> torch.Tensor:
        if self.frozen is not None:
            return self.frozen
        return compute_lambda(self.q1, self.k1, self.q2, self.k2, self.lambda_init)

    def extra_repr(self) -> str:  # not lambda_init, which differs per layer: print(model) folds like Llama's
        return f"head_dim={self.q1.numel()}"


FREEZE_LOCK = threading.Lock()


@contextmanager
def frozen_lambdas(model: nn.Module) -> Iterator[None]:
    """Compute each layer's lambda once for the block instead of once per layer and forward.

    For `generate`, where the weights are fixed: a batch-1 CPU decode step is bound by per-op overhead, and lambda
    costs 6 ops per layer and step. Not a cache keyed on the parameters: in-place writes through `.data` (DeepSpeed,
    EMA code) leave no trace on them, so only a block that cannot change the weights may skip the recomputation.
    Blocks are counted, not stacked: inner or overlapping blocks (assisted generation; `generate` called from several
    threads) share the first block's values, and the last one to close releases them, whatever the order.
    """
    modules = [m for m in model.modules() if isinstance(m, DiffLambda)]
    with FREEZE_LOCK, torch.no_grad():
        for module in modules:
            if module.frozen_depth == 0:
                module.frozen = module()
            module.frozen_depth += 1
    try:
        yield
    finally:
        with FREEZE_LOCK:
            for module in modules:
                module.frozen_depth -= 1
                if module.frozen_depth == 0:
                    module.frozen = None
