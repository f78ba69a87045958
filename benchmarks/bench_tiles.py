"""diff_flash's shipped tiles against their fit-checked alternatives, timed on this GPU (causal, bf16 by default).

The tile table (diff_transformer/kernel_tiles.py) was picked by a fit rule, not by time. For each head-dim pair and
each of the three kernels (forward, dQ, dK/dV), this times the shipped tile and the next `--alternatives` tiles in
the rule's order among the recorded candidates that qualify on this GPU's target family (benchmarks/kernel_fit.json,
`kernel_fit.ranked`), every other kernel keeping its shipped tile: the forward's tiles by the forward pass, the
backward kernels' by forward + backward. Ratio = time / the shipped tile's time: under 1 is faster than shipped.

    python benchmarks/bench_tiles.py                                        # a GPU: d = 64 and 128, seq 4096
    TRITON_INTERPRET=1 python benchmarks/bench_tiles.py --target 90 --seq 64 --repeats 1    # rehearsal on a CPU
"""

import argparse
import contextlib
import shlex
import sys
from collections.abc import Iterator

import torch

import bench_attention as bench  # the layout, inputs and timing of the attention benchmark
import kernel_fit
from diff_transformer import DiffConfig
import diff_transformer.kernel_diff_flash as kernels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[16, 32, 64, 128])
    parser.add_argument("--value-dim-ratio", type=int, default=2, choices=[1, 2], help="dv = ratio x d (default 2d)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads-x-dim", type=int, default=512, help="h x d: 8 heads at d = 64, 4 at d = 128")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--alternatives", type=int, default=2, help="tiles timed after the shipped one, per kernel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", type=int, choices=sorted(kernels.SHARED_MEMORY),
                        help="under TRITON_INTERPRET=1: the compute capability whose tiles run (a rehearsal)")
    return parser.parse_args(argv)


def where_it_runs(args: argparse.Namespace) -> str:
    """Why these arguments cannot run on this machine ("" when they can)."""
    if not (bench.CUDA or bench.INTERPRET):
        return "needs a CUDA GPU, or TRITON_INTERPRET=1 with --target for a rehearsal on the CPU"
    if not bench.CUDA and args.target is None:
        return "under TRITON_INTERPRET=1 give --target (e.g. --target 90): the tiles of which GPU to run"
    return ""


@contextlib.contextmanager
def tile_in_place(key: tuple, tile: tuple) -> Iterator[None]:
    """The table's unmasked tile of `key` replaced by `tile` for the block (the padding-mask tile kept)."""
    shipped = kernels.TILES[key]
    kernels.TILES[key] = (tile, shipped[1])
    try:
        yield
    finally:
        kernels.TILES[key] = shipped


def family_of(target: int) -> int:
    return kernels.TARGET_TILES[target]


def contenders(lookups: dict, key: tuple, shipped: tuple, alternatives: int) -> list[tuple]:
    """The shipped tile, then the next `alternatives` qualifying tiles in the rule's order."""
    ranked = kernel_fit.ranked(lookups.get(key, {}), key[0], key[4])
    return [shipped, *[tile for tile in ranked if tile != shipped][:alternatives]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := where_it_runs(args):
        print(f"bench_tiles: {problem}", file=sys.stderr)
        return 2
    print("command:", shlex.join([sys.executable, *sys.argv]))
    if bench.CUDA:
        target = kernels.device_target(torch.cuda.current_device())
        if target is None:
            print(f"{torch.cuda.get_device_name()}: diff_flash has tiles for compute capability 8.0 or newer only")
            return 2
        where = torch.cuda.get_device_name()
    else:
        target, where = args.target, "CPU under TRITON_INTERPRET=1 (a rehearsal: times mean nothing)"
        kernels.INTERPRETER_TARGET = target
    family, name = family_of(target), args.dtype  # the tile table keys each dtype apart
    lookups = kernel_fit.candidates_by_lookup(kernel_fit.rows_to_pick(kernel_fit.read_record()))
    dtype = bench.DTYPES[args.dtype]
    print(f"\ndevice: {where}; tiles of sm_{family}; {args.dtype}; batch {args.batch}; seq {args.seq}; causal; "
          f"median of {args.repeats}\n")
    print("| d | dv | kernel | tile (BLOCK_M, BLOCK_N, warps, stages) | timed | ms | ratio to shipped |")
    print("|---:|---:|---|---|---|---:|---:|")
    faster = []
    for d in args.head_dims:
        dv, heads = args.value_dim_ratio * d, max(1, args.heads_x_dim // d)
        config = DiffConfig(hidden_size=2 * heads * d, num_attention_heads=heads, num_key_value_heads=heads,
                            head_dim=d, value_head_dim=dv, num_hidden_layers=1)
        for kernel in kernels.KERNELS:
            key = (family, name, d, dv, kernel)
            if key not in kernels.TILES:
                print(f"| {d} | {dv} | {kernel} | no shipped tile | | | |")
                continue
            backward = kernel != "fwd"
            reference = None
            for rank, tile in enumerate(contenders(lookups, key, kernels.TILES[key][0], args.alternatives)):
                with tile_in_place(key, tile):
                    run, leaves = bench.v1_case(config, bench.DIFF_FLASH, bench.diff_attention, args.batch, args.seq,
                                                dtype)
                    seconds, _ = bench.measure(run, leaves, backward=backward, repeats=args.repeats)
                reference = reference or seconds
                if seconds < 0.95 * reference:
                    faster.append(f"d={d} dv={dv} {kernel}: {tile} at {seconds / reference:.2f}x the shipped time")
                print(f"| {d} | {dv} | {kernel} | {tile}{'' if rank else ' shipped'} | "
                      f"{'fwd+bwd' if backward else 'fwd'} | {seconds * 1e3:.3f} | {seconds / reference:.2f} |",
                      flush=True)
    print("\nfaster than shipped by 5% or more: " + ("; ".join(faster) if faster else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
