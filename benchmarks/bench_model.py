"""Side-by-side model benchmark: DiffForCausalLM (sdpa, eager, DIFF V2) vs transformers'
DiffLlamaForCausalLM and LlamaForCausalLM at equal parameter count. Reports training tokens/s, greedy decode
tokens/s and peak memory as ratios measured in one run. Each model lives in its own worker process (as in a
user's training run: no allocator state shared with the other models) and reports its peak memory after the
warm-up; timings are interleaved (round-robin over the workers, the order rotated every round, one worker running
at a time) so machine noise and position effects hit all alike.

    python benchmarks/bench_model.py                   # hidden 512, 6 layers, seq 1024, batch 2 (the default setting)
    python benchmarks/bench_model.py --quick           # smaller, for a smoke run
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from diff_transformer import DiffConfig, DiffForCausalLM  # noqa: E402

MODELS = ["diff-sdpa", "diff-eager", "diff-v2-sdpa", "diffllama-sdpa", "llama-sdpa"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# DIFF's throughput over Llama's at equal parameters that docs/kernels.md aims for (the paper: 0.88-0.91x in training)
TARGETS = {"train": 0.95, "decode": 0.97}


def build(name: str, args: argparse.Namespace) -> torch.nn.Module:
    common = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, max_position_embeddings=args.seq + args.new_tokens + 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    heads = args.hidden // 64
    torch.manual_seed(0)
    if name == "diff-v2-sdpa":  # DIFF V2: 2h query heads of d, h = hidden / d, so k/v/o match Llama's shapes
        config = DiffConfig(num_attention_heads=heads, head_dim=64, diff_version=2, **common)
        model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
    elif name.startswith("diff-"):
        config = DiffConfig(num_attention_heads=heads // 2, **common)  # h = hidden / (2d), d = 64
        model = DiffForCausalLM._from_config(config, attn_implementation=name.split("-")[1])
    elif name.startswith("diffllama"):
        config = DiffLlamaConfig(num_attention_heads=heads, head_dim=64, **common)
        model = DiffLlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    else:
        config = LlamaConfig(num_attention_heads=heads, **common)
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.to(args.device, DTYPES[args.dtype])


def train_step_time(model, optimizer, batch) -> float:
    start = time.perf_counter()
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(batch.device)
    return time.perf_counter() - start


def decode_time(model, prompt, new_tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    synchronize(prompt.device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Worker:
    """One model in its own process, driven over a pipe, so that no model's allocations shape the heap another
    model runs on, as in a user's training process (benchmarks/HISTORY.md). The parent asks for one timing at a
    time, so workers never overlap."""

    def __init__(self, name: str):
        argv = [sys.executable, __file__, *sys.argv[1:], "--worker", name]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self.process.stdout.readline())  # params and peak memory, after the warm-up

    def time(self, what: str) -> float:
        self.process.stdin.write(what + "\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def serve(args: argparse.Namespace) -> None:
    """The worker side: warm up (one training step, one short generation), report parameters and peak memory, then
    answer "train" / "decode" with one timing each until stdin closes."""
    baseline = resident_peak_mib()  # interpreter + torch + transformers
    torch.manual_seed(0)  # the same batch and prompt in every worker
    batch = torch.randint(3, args.vocab, (args.batch, args.seq), device=args.device)
    prompt = torch.randint(3, args.vocab, (1, args.prompt_len), device=args.device)
    model = build(args.worker, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step_time(model.train(), optimizer, batch)
    decode_time(model.eval(), prompt, 8)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else resident_peak_mib() - baseline
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "peak_mib": peak}), flush=True)
    timings = {"train": lambda: train_step_time(model.train(), optimizer, batch),
               "decode": lambda: decode_time(model.eval(), prompt, args.new_tokens)}
    for line in sys.stdin:
        print(timings[line.strip()](), flush=True)


def measure(args: argparse.Namespace) -> dict:
    """Timings interleaved round-robin over the workers, the order rotated every round."""
    workers = {name: Worker(name) for name in args.models}
    train, decode = {n: [] for n in workers}, {n: [] for n in workers}
    names = list(workers)
    for round_ in range(args.repeats):
        order = names[round_ % len(names):] + names[: round_ % len(names)]  # rotate: no model always goes first
        for name in order:
            train[name].append(workers[name].time("train"))
        for name in order:
            decode[name].append(workers[name].time("decode"))
    for worker in workers.values():
        worker.close()
    return {
        n: dict(params=w.info["params"], peak_mib=w.info["peak_mib"],
                train_tok_s=args.batch * args.seq / statistics.median(train[n]),
                decode_tok_s=args.new_tokens / statistics.median(decode[n]),
                train_ratios=paired_ratios(train[n], train.get("diff-sdpa")),
                decode_ratios=paired_ratios(decode[n], decode.get("diff-sdpa")),
                # the row's throughput over Llama's, round by round
                train_vs_llama=paired_ratios(train["llama-sdpa"], train[n]) if "llama-sdpa" in train else [],
                decode_vs_llama=paired_ratios(decode["llama-sdpa"], decode[n]) if "llama-sdpa" in decode else [])
        for n, w in workers.items()
    }


def paired_ratios(times: list[float], base_times: list[float] | None) -> list[float]:
    """DIFF-sdpa's speed over the row's, round by round (time of the row / time of DIFF-sdpa in the same round):
    a slow spell of the machine then hits both sides of a ratio instead of shifting one model's median."""
    return [t / b for t, b in zip(times, base_times)] if base_times else []


def resident_peak_mib() -> float:
    """The process's resident-set high-water mark. Not ru_maxrss: Linux carries that across execve, so a child
    would start with its parent's peak; VmHWM belongs to the new address space."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status: peak CPU memory needs Linux")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=[*MODELS, "diff-diff_flash"],
                        help="diff-diff_flash (the fused Triton kernel) needs a CUDA GPU (or TRITON_INTERPRET=1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="weights, activations and optimizer state (default: bf16 on CUDA, else fp32)")
    parser.add_argument("--quick", action="store_true", help="hidden 256, 2 layers, seq 256, 2 repeats")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.intermediate, args.seq, args.repeats, args.new_tokens = 256, 2, 688, 256, 2, 32
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def ratio_cell(ratios: list[float]) -> str:
    """Median of the per-round ratios, with their range."""
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def report(results: dict, args: argparse.Namespace) -> str:
    lines = [
        f"hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch {args.batch}, decode {args.new_tokens} "
        f"tokens after a {args.prompt_len}-token prompt, device {args.device}, {args.dtype}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}",
        "",
        "| model | params (M) | train tok/s | decode tok/s | peak MiB (over import baseline) "
        "| DIFF-sdpa / row, train (range) | DIFF-sdpa / row, decode (range) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['params'] / 1e6:.2f} | {r['train_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
            f"{r['peak_mib']:.0f} | {ratio_cell(r['train_ratios'])} | "
            f"{ratio_cell(r['decode_ratios'])} |"
        )
    lines.append("")
    lines.append(
        "Ratios are DIFF-sdpa throughput divided by the row's throughput (>1: DIFF-sdpa is faster): the median over "
        "rounds of the ratio within each round, with the range over rounds; tok/s are medians over rounds."
    )
    for name, r in results.items():
        if name.startswith("diff-") and r["train_vs_llama"]:
            lines.append(f"target: {name} at {ratio_cell(r['train_vs_llama'])} Llama's training tokens/s "
                         f"(target {TARGETS['train']} or more), {ratio_cell(r['decode_vs_llama'])} its decode "
                         f"tokens/s (target {TARGETS['decode']} or more)")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:
        serve(args)
        return
    print(report(measure(args), args))


if __name__ == "__main__":
    main()
