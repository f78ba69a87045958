"""Ahead-of-time compile check of the diff_flash Triton kernels for real NVIDIA targets, without a GPU.

Triton compiles for a named target on any machine (ttir -> ttgir -> ptx -> cubin, with the ptxas in the triton
wheel). For every kernel, target, head dim, dtype and masking mode this compiles the tiles `tile_config` ships and
reads what decides whether the kernel runs and runs fast on that GPU: shared memory per block against the target's
limit, registers and spilled bytes per thread (ptxas), and whether the PTX multiplies with Hopper's wgmma or with
mma.sync. A row fails when no tile ships for it, or the kernel does not compile, needs more shared memory than the
target has, or spills.

    python benchmarks/kernel_fit.py                          # every shipped configuration, markdown table
    python benchmarks/kernel_fit.py --targets 80 --head-dims 128 --tile 64 32 8 3   # try one tile
    python benchmarks/kernel_fit.py --json fit.json          # rows as JSON too (the test suite reads them)

Exit status 1 when a row fails. TRITON_INTERPRET must be unset: interpreted kernels cannot be compiled.
"""

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import diff_transformer.kernel_diff_flash as kernels

TARGETS = (80, 86, 89, 90)
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = ("fp16", "bf16", "fp32")
KERNELS = kernels.KERNELS
# The masking modes each kernel is compiled for: the ones whose compiled code differs. "decode" (T = 1) and "mha"
# (one query head per kv head) differ because Triton specialises integer arguments equal to 1.
MODES = {"fwd": ("causal", "padmask", "decode"), "dq": ("causal", "padmask"), "dkdv": ("causal", "padmask", "mha")}
_FP32_POINTERS = {"Lam", "Lse1", "Lse2", "Delta1", "Delta2"}
_UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_dod"}


@dataclass(frozen=True)
class Variant:
    kernel: str  # "fwd", "dq" or "dkdv"
    target: int  # compute capability, e.g. 90 for sm_90
    head_dim: int  # d
    value_dim: int  # dv
    dtype: str  # "fp16", "bf16" or "fp32"
    mode: str  # "causal", "padmask", "decode" or "mha"
    tile: tuple[int, int, int, int] | None = None  # (BLOCK_M, BLOCK_N, warps, stages); None: what tile_config ships


def signature(fn, variant: Variant) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `fn` as the launcher builds them for typical tensors: 16-byte aligned
    pointers, unit last-dim strides, other strides multiples of 16, T = 1 for decode and N_REP = 1 for MHA."""
    has_mask = variant.mode == "padmask"
    specialised = {name: 1 for name in _UNIT_STRIDES if name in fn.arg_names}
    if has_mask:
        specialised["stride_ms"] = 1
    if variant.mode == "decode":
        specialised["T"] = 1
    if variant.mode == "mha":
        specialised["N_REP"] = 1
    sig, attrs = {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr or name in specialised:
            sig[name] = "constexpr"
        elif name.startswith("stride_"):
            sig[name] = "i32"
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "scaling"):
            sig[name] = "fp32"
        elif name in ("H", "H_KV", "T", "S", "N_REP"):
            sig[name] = "i32"
        else:  # a pointer
            element = "fp32" if name in _FP32_POINTERS else "i1" if name == "Mask" and has_mask else variant.dtype
            sig[name] = f"*{element}"
            attrs[(index,)] = [["tt.divisibility", 16]]
    return sig, specialised, attrs


def compile_variant(variant: Variant) -> dict:
    """Compile one variant for its target; the table row as a dict."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dtype = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[variant.dtype]
    tile = variant.tile or kernels.tile_config(variant.kernel, variant.head_dim, variant.value_dim, dtype,
                                               variant.target, masked=variant.mode == "padmask")
    row = dict(asdict(variant), tile=None, warps=None, stages=None, registers=None, spill_bytes=None, shared=None,
               shared_limit=kernels.SHARED_MEMORY[variant.target], mma=None, error=None)
    if tile is None:
        return dict(row, error="no tile ships for these dims on this target")
    block_m, block_n, warps, stages = tile
    row.update(tile=f"{block_m}x{block_n}", warps=warps, stages=stages)
    fn = getattr(kernels, f"_diff_attn_{'fwd' if variant.kernel == 'fwd' else 'bwd_' + variant.kernel}")
    sig, constexprs, attrs = signature(fn, variant)
    constexprs.update(HEAD_DIM=variant.head_dim, V_DIM=variant.value_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                      CAUSAL=variant.mode != "padmask", HAS_MASK=variant.mode == "padmask")
    options = dict(num_warps=warps, num_stages=stages, **kernels.LAUNCH_OPTIONS)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v: registers and spills; printed only when ptxas runs (no cache hit)
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", variant.target, 32), options=options)
    except Exception as error:  # noqa: BLE001 - every failure to compile is a failed row
        return dict(row, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    ptx = compiled.asm["ptx"]
    wgmma, mma = "wgmma.mma_async" in ptx, "mma.sync" in ptx
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log.getvalue())]
    row.update(registers=int(re.search(r"Used (\d+) registers", log.getvalue()).group(1)), spill_bytes=sum(spills),
               shared=compiled.metadata.shared,
               mma="wgmma + mma.sync" if wgmma and mma else "wgmma" if wgmma else "mma.sync" if mma else "none")
    if row["shared"] > row["shared_limit"]:
        row["error"] = f"needs {row['shared']} B of shared memory, sm_{variant.target} has {row['shared_limit']}"
    elif row["spill_bytes"]:
        row["error"] = f"spills {row['spill_bytes']} B per thread"
    return row


def variants(targets, head_dims, dtypes, value_dims, tile=None) -> list[Variant]:
    """Every (kernel, target, d, dv, dtype, mode); dv in `value_dims` multiples of d ("d" = 1, "2d" = 2)."""
    return [Variant(kernel, target, d, factor * d, dtype, mode, tile)
            for target in targets for d in head_dims for factor in value_dims for dtype in dtypes
            for kernel in KERNELS for mode in MODES[kernel]]


def run(todo: list[Variant], jobs: int) -> list[dict]:
    """Compile every variant in `jobs` processes with a private Triton cache, so ptxas runs and reports."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_fit: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    with tempfile.TemporaryDirectory(prefix="kernel_fit_") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        if jobs == 1:
            return [compile_variant(variant) for variant in todo]
        with ProcessPoolExecutor(jobs) as pool:
            return list(pool.map(compile_variant, todo, chunksize=4))


def table(rows: list[dict]) -> str:
    lines = ["| kernel | target | d/dv | dtype | mode | tile | warps | stages | registers | spill B | shared KiB "
             "(limit) | matmul | result |", "|---|---|---|---|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        shared = "" if r["shared"] is None else f"{r['shared'] / 1024:.0f} ({r['shared_limit'] // 1024})"
        lines.append(f"| {r['kernel']} | sm_{r['target']} | {r['head_dim']}/{r['value_dim']} | {r['dtype']} | "
                     f"{r['mode']} | {r['tile'] or ''} | {r['warps'] or ''} | {r['stages'] or ''} | "
                     f"{r['registers'] or ''} | {'' if r['spill_bytes'] is None else r['spill_bytes']} | {shared} | "
                     f"{r['mma'] or ''} | {r['error'] or 'ok'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS), choices=TARGETS,
                        help="compute capabilities")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS), choices=HEAD_DIMS)
    parser.add_argument("--value-dims", nargs="+", default=["d", "2d"], choices=["d", "2d"])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "fp32"], choices=DTYPES,
                        help="fp16 stands for bf16 too: their figures are identical (see RESULTS.md)")
    parser.add_argument("--tile", type=int, nargs=4, metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
                        help="compile this tile instead of the shipped ones")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    todo = variants(args.targets, args.head_dims, args.dtypes, [{"d": 1, "2d": 2}[v] for v in args.value_dims],
                    tuple(args.tile) if args.tile else None)
    rows = run(todo, args.jobs)
    print("command:", shlex.join(["python", *sys.argv]))
    print(table(rows))
    failed = [r for r in rows if r["error"]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} compiled, fit and do not spill "
          f"({time.perf_counter() - start:.0f} s, {args.jobs} processes)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
