"""Shard a tiny DiffForCausalLM with FSDP2 (`fully_shard`) and train it; run under torchrun (gloo on CPU).

    torchrun --nproc_per_node 2 examples/fsdp_train.py OUT_DIR

Every DiffDecoderLayer is its own FSDP unit and the root holds the rest (embeddings, final norm, lm_head). Each
step trains GLOBAL_BATCH sequences, split evenly over the processes, so any process count sees the same data.
The trained model is saved sharded with torch.distributed.checkpoint to OUT_DIR/checkpoint (one file per process,
plus config.json); `consolidate` turns that into a `from_pretrained` folder. Rank 0 writes OUT_DIR/results.json:
the loss per step, the parameter elements each process holds, and the trained model's logits on the first
EVAL_ROWS sequences. Used by tests/test_training.py.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ddp_train import GLOBAL_BATCH, STEPS, tiny_model_and_data
from results import finish
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.tools.data import TokenBlocks

EVAL_ROWS = 2


def shard(model: DiffForCausalLM) -> None:
    """FSDP2 over all processes (the default mesh): one unit per decoder layer, the root for the other parameters."""
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def rows(dataset: TokenBlocks, start: int, count: int) -> torch.Tensor:
    return torch.stack([dataset[i]["input_ids"] for i in range(start, start + count)])


def train(model: DiffForCausalLM, dataset: TokenBlocks, rank: int = 0, world_size: int = 1) -> list[float]:
    """STEPS AdamW steps; returns the mean loss over the whole global batch per step, whatever world_size is.

    Every sequence has the same length, so the mean of the per-process mean losses (FSDP averages the gradients
    over processes the same way) is the mean over the global batch.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    per_process = GLOBAL_BATCH // world_size
    losses = []
    for step in range(STEPS):
        input_ids = rows(dataset, step * GLOBAL_BATCH + rank * per_process, per_process)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world_size > 1:
            dist.all_reduce(loss)  # gloo has no ReduceOp.AVG
            loss /= world_size
        losses.append(loss.item())
    return losses


def consolidate(checkpoint: str | Path, output_dir: str | Path) -> None:
    """Gather a sharded checkpoint into a `save_pretrained` folder, in one process without a process group."""
    model = DiffForCausalLM(DiffConfig.from_pretrained(checkpoint))
    state_dict = model.state_dict()
    dcp.load(state_dict, checkpoint_id=checkpoint, no_dist=True)  # reads every shard into the full tensors
    model.save_pretrained(output_dir)


def main() -> None:
    output_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, dataset = tiny_model_and_data()
    shard(model)
    losses = train(model, dataset, rank, world_size)
    with torch.no_grad():
        logits = model(rows(dataset, 0, EVAL_ROWS)).logits
    dcp.save(get_model_state_dict(model), checkpoint_id=output_dir / "checkpoint")
    if rank == 0:
        model.config.save_pretrained(output_dir / "checkpoint")
    local = sum(p.to_local().numel() for p in model.parameters())
    shard_sizes = [None] * world_size
    dist.all_gather_object(shard_sizes, local)
    finish(output_dir, {"losses": losses, "shard_numel": shard_sizes, "logits": logits.tolist()})


if __name__ == "__main__":
    main()
