"""`diff-transformer` command line: train a tiny DIFF model (arXiv 2410.05258), generate from a saved one."""

import argparse
import random
import time

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    pipeline,
    set_seed,
)

from . import DiffConfig, DiffForCausalLM
from .data import KeyValueTask, TokenBlocks, retrieval_accuracy, task_dataset, text_file_dataset
from .tokenization_diff import CHAT_TEMPLATE, CHAT_TOKENS, train_bpe_tokenizer


class TimeLimit(TrainerCallback):
    """An optional wall-clock cap on top of the step budget; says so loudly when it cuts training short, since the
    result then depends on the machine's speed and load."""

    def __init__(self, minutes: float):
        self.minutes = minutes
        self.deadline = time.monotonic() + 60 * minutes

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() > self.deadline and state.global_step < state.max_steps:
            control.should_training_stop = True
            print(f"WARNING: --minutes {self.minutes:g} stopped training at step {state.global_step} of "
                  f"{state.max_steps}; the model may be undertrained (drop --minutes to train all steps)")


def tiny_config(tokenizer, args: argparse.Namespace) -> DiffConfig:
    return DiffConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 8 / 3) // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=max(args.block_size, 256),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )


def build_data(args: argparse.Namespace):
    if args.data is None:
        task = KeyValueTask(num_keys=args.keys, num_values=args.keys, num_pairs=args.pairs)
        tokenizer = task.tokenizer(chat=args.chat_template)
        return task, tokenizer, task_dataset(task, tokenizer, args.examples, seed=args.seed)
    chat = {"chat_template": CHAT_TEMPLATE, "extra_special_tokens": CHAT_TOKENS} if args.chat_template else {}
    tokenizer = train_bpe_tokenizer(files=[args.data], vocab_size=args.vocab_size, **chat)
    return None, tokenizer, text_file_dataset(args.data, tokenizer, args.block_size)


def training_generation_config(tokenizer, dataset: TokenBlocks) -> GenerationConfig:
    """Generation defaults as the model was trained: its special tokens, and at most as many tokens (prompt included)
    as its longest training sequence."""
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_length=max(len(block) for block in dataset.blocks),
    )


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(f"training on {args.threads} CPU thread(s) (--threads)")
    set_seed(args.seed)
    task, tokenizer, dataset = build_data(args)
    model = DiffForCausalLM._from_config(tiny_config(tokenizer, args), attn_implementation=args.attn_implementation)
    print(f"DiffForCausalLM: {model.num_parameters() / 1e6:.2f}M parameters, {len(dataset)} training sequences")
    training_args = TrainingArguments(
        output_dir=args.output,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(100, args.max_steps // 10),
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        bf16=args.bf16,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    callbacks = [] if args.minutes is None else [TimeLimit(args.minutes)]
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=callbacks)
    trainer.train()
    model.generation_config = training_generation_config(tokenizer, dataset)
    tokenizer.model_max_length = model.config.max_position_embeddings
    trainer.save_model(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"saved to {args.output}")
    reloaded = AutoModelForCausalLM.from_pretrained(args.output).eval()
    print(f"reloaded through AutoModelForCausalLM: {type(reloaded).__name__}")
    if task is not None:
        print(f"retrieval accuracy on held-out prompts: {retrieval_accuracy(reloaded, tokenizer, task):.3f}")
        prompt, answer = task.example(random.Random(args.seed + 1))
        args.prompt = args.prompt or prompt
        print(f"expected answer: {answer}")
    generate_text(args.output, args.prompt or "ROMEO:", args.max_new_tokens, sample=False)


def generate_text(model_dir: str, prompt: str, max_new_tokens: int, sample: bool) -> str:
    """Continue `prompt`; a folder whose tokenizer has a chat template gets it as a user turn and answers with the
    assistant's reply."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generator = pipeline("text-generation", model=model_dir, tokenizer=tokenizer)
    generator.model.generation_config.max_length = None  # the folder's default length; this call sets max_new_tokens
    chat = tokenizer.chat_template is not None
    inputs = [{"role": "user", "content": prompt}] if chat else prompt
    # explicit: transformers 5.17's pipeline cleans up spaces by default ("k9 ? ?" -> "k9??"), newer ones do not
    outputs = generator(inputs, max_new_tokens=max_new_tokens, do_sample=sample, return_full_text=True,
                        clean_up_tokenization_spaces=False)
    text = outputs[0]["generated_text"][-1]["content"] if chat else outputs[0]["generated_text"]
    print(f"generated: {text}")
    return text


def add_train_parser(commands) -> None:
    parser = commands.add_parser("train", help="train a tiny model (default: synthetic key/value retrieval)")
    parser.add_argument("--data", help="a UTF-8 text file; omitted: the built-in synthetic retrieval task")
    parser.add_argument("--output", default="runs/diff-tiny", help="folder for the model and tokenizer")
    parser.add_argument("--max-steps", type=int, default=10000, help="training budget in optimizer steps")
    parser.add_argument("--minutes", type=float, help="optional wall-clock cap; warns when it stops training early")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads; a tiny model trains fastest on one, and more oversubscribe a busy machine")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="differential heads h (head_dim = hidden / 2h)")
    parser.add_argument("--block-size", type=int, default=128, help="sequence length for text files")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary for text files")
    parser.add_argument("--examples", type=int, default=100_000, help="synthetic training sequences")
    parser.add_argument("--pairs", type=int, default=KeyValueTask.num_pairs, help="key/value pairs per sequence")
    parser.add_argument("--keys", type=int, default=KeyValueTask.num_keys, help="distinct keys (and values)")
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template", action="store_true",
                        help="save the built-in chat template (<|user|>...</s><|assistant|>...</s>) with the "
                             "tokenizer; the built-in task then trains on chat turns")
    parser.add_argument("--prompt", help="prompt for the closing generation")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.set_defaults(func=train)


def add_generate_parser(commands) -> None:
    parser = commands.add_parser("generate", help="generate from a saved model folder with pipeline()")
    parser.add_argument("model", help="saved model folder (model + tokenizer)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.set_defaults(func=lambda a: generate_text(a.model, a.prompt, a.max_new_tokens, a.sample))


def parse_layers(text: str) -> list[int]:
    """'1-11' or '1,3,5' (0-based, ranges inclusive) -> layer indices."""
    layers = []
    for part in text.split(","):
        start, _, end = part.partition("-")
        layers.extend(range(int(start), int(end or start) + 1))
    return layers


def run_convert(args: argparse.Namespace) -> None:
    from .convert import added_parameters, convert_checkpoint

    options = {} if args.layers is None else {"layers": parse_layers(args.layers)}
    if args.allow_sliding_window:
        options["allow_sliding_window"] = True
    model = convert_checkpoint(args.src, args.out, dtype=args.dtype, **options)
    print(f"saved {type(model).__name__} to {args.out}: attention_types={model.config.attention_types}, "
          f"{added_parameters(model) / 1e6:.3f}M parameters added")


def add_convert_parser(commands) -> None:
    parser = commands.add_parser("convert", help="convert a Llama/Mistral/Qwen2 or DiffLlama checkpoint")
    parser.add_argument("src", help="source folder or Hub id")
    parser.add_argument("out", help="output folder (model, generation config, tokenizer files)")
    parser.add_argument("--layers", help="layers to make differential, e.g. '1-11' or '2,4' (default: all)")
    parser.add_argument("--allow-sliding-window", action="store_true",
                        help="convert a sliding-window model anyway (outputs match only within the window)")
    parser.add_argument("--dtype", default="auto", help="dtype to load and save in (default: the checkpoint's)")
    parser.set_defaults(func=run_convert)


def run_eval_needle(args: argparse.Namespace) -> None:
    from .evaluation import NeedleSettings, run_needle_cli

    settings = NeedleSettings(lengths=args.lengths, depths=args.depths, needles=args.needles,
                              queries=args.queries, samples=args.samples, seed=args.seed)
    run_needle_cli(args.model, settings, args.output)


def add_eval_needle_parser(commands) -> None:
    parser = commands.add_parser("eval-needle", help="multi-needle retrieval accuracy per (length, depth)")
    parser.add_argument("model", help="saved model folder with its tokenizer")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="context lengths (tokens)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0, 25, 50, 75, 100], help="answer depths (%%)")
    parser.add_argument("--needles", type=int, default=6, help="needles N in the context")
    parser.add_argument("--queries", type=int, default=2, help="query cities R (at the answer depth)")
    parser.add_argument("--samples", type=int, default=5, help="prompts per (length, depth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="needle", help="output prefix: PREFIX.md and PREFIX.png")
    parser.set_defaults(func=run_eval_needle)


def run_attention_noise(args: argparse.Namespace) -> None:
    from .evaluation import run_attention_noise_cli

    run_attention_noise_cli(args.model, args.baseline, args.length, args.needles, args.seed, args.output)


def add_attention_noise_parser(commands) -> None:
    parser = commands.add_parser("attention-noise", help="attention to the answer span vs the rest (paper Table 3)")
    parser.add_argument("model", help="saved model folder with its tokenizer")
    parser.add_argument("--baseline", help="saved baseline (e.g. LlamaForCausalLM) using the same tokenizer")
    parser.add_argument("--length", type=int, default=1024, help="context length (tokens)")
    parser.add_argument("--needles", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="attention_noise", help="output prefix: PREFIX.md and PREFIX.png")
    parser.set_defaults(func=run_attention_noise)


def run_outliers(args: argparse.Namespace) -> None:
    from .evaluation import run_outliers_cli

    run_outliers_cli(args.model, args.baseline, args.length, args.top_k, args.seed)


def add_outliers_parser(commands) -> None:
    parser = commands.add_parser("outliers", help="top-k activation magnitudes vs the median (paper Table 5)")
    parser.add_argument("model", help="saved model folder with its tokenizer")
    parser.add_argument("--baseline", help="saved baseline model using the same tokenizer")
    parser.add_argument("--length", type=int, default=512, help="tokens of the probe text")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run_outliers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="diff-transformer", description=__doc__)
    commands = parser.add_subparsers(required=True, dest="command")
    add_train_parser(commands)
    add_generate_parser(commands)
    add_convert_parser(commands)
    add_eval_needle_parser(commands)
    add_attention_noise_parser(commands)
    add_outliers_parser(commands)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
