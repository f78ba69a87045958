"""The gradients of the first training step on several processes, for tests/test_training.py:

    torchrun --nproc_per_node 2 tests/workers/grad_worker.py OUT_DIR ddp|fsdp

ddp: examples/ddp_train.py's Trainer setup (DistributedDataParallel, gloo on CPU), one step without gradient
clipping, the gradients read as the optimizer gets them (all-reduced). fsdp: examples/fsdp_train.py's FSDP2 sharding,
one forward and backward of this process's share of the global batch, the sharded gradients gathered whole. Both
train the first ddp_train.GLOBAL_BATCH sequences. Rank 0 saves {name: gradient} to OUT_DIR/grads.pt.
"""

import os
import sys
from pathlib import Path

import ddp_train
import fsdp_train
import torch
import torch.distributed as dist
from results import finish
from transformers import Trainer, TrainerCallback, TrainingArguments


class SaveGradients(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and state.global_step == 0:
            torch.save({name: p.grad.detach().clone() for name, p in model.named_parameters()}, self.path)


def ddp(output_dir: Path) -> int:
    model, dataset = ddp_train.tiny_model_and_data()
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=1, per_device_train_batch_size=ddp_train.GLOBAL_BATCH // 2,
        learning_rate=3e-3, max_grad_norm=0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, ddp_backend="gloo", train_sampling_strategy="sequential", dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[SaveGradients(output_dir / "grads.pt")])
    trainer.train()
    return trainer.args.world_size


def fsdp(output_dir: Path) -> int:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, dataset = ddp_train.tiny_model_and_data()
    fsdp_train.shard(model)
    per_process = ddp_train.GLOBAL_BATCH // world_size
    input_ids = fsdp_train.rows(dataset, rank * per_process, per_process)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}  # a collective: every rank
    if rank == 0:
        torch.save(grads, output_dir / "grads.pt")
    return world_size


def main() -> None:
    output_dir, engine = Path(sys.argv[1]), sys.argv[2]
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    processes = {"ddp": ddp, "fsdp": fsdp}[engine](output_dir)
    finish(output_dir, {"processes": processes, "rank": int(os.environ.get("RANK", 0))})


if __name__ == "__main__":
    main()
