"""Fine-tune a tiny DiffForCausalLM with Trainer; run under torchrun or accelerate launch for data parallelism
(gloo on CPU, NCCL on GPUs).

    torchrun --nproc_per_node 2 examples/ddp_train.py OUT_DIR PER_DEVICE_BATCH [DEEPSPEED_CONFIG]
    accelerate launch --config_file configs/accelerate_cpu_ddp.yaml examples/ddp_train.py OUT_DIR PER_DEVICE_BATCH

With a DeepSpeed config (configs/deepspeed_zero3.json) `Trainer` runs DeepSpeed ZeRO instead of plain DDP.
Rank 0 prints the number of processes and writes what `train` returns to OUT_DIR/results.json. Used by
tests/test_training.py.
"""

import os
import sys

import torch
from results import finish
from transformers import Trainer, TrainingArguments

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.tools.data import KeyValueTask, TokenBlocks, task_dataset

GLOBAL_BATCH = 4
STEPS = 6


def tiny_model_and_data() -> tuple[DiffForCausalLM, TokenBlocks]:
    """The seeded tiny model and the retrieval sequences (all the same length) that the multi-process tests train."""
    torch.set_num_threads(1)
    task = KeyValueTask(num_keys=16, num_values=16, num_pairs=4)
    tokenizer = task.tokenizer()
    config = DiffConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
    return model, task_dataset(task, tokenizer, count=64, seed=0)


def train(output_dir: str, per_device_batch: int, deepspeed: str | None = None) -> dict:
    """{"losses": the logged loss of steps 1..STEPS, "engine": the class that wrapped the model for training,
    "processes": how many processes trained}."""
    model, dataset = tiny_model_and_data()
    args = TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=per_device_batch, learning_rate=3e-3,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ and not torch.cuda.is_available() else None,
        train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True, deepspeed=deepspeed,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    logged = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    return {"losses": [logged[step] for step in range(1, STEPS + 1)], "engine": type(trainer.model_wrapped).__name__,
            "processes": trainer.args.world_size}


def main() -> None:
    output_dir, per_device_batch, *deepspeed = sys.argv[1:]
    results = train(output_dir, int(per_device_batch), *deepspeed)
    if trainer_rank() == 0:
        processes = results["processes"]
        print(f"{processes} process(es) x batch {per_device_batch} = global batch {processes * int(per_device_batch)}")
    finish(output_dir, results)


def trainer_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


if __name__ == "__main__":
    main()
