"""One attention layer's core (after the projections) per backend: forward and forward+backward time, peak memory.

Reference: standard (non-differential) attention with the same FLOPs, Llama sdpa over 2h heads of dim d.
Ratios in the table are time / reference time. `--decode` adds a table of one decode step (one query row against
`seq` cached keys, forward only); `--profile` the profiler's costliest operations of one forward+backward of
diff_flash (the tiled kernel on a CPU), the two-call path and the reference at the last length. On a GPU the lines
after the tables set diff_flash against its targets (docs/kernels.md). Examples:

    python benchmarks/bench_attention.py --quick                      # smoke run, seq 256
    python benchmarks/bench_attention.py --seqs 1024 2048 4096        # CPU
    python benchmarks/bench_attention.py --seqs 1024 2048 4096 8192 16384 --dtype bf16 --decode   # GPU
    TRITON_INTERPRET=1 python benchmarks/bench_attention.py --quick --decode --profile   # CPU rehearsal of diff_flash
"""

import argparse
import importlib.util
import os
import shlex
import sys
import time
from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from diff_transformer import DiffConfig
from diff_transformer.attention_kernels import (DIFF_FLASH, DIFF_KERNELS, diff_attention, select_kernel,
                                                triton_available)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # diff_flash runs on the CPU, slowly: a rehearsal
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Layer:
    """What the attention functions read from their module: config, head counts, is_causal, training."""

    def __init__(self, config: DiffConfig, implementation: str, kv_groups: int):
        self.config = DiffConfig(**{**config.to_dict(), "attn_implementation": implementation})
        self.config._attn_implementation = implementation
        self.num_key_value_groups = kv_groups
        self.is_causal = True
        self.training = True


def diff_inputs(config: DiffConfig, batch: int, seq: int, dtype: torch.dtype, queries: int | None = None):
    """q [B, 2h, T, d], k [B, h_kv, S, 2d], v [B, h_kv, S, dv], lambda; T = `queries` (default S = `seq`)."""
    h, h_kv, d, dv = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.value_head_dim
    q = torch.randn(batch, 2 * h, queries or seq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, h_kv, seq, 2 * d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, h_kv, seq, dv, device=DEVICE, dtype=dtype, requires_grad=True)
    lam = torch.tensor(0.5, device=DEVICE, requires_grad=True)
    return q, k, v, lam


def v1_case(config: DiffConfig, implementation: str, attend: Callable, batch: int, seq: int, dtype: torch.dtype,
            decode: bool = False):
    """A V1 layer's core; `decode`: one query row against `seq` keys (it sees them all: no mask)."""
    h, d = config.num_attention_heads, config.head_dim
    module = Layer(config, implementation, h // config.num_key_value_heads)
    q, k, v, lam = diff_inputs(config, batch, seq, dtype, 1 if decode else None)
    eager_prefill = implementation == "eager" and not decode  # the other kernels mask causally by themselves
    mask = torch.ones(seq, seq, dtype=torch.bool, device=DEVICE).tril()[None, None] if eager_prefill else None

    def run():
        return attend(module, q, k, v, lam, mask, d**-0.5)[0]

    return run, (q, k, v, lam)


def standard_case(config: DiffConfig, implementation: str, batch: int, seq: int, dtype: torch.dtype, heads: int,
                  kv_heads: int, combine: bool, decode: bool = False):
    """Llama-style attention over `heads` heads of dim d; `combine` adds the DIFF V2 pair subtraction."""
    d, queries = config.head_dim, 1 if decode else seq
    module = Layer(config, implementation, heads // kv_heads)
    q = torch.randn(batch, heads, queries, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    gate = torch.rand(batch, queries, heads // 2, device=DEVICE, requires_grad=True)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, sdpa_attention_forward)

    def run():
        out = attend(module, q, k, v, None, dropout=0.0, scaling=d**-0.5)[0]  # [B, T, heads, d]
        if not combine:
            return out
        pairs = out.view(batch, queries, heads // 2, 2, d)
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


REFERENCE = "standard sdpa (2h heads of d)"
TWO_CALLS = "two torch sdpa calls"  # DiffLlama's route, and sdpa's on a GPU for T > 1
ROUTES = {"tiled": "tiled kernel", "sdpa_decode_step": "one-call decode step", "standard_calls": TWO_CALLS}
OPTIONAL = {"eager": "eager", "flex_attention": "flex_attention", "flash_attention_2": "flash_attention_2",
            "v2": "DIFF V2 (sdpa)"}  # --skip NAME: the rows a run may leave out
# diff_flash's targets (docs/kernels.md): forward+backward speed over the two-call path at seq >= 4096, and time
# over standard attention's, forward+backward and for a decode step
TARGETS = {"over_two_calls": 1.5, "over_standard": 1.3, "decode_over_standard": 1.1}


def cases(config: DiffConfig, batch: int, seq: int, dtype: torch.dtype, decode: bool = False,
          skip: frozenset[str] = frozenset()) -> dict[str, tuple[Callable, object] | str]:
    """name -> (run, leaves) or the reason it is skipped, the rows a target reads first (a run stopped at a time
    limit has printed them); `decode`: one query row against `seq` keys; no inputs are made for the rows of
    `skip` (OPTIONAL's keys)."""
    h, h_kv = config.num_attention_heads, config.num_key_value_heads

    def v1(implementation: str, attend: Callable = diff_attention):
        return v1_case(config, implementation, attend, batch, seq, dtype, decode)

    out: dict = {REFERENCE: standard_case(config, "sdpa", batch, seq, dtype, 2 * h, 2 * h_kv, False, decode)}
    sdpa = v1("sdpa")
    route = select_kernel("sdpa", *sdpa[1][:3])
    label = ROUTES[route] + (", DiffLlama's route" if route == "standard_calls" else "")
    out[f"sdpa ({label})"] = sdpa
    if route != "standard_calls":
        out[f"{TWO_CALLS} (DiffLlama's route)"] = v1("sdpa", DIFF_KERNELS["standard_calls"])
    ok, reason = triton_available()
    out[DIFF_FLASH] = (v1(DIFF_FLASH) if (CUDA or INTERPRET) and ok
                       else reason if CUDA else "needs CUDA (or TRITON_INTERPRET=1, a rehearsal)")
    flash_ok = CUDA and importlib.util.find_spec("flash_attn") is not None
    optional = {
        "flash_attention_2": lambda: v1("flash_attention_2") if flash_ok else "needs CUDA and flash-attn",
        "flex_attention": lambda: (v1("flex_attention") if CUDA
                                   else "needs CUDA (no flex backward on CPU; CPU compile is slow)"),
        "eager": lambda: v1("eager"),
        "v2": lambda: standard_case(config, "sdpa", batch, seq, dtype, 2 * h, h_kv, True, decode),
    }
    out.update({OPTIONAL[name]: make() for name, make in optional.items() if name not in skip})
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
    parser.add_argument("--decode", action="store_true", help="also time one decode step against seq cached keys")
    parser.add_argument("--skip", nargs="+", choices=list(OPTIONAL), default=[],
                        help="rows to leave out (flex_attention compiles for each length: tens of seconds on a GPU)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the profiler's costliest operations of one forward+backward per kernel")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.heads, args.kv_heads, args.head_dim, args.repeats = [256], 2, 2, 16, 1
    return args


def timings(config: DiffConfig, args: argparse.Namespace, decode: bool) -> dict[int, dict[str, tuple]]:
    """Print one table; {seq: {backend: (forward s, forward+backward s or None)}} of what ran."""
    dtype = DTYPES[args.dtype]
    if decode:
        print("\none decode step: 1 query row against seq cached keys, forward only\n")
        print("| seq (cached keys) | backend | step ms | ratio |")
        print("|---:|---|---:|---:|")
    else:
        print("| seq | backend | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio | peak MiB (fwd+bwd) |")
        print("|---:|---|---:|---:|---:|---:|---:|")
    found: dict[int, dict[str, tuple]] = {}
    for seq in args.seqs:
        reference, found[seq] = None, {}
        for name, case in cases(config, args.batch, seq, dtype, decode, frozenset(args.skip)).items():
            if isinstance(case, str):
                print(f"| {seq} | {name} | skipped: {case} | |{'' if decode else ' | | |'}")
                continue
            run, leaves = case
            fwd, _ = measure(run, leaves, backward=False, repeats=args.repeats)
            if decode:
                found[seq][name] = (fwd, None)
                reference = reference or fwd
                print(f"| {seq} | {name} | {fwd * 1e3:.3f} | {fwd / reference:.2f} |", flush=True)
                continue
            both, peak = measure(run, leaves, backward=True, repeats=args.repeats)
            found[seq][name] = (fwd, both)
            reference = reference or (fwd, both)
            print(f"| {seq} | {name} | {fwd * 1e3:.2f} | {fwd / reference[0]:.2f} | {both * 1e3:.2f} | "
                  f"{both / reference[1]:.2f} | {'n/a (CPU)' if peak != peak else f'{peak:.1f}'} |", flush=True)
    return found


def target_lines(prefill: dict[int, dict[str, tuple]], decode: dict[int, dict[str, tuple]]) -> list[str]:
    """diff_flash against the targets of docs/kernels.md, from the measured rows: forward+backward at least 1.5x
    faster than the two-call path and within 1.3x of standard attention; a decode step within 1.1x of it."""
    lines = []
    for seq, rows in prefill.items():
        two_calls = next((times for name, times in rows.items() if TWO_CALLS in name), None)
        if DIFF_FLASH in rows and two_calls:
            flash, reference = rows[DIFF_FLASH][1], rows[REFERENCE][1]
            lines.append(f"seq {seq} fwd+bwd: diff_flash at {two_calls[1] / flash:.2f}x the two-call path's speed "
                         f"(target {TARGETS['over_two_calls']} at seq >= 4096), {flash / reference:.2f}x standard "
                         f"attention's time (target {TARGETS['over_standard']} or less)")
    for seq, rows in decode.items():
        if DIFF_FLASH in rows:
            lines.append(f"seq {seq} decode step: diff_flash at {rows[DIFF_FLASH][0] / rows[REFERENCE][0]:.2f}x "
                         f"standard attention's time (target {TARGETS['decode_over_standard']} or less)")
    return lines


def profile(config: DiffConfig, args: argparse.Namespace, top: int = 8) -> None:
    """The costliest operations (self time) of one forward+backward per kernel at the last length."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    seq, sort = args.seqs[-1], "self_device_time_total" if CUDA else "self_cpu_time_total"
    for name, case in cases(config, args.batch, seq, DTYPES[args.dtype], skip=frozenset(OPTIONAL)).items():
        if isinstance(case, str):
            continue
        run, leaves = case
        measure(run, leaves, backward=True, repeats=1)  # compiled and warm
        with profiler(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if CUDA else [])]) as trace:
            run().float().sum().backward()
            if CUDA:
                torch.cuda.synchronize()
        print(f"\nprofile of one forward+backward: {name}, seq {seq}\n")
        print(trace.key_averages().table(sort_by=sort, row_limit=top))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    config = DiffConfig(hidden_size=2 * args.heads * args.head_dim, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_hidden_layers=1)
    device = torch.cuda.get_device_name() if CUDA else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\ndevice: {device}{'; TRITON_INTERPRET=1 (a rehearsal)' if INTERPRET and not CUDA else ''}; "
          f"dtype {args.dtype}; batch {args.batch}; h={args.heads} h_kv={args.kv_heads} d={args.head_dim}; "
          f"median of {args.repeats}\n")
    prefill = timings(config, args, decode=False)
    decode = timings(config, args, decode=True) if args.decode else {}
    lines = target_lines(prefill, decode)
    if lines:
        print("\ntargets:\n" + "\n".join(lines))
    if args.profile:
        profile(config, args)


if __name__ == "__main__":
    main()
