"""Tensor parallelism that keeps each differential head on one rank (`tp_plan="auto"`).

Two parallel styles (`PARALLEL_STYLES`), registered with transformers by registration.py under the names the plans of
`configuration_diff.py` use:

- `diff_colwise`: a V1 differential layer's `q_proj` and `k_proj` rows are [branch-1 sub-heads | branch-2 sub-heads],
  and transformers' `colwise` would give rank 0 of 2 every branch-1 row and rank 1 every branch-2 row, so no rank could
  form A1 - lambda A2. Projections marked `BRANCH_HALVES` shard each half separately, the layout of transformers'
  `packed_colwise` with two parts, bias included: rank r of n holds the r-th n-th of both halves, both branches of
  heads [r h / n, (r + 1) h / n). Unmarked projections (the standard layers of a hybrid stack) shard as `colwise`, so
  one rule serves every layer of a stack (transformers matches plan rules on `layers.*`, never one layer).
  Servers that shard by contiguous blocks of rows (vLLM's column-parallel layers) load such a projection reordered
  by `branch_halves_rank_major`, which gives rank r the same rows.
- `diff_replicated`: whole parameters on every rank whose gradients are summed over the ranks: lambda's vectors and
  SubLN's gain only see this rank's heads.
"""

import torch
from torch import nn

BRANCH_HALVES = "branch_halves"  # set on a Linear whose output rows are [branch-1 | branch-2]
DIFF_COLWISE = "diff_colwise"
DIFF_REPLICATED = "diff_replicated"
PARALLEL_STYLES: dict = {}  # name -> style, registered with transformers by registration.py (empty without distributed)


def branch_halves_rank_major(rows: torch.Tensor, ranks: int, first: int | None = None) -> torch.Tensor:
    """A `BRANCH_HALVES` weight or bias, rows [branch 1 | branch 2], reordered rank-major: block r holds rank r's
    slice of branch 1's rows, then its slice of branch 2's, the rows `diff_colwise` gives rank r. `first`: branch 1's
    row count when the branches differ in size (grouped noise heads); default half. One rank: unchanged."""
    first = rows.shape[0] // 2 if first is None else first
    branches = [part.chunk(ranks) for part in rows.split([first, rows.shape[0] - first])]  # [branch][rank]
    return torch.cat([branches[b][r] for r in range(ranks) for b in (0, 1)])


def check_tp_size(config, tp_size: int) -> None:
    """Every rank must hold whole heads and whole GQA groups: `tp_size` has to divide `num_key_value_heads` (which
    divides `num_attention_heads`). Otherwise a rank would get part of a head's rows and fail in a reshape. Grouped
    noise heads (GDA) are refused: `diff_colwise` splits q_proj's two halves alike, and a GDA layer's differ."""
    noise, heads = getattr(config, "num_noise_heads", None), config.num_attention_heads
    if tp_size > 1 and noise not in (None, heads):
        raise ValueError(
            f"tensor parallelism does not shard grouped noise heads (num_noise_heads={noise} < num_attention_heads="
            f"{heads}) yet; run one process, or convert the checkpoint with --expand-noise-heads (plain DIFF)"
        )
    if config.num_key_value_heads % tp_size:
        raise ValueError(
            f"tensor parallelism over {tp_size} processes needs {tp_size} to divide num_key_value_heads "
            f"({config.num_key_value_heads}): each process holds whole differential heads with their kv heads; "
            f"run a number of processes that divides {config.num_key_value_heads}"
        )


if torch.distributed.is_available():
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

    class DiffColwiseParallel(TensorParallelLayer):
        """`packed_colwise` with two parts for projections marked `BRANCH_HALVES`, weight and bias alike (transformers'
        own style shards a 1-D bias contiguously, which would split the branches again); `colwise` for the others."""

        def __init__(self):
            self.halves = ALL_PARALLEL_STYLES["packed_colwise"]
            self.colwise = ALL_PARALLEL_STYLES["colwise"]

        def style(self, module: nn.Module) -> TensorParallelLayer:
            return self.halves if getattr(module, BRANCH_HALVES, False) else self.colwise

        def validate_param(self, module, param, mesh, parameter_name=None):
            self.style(module).validate_param(module, param, mesh, parameter_name=parameter_name)

        def shard_param(self, module, param, mesh):
            meta = module._parameters.get(param)
            if self.style(module) is self.colwise or meta is None:
                return self.colwise.shard_param(module, param, mesh)
            module._parameters[param] = nn.Parameter(
                distribute_tensor(meta, mesh, [_StridedShard(dim=0, split_factor=2)], src_data_rank=None),
                requires_grad=meta.requires_grad,
            )

        def install_forward(self, module, mesh):
            return self.style(module).install_forward(module, mesh)

    class DiffReplicatedParallel(TensorParallelLayer):
        """Sums each backward's gradient of the module's own parameters over the ranks, before it accumulates into
        `.grad` (so gradient accumulation adds whole gradients).

        The hooks go on at the first forward with gradients, since loading replaces the parameters after the plan is
        applied. Not transformers' `replicated_with_grad_allreduce`, which (depending on the release) either hooks the
        module's backward, which never runs for `DiffLambda` (a forward without inputs), or all-reduces the
        accumulated `.grad`, which counts earlier micro-batches again."""

        def install_forward(self, module, mesh):
            forward, group, hooked = module.forward, mesh.get_group(), {}

            def summed(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                torch.distributed.all_reduce(grad, group=group)
                return grad

            def tp_forward(*args, **kwargs):
                if torch.is_grad_enabled():
                    for name, param in module.named_parameters(recurse=False):
                        if param.requires_grad and hooked.get(name) is not param:
                            param.register_hook(summed)
                            hooked[name] = param
                return forward(*args, **kwargs)

            module.forward = tp_forward
            return module

    PARALLEL_STYLES.update({DIFF_COLWISE: DiffColwiseParallel(), DIFF_REPLICATED: DiffReplicatedParallel()})
