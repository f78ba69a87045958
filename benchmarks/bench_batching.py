"""Throughput of transformers' continuous batching (`init_continuous_batching`, the engine of `generate_batch` and
`transformers serve --continuous-batching`) on a DIFF Transformer (arXiv 2410.05258) V1 model vs the Llama of equal
width, side by side in one run (docs/serving.md).

    python benchmarks/bench_batching.py [--requests 16] [--new-tokens 64] [--prompt-len 32] [--rounds 3]
                                        [--backend sdpa]

Prints a markdown table of generated tokens per second (greedy, fp32; one warm-up round, then the models take turns
over `--rounds` timed rounds) and the DIFF / Llama ratio."""

import argparse
import gc
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from diff_transformer import DiffConfig, DiffForCausalLM


def build_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """A DIFF V1 model (h heads, q/k sub-heads of d, dv = 2d) and the Llama of equal width (2h heads of d)."""
    d = args.hidden // (2 * args.heads)
    shapes = {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "intermediate_size": args.hidden * 8 // 3 // 16 * 16, "max_position_embeddings": 512,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    torch.manual_seed(0)
    diff = DiffForCausalLM._from_config(DiffConfig(num_attention_heads=args.heads, head_dim=d, **shapes),
                                        attn_implementation=args.backend)
    llama = LlamaForCausalLM._from_config(
        LlamaConfig(num_attention_heads=2 * args.heads, num_key_value_heads=2 * args.heads, head_dim=d, **shapes),
        attn_implementation=args.backend)
    return {"DIFF": diff.eval(), "Llama": llama.eval()}


def run_round(manager, prompts: list[list[int]], new_tokens: int) -> int:
    """Submit every prompt, wait for every request to finish; the number of generated tokens."""
    pending = set(manager.add_requests(inputs=prompts, max_new_tokens=new_tokens))
    generated = 0
    while pending:
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError("no result within 60 s")
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            generated += len(result.generated_tokens)
    return generated


def start_manager(model, args: argparse.Namespace):
    """A started batching manager whose paged cache is bounded (`num_blocks`), not sized to the free memory."""
    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(num_blocks=4 * args.requests, max_batch_tokens=args.max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.start()
    return manager


@torch.no_grad()
def rates(models: dict[str, torch.nn.Module], prompts: list[list[int]], args: argparse.Namespace) -> dict[str, list]:
    """Generated tokens per second of each model per round; the models take turns round by round (after one
    warm-up round each), so a busy machine slows both alike."""
    managers = {name: start_manager(model, args) for name, model in models.items()}
    measured = {name: [] for name in models}
    try:
        for manager in managers.values():
            run_round(manager, prompts, args.new_tokens)  # warm-up
        for _ in range(args.rounds):
            for name, manager in managers.items():
                start = time.perf_counter()
                generated = run_round(manager, prompts, args.new_tokens)
                measured[name].append(generated / (time.perf_counter() - start))
    finally:
        for manager in managers.values():
            manager.stop(block=True)
        gc.collect()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="DIFF heads h (the Llama has 2h)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--backend", default="sdpa", choices=["sdpa", "paged|eager"])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per model, taken in turns")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.requests, args.prompt_len), generator=generator).tolist()
    measured = rates(build_models(args), prompts, args)
    best = {name: max(values) for name, values in measured.items()}
    median = {name: sorted(values)[len(values) // 2] for name, values in measured.items()}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args}")
    print("| model | generated tok/s, best round | median round |\n|---|---|---|")
    print("\n".join(f"| {name} | {best[name]:.0f} | {median[name]:.0f} |" for name in measured))
    print(f"| DIFF / Llama | {best['DIFF'] / best['Llama']:.2f}x | {median['DIFF'] / median['Llama']:.2f}x |")


if __name__ == "__main__":
    main()
