"""The decoder-layer list of a Differential Transformer (arXiv 2410.05258): a ModuleList that prints each distinct
layer once, with the indices that share it. torch folds only runs of equal neighbours, so a hybrid stack, whose
layer kinds alternate, would print every layer in full."""

from torch import nn
from torch.nn.modules.module import _addindent


def index_span(indices: list[int]) -> str:
    """`0-31` for a run, `0, 2, ..., 30` for a longer arithmetic sequence, else the indices and runs listed."""
    steps = {b - a for a, b in zip(indices, indices[1:])}
    if steps == {1}:
        return f"{indices[0]}-{indices[-1]}"
    if len(steps) == 1 and len(indices) > 3:
        return f"{indices[0]}, {indices[1]}, ..., {indices[-1]}"
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


class DecoderLayers(nn.ModuleList):
    """nn.ModuleList whose repr groups equal layers wherever they are, as `(indices): n x layer`."""

    def __repr__(self) -> str:
        groups: dict[str, list[int]] = {}
        for index, layer in enumerate(self):
            groups.setdefault(repr(layer), []).append(index)
        if not groups:
            return "ModuleList()"
        lines = [
            _addindent(f"({index_span(ids)}): {len(ids)} x {text}" if len(ids) > 1 else f"({ids[0]}): {text}", 2)
            for text, ids in groups.items()
        ]
        return "ModuleList(\n  " + "\n  ".join(lines) + "\n)"
