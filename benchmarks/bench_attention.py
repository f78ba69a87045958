"""One attention layer's core (after the projections) per backend: forward and forward+backward time, peak memory.

Reference: standard (non-differential) attention with the same FLOPs, Llama sdpa over 2h heads of dim d.
Ratios in the table are time / reference time. Examples:

    python benchmarks/bench_attention.py --quick                      # smoke run, seq 256
    python benchmarks/bench_attention.py --seqs 1024 2048 4096        # CPU
    python benchmarks/bench_attention.py --seqs 1024 2048 4096 8192 16384 --dtype bf16   # GPU
"""

import argparse
import importlib.util
import shlex
import sys
import time
from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from diff_transformer import DiffConfig
from diff_transformer.attention_kernels import DIFF_FLASH, DIFF_KERNELS, diff_attention, triton_available

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Layer:
    """What the attention functions read from their module: config, head counts, is_causal, training."""

    def __init__(self, config: DiffConfig, implementation: str, kv_groups: int):
        self.config = DiffConfig(**{**config.to_dict(), "attn_implementation": implementation})
        self.config._attn_implementation = implementation
        self.num_key_value_groups = kv_groups
        self.is_causal = True
        self.training = True


def diff_inputs(config: DiffConfig, batch: int, seq: int, dtype: torch.dtype):
    h, h_kv, d, dv = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.value_head_dim
    q = torch.randn(batch, 2 * h, seq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, h_kv, seq, 2 * d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, h_kv, seq, dv, device=DEVICE, dtype=dtype, requires_grad=True)
    lam = torch.tensor(0.5, device=DEVICE, requires_grad=True)
    return q, k, v, lam


def v1_case(config: DiffConfig, implementation: str, attend: Callable, batch: int, seq: int, dtype: torch.dtype):
    h, d = config.num_attention_heads, config.head_dim
    module = Layer(config, implementation, h // config.num_key_value_heads)
    q, k, v, lam = diff_inputs(config, batch, seq, dtype)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=DEVICE).tril()[None, None]
    mask = causal if implementation == "eager" else None

    def run():
        return attend(module, q, k, v, lam, mask, d**-0.5)[0]

    return run, (q, k, v, lam)


def standard_case(config: DiffConfig, implementation: str, batch: int, seq: int, dtype: torch.dtype, heads: int,
                  kv_heads: int, combine: bool):
    """Llama-style attention over `heads` heads of dim d; `combine` adds the DIFF V2 pair subtraction."""
    d = config.head_dim
    module = Layer(config, implementation, heads // kv_heads)
    q = torch.randn(batch, heads, seq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    gate = torch.rand(batch, seq, heads // 2, device=DEVICE, requires_grad=True)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, sdpa_attention_forward)

    def run():
        out = attend(module, q, k, v, None, dropout=0.0, scaling=d**-0.5)[0]  # [B, T, heads, d]
        if not combine:
            return out
        pairs = out.view(batch, seq, heads // 2, 2, d)
        return pairs[..., 0, :].float() - gate[..., None] * pairs[..., 1, :].float()

    return run, (q, k, v, gate)


def measure(run: Callable, leaves, backward: bool, repeats: int) -> tuple[float, float]:
    """(median seconds, peak MiB above the start; CUDA only, else nan)."""
    def step():
        out = run()
        if backward:
            out.float().sum().backward()
            for leaf in leaves:
                leaf.grad = None
        return out

    step()  # warm-up (compiles Triton / flex kernels)
    times = []
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_mem = torch.cuda.memory_allocated()
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            step()
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - start_mem) / 2**20 if CUDA else float("nan")
    return sorted(times)[len(times) // 2], peak


def cases(config: DiffConfig, batch: int, seq: int, dtype: torch.dtype) -> dict[str, tuple[Callable, object] | str]:
    """name -> (run, leaves) or the reason it is skipped."""
    h, h_kv = config.num_attention_heads, config.num_key_value_heads
    reference = standard_case(config, "sdpa", batch, seq, dtype, 2 * h, 2 * h_kv, False)
    out: dict = {"standard sdpa (2h heads of d)": reference}
    out["eager"] = v1_case(config, "eager", diff_attention, batch, seq, dtype)
    out["sdpa" if CUDA else "sdpa (CPU: tiled kernel)"] = v1_case(config, "sdpa", diff_attention, batch, seq, dtype)
    if not CUDA:
        out["two torch sdpa calls (sdpa's GPU route)"] = v1_case(config, "sdpa", DIFF_KERNELS["standard_calls"],
                                                                 batch, seq, dtype)
    flash_ok = CUDA and importlib.util.find_spec("flash_attn") is not None
    out["flash_attention_2"] = (v1_case(config, "flash_attention_2", diff_attention, batch, seq, dtype)
                                if flash_ok else "needs CUDA and flash-attn")
    out["flex_attention"] = (v1_case(config, "flex_attention", diff_attention, batch, seq, dtype)
                             if CUDA else "needs CUDA (no flex backward on CPU; CPU compile is slow)")
    ok, reason = triton_available()
    out[DIFF_FLASH] = (v1_case(config, DIFF_FLASH, diff_attention, batch, seq, dtype)
                                 if CUDA and ok else reason if CUDA else "needs CUDA")
    out["DIFF V2 (sdpa)"] = standard_case(config, "sdpa", batch, seq, dtype, 2 * h, h_kv, True)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="differential heads h (the reference has 2h)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64, help="q/k sub-head dim d; V is 2d wide")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16" if CUDA else "fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke run: seq 256, tiny heads, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.heads, args.kv_heads, args.head_dim, args.repeats = [256], 2, 2, 16, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    config = DiffConfig(hidden_size=2 * args.heads * args.head_dim, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_hidden_layers=1)
    dtype = DTYPES[args.dtype]
    device = torch.cuda.get_device_name() if CUDA else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\ndevice: {device}; dtype {args.dtype}; batch {args.batch}; h={args.heads} h_kv={args.kv_heads} "
          f"d={args.head_dim}; median of {args.repeats}\n")
    print("| seq | backend | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio | peak MiB (fwd+bwd) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for seq in args.seqs:
        reference = None
        for name, case in cases(config, args.batch, seq, dtype).items():
            if isinstance(case, str):
                print(f"| {seq} | {name} | skipped: {case} | | | | |")
                continue
            run, leaves = case
            fwd, _ = measure(run, leaves, backward=False, repeats=args.repeats)
            both, peak = measure(run, leaves, backward=True, repeats=args.repeats)
            reference = reference or (fwd, both)
            print(f"| {seq} | {name} | {fwd * 1e3:.2f} | {fwd / reference[0]:.2f} | {both * 1e3:.2f} | "
                  f"{both / reference[1]:.2f} | {'n/a (CPU)' if peak != peak else f'{peak:.1f}'} |", flush=True)


if __name__ == "__main__":
    main()
