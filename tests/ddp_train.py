"""Fine-tune a tiny DiffForCausalLM with Trainer; run under torchrun or accelerate launch for data parallelism
(gloo on CPU, NCCL on GPUs).

    torchrun --nproc_per_node 2 tests/ddp_train.py OUT_DIR PER_DEVICE_BATCH
    accelerate launch --config_file configs/accelerate_cpu_ddp.yaml tests/ddp_train.py OUT_DIR PER_DEVICE_BATCH

Rank 0 prints the number of processes and writes it with the logged loss per step to OUT_DIR/losses.json
(`{"processes": N, "losses": {step: loss}}`). Used by tests/test_accelerate.py.
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.data import KeyValueTask, task_dataset

GLOBAL_BATCH = 4
STEPS = 6


def train(output_dir: str, per_device_batch: int) -> dict[int, float]:
    torch.set_num_threads(1)
    task = KeyValueTask(num_keys=16, num_values=16, num_pairs=4)
    tokenizer = task.tokenizer()
    config = DiffConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=per_device_batch, learning_rate=3e-3,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ and not torch.cuda.is_available() else None,
        train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=task_dataset(task, tokenizer, count=64, seed=0))
    trainer.train()
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


def main() -> None:
    output_dir, per_device_batch = sys.argv[1], int(sys.argv[2])
    losses = train(output_dir, per_device_batch)
    rank, processes = 0, 1
    if torch.distributed.is_initialized():
        # Tear gloo down explicitly: left to interpreter exit, its threads sometimes abort the process (SIGABRT).
        rank, processes = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.distributed.destroy_process_group()
    if rank == 0:
        print(f"{processes} process(es) x batch {per_device_batch} = global batch {processes * per_device_batch}")
        Path(output_dir, "losses.json").write_text(json.dumps({"processes": processes, "losses": losses}))


if __name__ == "__main__":
    main()
