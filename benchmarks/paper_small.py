"""Small-scale reproduction of the Differential Transformer paper (Ye et al., arXiv 2410.05258): a tiny DIFF model
versus a Llama baseline of (almost) equal parameter count, same data, steps and LR schedule, over several seeds.

Tasks: a synthetic multi-needle retrieval task (needles "The magic number of <city> is <number>." in filler text,
trained as language modelling) and, when the file exists, tiny Shakespeare. Reported as markdown, whatever it shows:
validation loss, needle accuracy (greedy) and attention to answer / noise (paper Table 3) on retrieval prompts.

    python benchmarks/paper_small.py --quick                   # 2 seeds, 250 steps (run time: RESULTS.md)
    python benchmarks/paper_small.py --steps 20 --seeds 0 ...  # smoke test
"""

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup, set_seed

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.data import text_file_dataset
from diff_transformer.evaluation import (
    CITIES,
    FILLER,
    NeedleSettings,
    attention_noise,
    build_needle_prompt,
    needle,
    needle_accuracy,
)
from diff_transformer.tokenization_diff import train_bpe_tokenizer

QUICK = dict(seeds=[0, 1], steps=250, hidden=96, layers=3, examples=2000, eval_samples=8, context=128, block=160)


def model_pair(vocab: int, args: argparse.Namespace) -> dict:
    """DIFF with h heads (q/k sub-heads d = hidden/2h, value 2d) vs Llama with 2h heads of dim d: same projections."""
    shared = dict(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 16 * 16,
                  num_hidden_layers=args.layers, max_position_embeddings=1024, tie_word_embeddings=True)
    diff = DiffConfig(**shared, num_attention_heads=args.heads)
    llama = LlamaConfig(**shared, num_attention_heads=2 * args.heads, head_dim=args.hidden // (2 * args.heads))
    return {"DIFF": DiffForCausalLM._from_config(diff, attn_implementation="sdpa"),
            "Transformer": LlamaForCausalLM._from_config(llama, attn_implementation="sdpa")}


def needle_texts(tokenizer, count: int, length: int, seed: int) -> list[str]:
    settings = NeedleSettings(needles=4, queries=1)
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        prompt = build_needle_prompt(tokenizer, length, rng.choice([0, 25, 50, 75, 100]), settings, rng)
        texts.append(f"{prompt.question(0)} {prompt.answers[0][1]}.")
    return texts


def blocks(tokenizer, texts: list[str], block: int) -> torch.Tensor:
    ids = [tokenizer(t)["input_ids"][:block] for t in texts]
    ids = [row + [tokenizer.pad_token_id] * (block - len(row)) for row in ids]
    return torch.tensor(ids)


def retrieval_data(args: argparse.Namespace):
    seed_texts = list(FILLER) * 20 + [needle(c, str(1000 + i)) for i, c in enumerate(CITIES)] * 5
    seed_texts += [f"What is the magic number of {c}? The magic number of {c} is" for c in CITIES]
    tokenizer = train_bpe_tokenizer(texts=seed_texts, vocab_size=512)
    train = blocks(tokenizer, needle_texts(tokenizer, args.examples, args.context, seed=1), args.block)
    val = blocks(tokenizer, needle_texts(tokenizer, 64, args.context, seed=2), args.block)
    return tokenizer, train, val


def text_data(path: Path, args: argparse.Namespace):
    tokenizer = train_bpe_tokenizer(files=[path], vocab_size=1024)
    ids = torch.stack([block["input_ids"] for block in text_file_dataset(path, tokenizer, args.block)])
    split = int(0.9 * len(ids))
    return tokenizer, ids[:split], ids[split:]


def labels_for(batch: torch.Tensor, pad_id: int) -> torch.Tensor:
    return batch.masked_fill(batch == pad_id, -100)


def train(model, data: torch.Tensor, pad_id: int, args: argparse.Namespace, seed: int) -> None:
    """AdamW + cosine schedule with warm-up; the batch order depends on the seed only, so both models see it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, args.steps // 10), args.steps)
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(args.steps):
        batch = data[torch.randint(len(data), (args.batch,), generator=order)]
        model(batch, labels=labels_for(batch, pad_id)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    model.eval()


def validation_loss(model, data: torch.Tensor, pad_id: int) -> float:
    with torch.no_grad():
        losses = [model(chunk, labels=labels_for(chunk, pad_id)).loss.item() for chunk in data[:256].split(32)]
    return sum(losses) / len(losses)


def retrieval_metrics(model, tokenizer, args: argparse.Namespace) -> dict:
    settings = NeedleSettings(lengths=[args.context], depths=[0, 50, 100], needles=4, queries=1,
                              samples=args.eval_samples, seed=7)
    accuracy = statistics.mean(needle_accuracy(model, tokenizer, settings).values())
    model.set_attn_implementation("eager")
    rng = random.Random(11)
    prompts = [build_needle_prompt(tokenizer, args.context, 50, settings, rng) for _ in range(args.eval_samples)]
    reports = [attention_noise(model, tokenizer, p) for p in prompts]
    model.set_attn_implementation("sdpa")
    return {"accuracy": accuracy, "answer": statistics.mean(r["mean_answer"] for r in reports),
            "noise": statistics.mean(r["mean_noise"] for r in reports)}


def run_task(name: str, tokenizer, train_data, val_data, args: argparse.Namespace) -> list[dict]:
    rows = []
    for seed in args.seeds:
        set_seed(seed)
        for label, model in model_pair(len(tokenizer), args).items():
            start = time.monotonic()
            train(model, train_data, tokenizer.pad_token_id, args, seed)
            row = {"task": name, "model": label, "seed": seed, "params": model.num_parameters(),
                   "val_loss": validation_loss(model, val_data, tokenizer.pad_token_id)}
            if name == "retrieval":
                row.update(retrieval_metrics(model, tokenizer, args))
            print(f"{name} {label} seed {seed}: {row} ({time.monotonic() - start:.0f}s)", flush=True)
            rows.append(row)
    return rows


def summarize(rows: list[dict]) -> str:
    """Markdown: mean ± std over seeds per (task, model)."""
    header = "| task | model | params | val loss | needle acc | attn to answer | attn noise |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["task"], r["model"]) for r in rows):
        group = [r for r in rows if (r["task"], r["model"]) == key]

        def cell(field: str) -> str:
            values = [r[field] for r in group if field in r]
            if not values:
                return "-"
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.mean(values):.3f} ± {spread:.3f}"

        cells = [cell(f) for f in ("val_loss", "accuracy", "answer", "noise")]
        lines.append(f"| {key[0]} | {key[1]} | {group[0]['params'] / 1e6:.3f}M | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/tinyshakespeare.txt"))
    parser.add_argument("--quick", action="store_true", help=f"the short configuration: {QUICK}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2, help="DIFF heads h; the baseline has 2h")
    parser.add_argument("--context", type=int, default=192, help="retrieval context length (tokens)")
    parser.add_argument("--block", type=int, default=256, help="training sequence length")
    parser.add_argument("--examples", type=int, default=4000, help="synthetic retrieval training sequences")
    parser.add_argument("--eval-samples", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/paper_small.md"))
    if parser.parse_known_args(argv)[0].quick:  # explicit flags still override the quick defaults
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run_task("retrieval", *retrieval_data(args), args)
    if args.data.is_file():
        rows += run_task("tinyshakespeare", *text_data(args.data, args), args)
    else:
        print(f"skipping tiny Shakespeare: {args.data} not found")
    settings = {k: v for k, v in vars(args).items() if k not in ("data", "output")}
    report = f"# DIFF vs Transformer, small scale\n\nsettings: {settings}\n\n{summarize(rows)}\n"
    args.output.write_text(report)
    print(report)
    return report


if __name__ == "__main__":
    main()
