"""A tiny DiffForCausalLM under Trainer on the built-in key/value task: what the training and saved-folder tests
train."""

import torch
from helpers import tiny_config
from transformers import Trainer, TrainingArguments

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.data import KeyValueTask, task_dataset

TASK = KeyValueTask(num_keys=16, num_values=16, num_pairs=4)


def make_trainer(output_dir, callbacks=(), **overrides) -> Trainer:
    """A Trainer of a tiny DIFF model (sdpa, seed 0) on TASK: 8 steps of 4 on the CPU, no saving; `overrides` replace
    TrainingArguments fields."""
    tokenizer = TASK.tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    torch.manual_seed(0)
    model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
    fields = dict(
        output_dir=str(output_dir), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
        warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    fields.update(overrides)
    dataset = task_dataset(TASK, tokenizer, count=256, seed=0)
    return Trainer(model=model, args=TrainingArguments(**fields), train_dataset=dataset, callbacks=list(callbacks))
