"""diff_flash fits the GPUs people train on, checked without one.

Every tile the kernel ships was compiled ahead of time for sm_80, sm_86, sm_89 and sm_90 (benchmarks/kernel_fit.py
--record, in a process without TRITON_INTERPRET: minutes) into benchmarks/kernel_fit.json, and the tile table is
generated from that record by the rule in its header (`kernel_fit.pick`), which picks among every candidate tile
recorded, failed ones included. Here: the record is of the kernels' current source, a fresh pick from it is the
shipped table, every shipped tile fits in every masking mode in its own dtype (bf16 apart from fp16), a better
candidate that spills or overflows shared memory is never picked, the largest tiles (and bf16's fullest, on sm_80)
compile to the recorded figures, and a combination without a tile is routed to the standard calls with one warning,
its output equal to eager's (tests/test_diff_flash_kernel.py: a dtype without a tile, a launch out of resources).
"""

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BENCHMARKS, assert_close, build_stack, load_benchmark
from helpers.without_package import run_without_package

import diff_transformer.kernel_diff_flash as kernels
from diff_transformer.kernel_tiles import TILES
from diff_transformer.attention_kernels import DIFF_FLASH, select_kernel

SCRIPT = BENCHMARKS / "kernel_fit.py"
kernel_fit = load_benchmark("kernel_fit")


def compile_rows(tmp_path: Path, *options: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    """Rows of `kernel_fit.py *options --json`, compiled in a process without TRITON_INTERPRET."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), *options, "--json", str(tmp_path / "fit.json")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert (tmp_path / "fit.json").exists(), done.stderr[-3000:]
    return json.loads((tmp_path / "fit.json").read_text()), done


def test_the_record_is_of_the_shipped_kernel_source():
    """Every shipped tile's fit is read from the record (`--record` compiles them all: minutes); a record made
    from another kernels source is stale, and the tile table generated from it unproven."""
    assert kernel_fit.read_record()["kernel_sha256"] == kernel_fit.kernel_sha256(), (
        "diff_transformer/kernel_diff_flash.py changed since benchmarks/kernel_fit.json was recorded: "
        "python benchmarks/kernel_fit.py --record --write")


FIGURES = ("tile", "warps", "stages", "registers", "spill_bytes", "shared", "mma", "error")
# The compile check's rows: (kernel_fit.py options, how many (target, dtype) pairs they compile in every kernel, mode)
COMPILE_CHECKS = {
    # the largest head dim (128, values of 2d: the most shared memory and registers), fp16 and fp32, on sm_86 (the
    # least shared memory; sm_89 runs its tiles) and sm_90 (wgmma)
    "largest": (("--targets", "86", "90", "--head-dims", "128", "--value-dims", "2d", "--dtypes", "fp16", "fp32"), 4),
    # bf16 on sm_80 at d = 64, dv = 128: its masked forward (64x128 8w 3s) needs 160 of sm_80's 163 KiB
    "bf16-sm80": (("--targets", "80", "--head-dims", "64", "--value-dims", "2d", "--dtypes", "bf16"), 1),
}


@pytest.mark.skipif(kernels.triton is None, reason="needs triton")
@pytest.mark.parametrize("check", COMPILE_CHECKS)
def test_the_largest_shipped_tiles_compile_as_recorded(tmp_path, check):
    """The record's figures are what the installed Triton makes of the shipped tiles, in every kernel and mode, for
    the rows of COMPILE_CHECKS. Under the record's Triton release every figure is equal; under another one each tile
    must still fit without spilling."""
    options, pairs = COMPILE_CHECKS[check]
    rows, done = compile_rows(tmp_path, *options)
    failed = [row for row in rows if row["error"]]
    assert not failed, "tiles that do not fit:\n" + kernel_fit.table(failed)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(rows) == pairs * sum(len(modes) for modes in kernel_fit.MODES.values())
    record = kernel_fit.read_record()
    if record["triton"] != kernels.triton.__version__:
        return
    recorded = {kernel_fit.row_key(row): row for row in record["rows"]}
    pairs = [(row, recorded.get(kernel_fit.row_key(row), {})) for row in rows]
    differ = [(row, old) for row, old in pairs if any(row[k] != old.get(k) for k in FIGURES)]
    assert not differ, "compiled figures that are not the record's (python benchmarks/kernel_fit.py --record " \
        "--write):\n" + kernel_fit.table([row for row, _ in differ]) + "\nrecorded:\n" + \
        kernel_fit.table([old for _, old in differ if old])


FP64_SCALES = """
import sys
sys.path.insert(0, sys.argv[1])
import kernel_fit
typed = kernel_fit.signature
def with_fp64_scales(fn, variant):
    sig, constexprs, attrs = typed(fn, variant)
    return {name: "fp64" if name in ("qk_scale", "scaling") else kind for name, kind in sig.items()}, constexprs, attrs
kernel_fit.signature = with_fp64_scales
for kernel in kernel_fit.KERNELS:
    for dtype in ("bf16", "fp32"):
        row = kernel_fit.compile_variant(kernel_fit.Variant(kernel, 90, 64, 128, dtype, "causal"))
        print(kernel, dtype, row["error"] or "ok")
"""


@pytest.mark.skipif(kernels.triton is None, reason="needs triton")
def test_the_kernels_compile_with_the_scales_torch_compile_passes(tmp_path):
    """torch.compile (inductor) launches the kernels with the Python-float scales typed fp64, where the launcher's
    are fp32: each kernel casts them to fp32 first, else the forward's fp64 running max makes its accumulator fp64
    and tl.dot refuses it (found on an H200: static-cache generation under diff_flash failed to compile)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a private cache: ptxas runs and reports (`kernel_fit.run`)
    done = subprocess.run([sys.executable, "-c", FP64_SCALES, str(BENCHMARKS)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:-1] == [f"{kernel} {dtype} ok" for kernel in kernel_fit.KERNELS
                                           for dtype in ("bf16", "fp32")], done.stdout


@pytest.mark.skipif(kernels.triton is None, reason="needs triton")
def test_a_tile_that_does_not_fit_fails_the_check():
    """The check itself: the sm_80 tile the kernel once shipped needs more shared memory than sm_86 has."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--targets", "86", "--head-dims", "128", "--value-dims", "2d",
                           "--dtypes", "fp16", "--tile", "64", "32", "8", "3", "--jobs", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "of shared memory, sm_86 has 101376" in done.stdout


def test_tile_table_lookup():
    """Every supported dims and dtype has tiles on every target; sm_89 runs sm_86's; other dims and GPUs have none."""
    for target in kernel_fit.TARGETS:
        for d in kernel_fit.HEAD_DIMS:
            for dv in (d, 2 * d):
                for dtype in (torch.float16, torch.bfloat16, torch.float32):
                    assert all(kernels.tile_config(kernel, d, dv, dtype, target) for kernel in kernel_fit.KERNELS)
    assert kernels.tile_config("fwd", 64, 128, torch.bfloat16, 89) == kernels.tile_config("fwd", 64, 128,
                                                                                          torch.bfloat16, 86)
    assert kernels.tile_config("fwd", 64, 128, torch.bfloat16, 80) == TILES[(80, "bf16", 64, 128, "fwd")][0]
    assert kernels.tile_config("fwd", 64, 256, torch.float16, 90) is None  # dv = 4d
    assert kernels.tile_config("fwd", 96, 192, torch.float16, 90) is None  # d not a power of two
    assert kernels.tile_config("fwd", 64, 128, torch.float16, 75) is None  # no tiles for sm_75


def test_unsupported_head_dims_are_routed_with_a_warning():
    q, k, v = torch.empty(1, 4, 8, 24), torch.empty(1, 1, 8, 48), torch.empty(1, 1, 8, 48)
    with pytest.warns(UserWarning, match="diff_flash cannot run head dims d=24, dv=48.*standard attention calls"):
        assert select_kernel(DIFF_FLASH, q, k, v) == "standard_calls"


@pytest.mark.skipif(not kernels.triton_available()[0], reason="needs triton (a GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("case", ["head-dim-24", "no-tiles-for-sm_75"])
def test_unfit_model_runs_the_standard_calls(case, monkeypatch):
    """A model whose dims or GPU diff_flash has no tile for trains and generates on the standard calls: one warning,
    logits and gradients equal eager's (TOLERANCES["backend"], fp32)."""
    overrides = dict(head_dim=24) if case == "head-dim-24" else {}
    if case == "no-tiles-for-sm_75":
        if torch.cuda.is_available():
            pytest.skip("simulates a GPU through the interpreter's target")
        monkeypatch.setattr(kernels, "INTERPRETER_TARGET", 75)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_stack(DIFF_FLASH, "V1-GQA", **overrides).to(device)
    reference = build_stack("eager", "V1-GQA", **overrides).to(device)
    tokens = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(3)).to(device)
    with pytest.warns(UserWarning, match="diff_flash cannot run") as caught:
        logits = model(tokens).logits
        logits.square().mean().backward()
    assert len({str(w.message) for w in caught}) == 1
    expected = reference(tokens).logits
    expected.square().mean().backward()
    assert_close(logits, expected, torch.float32, f"{case} logits", "backend")
    grad, expected_grad = (m.model.layers[0].self_attn.q_proj.weight.grad for m in (model, reference))
    assert_close(grad, expected_grad, torch.float32, f"{case} dq_proj", "backend")


def _changes(committed: str, generated: str) -> str:
    lines = difflib.unified_diff(committed.splitlines(), generated.splitlines(), "committed", "generated", lineterm="")
    return "\n".join(list(lines)[:40])


def test_committed_tile_table_is_a_fresh_generation():
    """kernel_tiles.py and the table of docs/kernels.md are what `kernel_fit.py --write` makes of the recorded compile
    results (benchmarks/kernel_fit.json): nobody edited them by hand, and the record holds every shipped tile."""
    record = kernel_fit.read_record()
    table = kernel_fit.choose(kernel_fit.rows_to_pick(record))
    candidates = kernel_fit.candidates_text(kernel_fit.rows_to_pick(record), table)
    generated = kernel_fit.render_module(table, candidates)
    committed = kernel_fit.TILES_MODULE.read_text()
    assert committed == generated, ("kernel_tiles.py is not the generated table (python benchmarks/kernel_fit.py "
                                     "--write):\n" + _changes(committed, generated))
    docs = kernel_fit.DOCS.read_text()
    block = kernel_fit.render_docs(table, record["rows"], record["triton"], candidates)
    assert kernel_fit.docs_with_table(docs, block) == docs, ("docs/kernels.md's tile table is not the generated one "
                                                            "(python benchmarks/kernel_fit.py --write):\n"
                                                            + _changes(docs, kernel_fit.docs_with_table(docs, block)))
    assert len(table) == (len(kernel_fit.FAMILIES) * len(kernel_fit.DTYPES) * len(kernel_fit.HEAD_DIMS) * 2
                          * len(kernel_fit.KERNELS))


@pytest.mark.parametrize("dtype", kernel_fit.DTYPES)
def test_every_shipped_tile_fits_in_every_mode_in_its_dtype(dtype):
    """Read from the record's rows of the tile's own dtype (bf16 apart from fp16): every shipped tile compiled on
    every target of its family in every masking mode it runs (the masked tile under the padding mask, the other in
    the rest), within the target's shared memory and without a spill."""
    recorded = {kernel_fit.row_key(row): row for row in kernel_fit.read_record()["rows"]}
    missing, failed = [], []
    for (family, kind, d, dv, kernel), tiles in TILES.items():
        if kind != dtype:
            continue
        for target in kernel_fit.FAMILIES[family]:
            for mode in kernel_fit.MODES[kernel]:
                block_m, block_n, warps, stages = tiles[mode == "padmask"]
                key = (kernel, target, d, dv, dtype, mode, f"{block_m}x{block_n}", warps, stages)
                row = recorded.get(key)
                (missing if row is None else failed if not kernel_fit.qualifies(row) else []).append(row or key)
    assert sum(key[1] == dtype for key in TILES) == len(TILES) // len(kernel_fit.DTYPES)
    assert not missing, f"shipped {dtype} tiles without a compile in the record: {missing[:5]}"
    assert not failed, f"shipped {dtype} tiles that do not fit:\n" + kernel_fit.table(failed)


def test_a_bf16_tile_that_overflows_is_not_picked_for_bf16_only():
    """bf16 is picked from its own rows: the shipped bf16 masked forward of sm_80 at d = 64, dv = 128 recorded as
    needing 176 KiB (more than sm_80's 163) is replaced for bf16 by the next qualifying candidate, while fp16, whose
    rows are unchanged, keeps it."""
    key = (80, "bf16", 64, 128, "fwd")
    rows = kernel_fit.rows_to_pick(kernel_fit.read_record())
    masked = TILES[key][1]
    tile = "{}x{}".format(*masked[:2])

    def overflow(row: dict) -> dict:
        hit = (kernel_fit.lookup_key(row) == key and row["mode"] == "padmask"
               and (row["tile"], row["warps"], row["stages"]) == (tile, *masked[2:]))
        return row | dict(shared=180224) if hit else row
    picked = kernel_fit.choose([overflow(row) for row in rows])
    assert picked[key][0] == TILES[key][0] and picked[key][1] != masked
    assert picked[(80, "fp16", 64, 128, "fwd")] == TILES[(80, "fp16", 64, 128, "fwd")]
    replacement = kernel_fit.candidates_by_lookup(rows)[key][picked[key][1]][(80, "padmask")]
    assert kernel_fit.qualifies(replacement), replacement


def _rows(tile, target=90, kernel="fwd", modes=("causal", "decode", "padmask"), mma="wgmma", registers=200,
          error=None, **per_mode):
    """Compile rows of one candidate tile as kernel_fit writes them; `per_mode` = {mode: dict of fields to change}."""
    block_m, block_n, warps, stages = tile
    return [dict(kernel=kernel, target=target, head_dim=64, value_dim=64, dtype="fp16", mode=mode,
                 tile=f"{block_m}x{block_n}", warps=warps, stages=stages, registers=registers, spill_bytes=0,
                 shared=65536, shared_limit=kernel_fit.kernels.SHARED_MEMORY[target], mma=mma, error=error)
            | per_mode.get(mode, {}) for mode in modes]


def test_the_rule_picks_by_fit_then_wgmma_registers_size_and_stages():
    """RULE on made-up compile rows: each candidate loses for one reason only."""
    best = (64, 64, 8, 2)
    rows = [  # the best last, so that a tie would not pick it by order
        *_rows((128, 128, 8, 3), mma="mma.sync"),  # larger and deeper, but no wgmma on sm_90
        *_rows((128, 64, 8, 3), decode=dict(error="spills 8 B per thread")),  # larger, spills at T = 1
        *_rows((128, 64, 4, 3), registers=250),  # larger, over the register goal
        *_rows((64, 64, 8, 1)),  # shallower pipeline
        *_rows((32, 64, 8, 3)),  # smaller
        *_rows((64, 64, 4, 2)),  # fewer warps, else equal
        *_rows(best),
    ]
    assert kernel_fit.choose(rows) == {(90, "fp16", 64, 64, "fwd"): (best, best)}
    on_ampere = [{**row, "target": 80, "mma": "mma.sync"} for row in rows]  # wgmma counts on sm_90 only
    assert kernel_fit.choose(on_ampere)[(80, "fp16", 64, 64, "fwd")] == ((128, 128, 8, 3), (128, 128, 8, 3))


def test_the_rule_takes_a_masked_tile_only_where_the_mask_needs_one():
    tile, smaller = (128, 64, 8, 3), (64, 64, 8, 3)
    rows = [*_rows(tile, padmask=dict(error="spills 16 B per thread")), *_rows(smaller)]
    assert kernel_fit.choose(rows) == {(90, "fp16", 64, 64, "fwd"): (tile, smaller)}
    rows = [*_rows(tile, padmask=dict(error="spills 16 B per thread"))]  # no tile for the mask: none at all
    assert kernel_fit.choose(rows) == {}


def test_the_rule_needs_a_tile_to_fit_every_target_of_its_family():
    """sm_89 runs sm_86's tiles, so a tile must qualify on both; dK/dV also runs the MHA mode."""
    fits_both, only_86 = (32, 32, 8, 2), (64, 32, 8, 2)
    modes = ("causal", "mha", "padmask")
    rows = [*_rows(fits_both, 86, "dkdv", modes, "mma.sync"), *_rows(fits_both, 89, "dkdv", modes, "mma.sync"),
            *_rows(only_86, 86, "dkdv", modes, "mma.sync"),
            *_rows(only_86, 89, "dkdv", modes, "mma.sync", mha=dict(error="needs 110000 B of shared memory"))]
    assert kernel_fit.choose(rows) == {(86, "fp16", 64, 64, "dkdv"): (fits_both, fits_both)}


def test_a_fresh_pick_from_the_record_is_the_shipped_table():
    """The check of the tile table: RULE over every candidate the record holds, failed ones included, picks
    kernel_tiles.TILES; the record states which candidates it holds, and some picks met their challengers (every
    tile one step ahead of them, compiled in every mode on every target), so the rule chose among several."""
    record = kernel_fit.read_record()
    rows = kernel_fit.rows_to_pick(record)
    picked = kernel_fit.choose(rows)
    changed = {key: (picked.get(key), tiles) for key, tiles in TILES.items() if picked.get(key) != tiles}
    assert picked == TILES, f"fresh pick (left) != shipped (python benchmarks/kernel_fit.py --write): {changed}"
    assert record["candidates"] == kernel_fit.candidates_text(rows, TILES)
    met = kernel_fit.challenged(rows, TILES)
    assert len(met) >= 12, "the record holds the shipped tiles only: python benchmarks/kernel_fit.py --challengers"
    lookups = kernel_fit.candidates_by_lookup(rows)
    assert all(len(lookups[key]) > 1 for key in met)



def _fits_unmasked(candidate_rows: dict, key: tuple) -> bool:
    """Read from a candidate's compile rows themselves: compiled, no spill, within shared memory, on every target of
    the family in every mode the kernel runs without a mask."""
    rows = [candidate_rows.get((target, mode)) for target in kernel_fit.FAMILIES[key[0]]
            for mode in kernel_fit.MODES[key[4]] if mode != "padmask"]
    return all(row and not row["error"] and row["spill_bytes"] == 0 and row["shared"] <= row["shared_limit"]
               for row in rows)


def test_the_ranked_alternatives_start_with_the_shipped_tile():
    """kernel_fit.ranked (what benchmarks/bench_tiles.py times after the shipped tile): every lookup's candidates
    that fit without a mask, each once, the shipped unmasked tile first; and a planted better candidate first."""
    lookups = kernel_fit.candidates_by_lookup(kernel_fit.rows_to_pick(kernel_fit.read_record()))
    for key, (tile, _) in TILES.items():
        ranked = kernel_fit.ranked(lookups[key], key[0], key[4])
        assert ranked[0] == tile, (key, ranked)
        assert len(set(ranked)) == len(ranked)
        assert set(ranked) == {tile for tile, rows in lookups[key].items() if _fits_unmasked(rows, key)}, key
    key = (90, "fp16", 128, 256, "dkdv")
    planted = kernel_fit.candidates_by_lookup(kernel_fit.rows_to_pick(kernel_fit.read_record())
                                              + _planted(key, (128, 128, 8, 3)))
    assert kernel_fit.ranked(planted[key], 90, "dkdv")[:2] == [(128, 128, 8, 3), TILES[key][0]]


def _planted(key: tuple, tile: tuple, **figures) -> list[dict]:
    """Compile rows of `tile` for lookup `key` in every mode on every target of its family: better than any
    shipped tile by RULE's order (wgmma, 64 registers) unless `figures` say otherwise."""
    family, dtype, d, dv, kernel = key
    return [dict(kernel=kernel, target=target, head_dim=d, value_dim=dv, dtype=dtype, mode=mode,
                 tile="{}x{}".format(*tile[:2]), warps=tile[2], stages=tile[3], registers=64, spill_bytes=0,
                 shared=1024, shared_limit=kernels.SHARED_MEMORY[target], mma="wgmma", error=None) | figures
            for target in kernel_fit.FAMILIES[family] for mode in kernel_fit.MODES[kernel]]


@pytest.mark.parametrize("key", [(90, "fp16", 128, 256, "dkdv"), (86, "fp16", 64, 128, "fwd")])
def test_a_better_candidate_that_spills_or_overflows_is_not_picked(key):
    """Planted in the real record: a tile ahead of the shipped one in every way but fit is not picked when it spills
    or needs more shared memory than the target has, even with its error text lost; recorded as fitting, it is."""
    rows = kernel_fit.rows_to_pick(kernel_fit.read_record())
    better = (128, 128, 8, 3)
    assert better not in TILES[key]
    limit = kernels.SHARED_MEMORY[90 if key[0] == 90 else 86]
    for fault in (dict(spill_bytes=8), dict(shared=limit + 1024), dict(error="spills 8 B per thread")):
        assert kernel_fit.choose(rows + _planted(key, better, **fault))[key] == TILES[key], fault
    assert kernel_fit.choose(rows + _planted(key, better))[key] == (better, better)


@pytest.mark.parametrize("key", [(90, "fp16", 128, 256, "dkdv"), (86, "fp16", 64, 128, "fwd")])
def test_a_candidate_that_fails_under_the_floor_triton_is_not_picked(key):
    """A tile that fits under the record's Triton but spills under the floor's (recorded in `floor_rows`) is not
    picked: the GPU machines of the supported floor run that release. Fitting there too, it is."""
    record = kernel_fit.read_record()
    better = (128, 128, 8, 3)
    planted = _planted(key, better)
    spills = [row | dict(spill_bytes=8, error="spills 8 B per thread") for row in planted]
    fits = [row | dict(registers=200) for row in planted]
    assert kernel_fit.choose(kernel_fit.with_floor(record["rows"] + planted, record["floor_rows"] + spills))[key] \
        == TILES[key]
    assert kernel_fit.choose(kernel_fit.with_floor(record["rows"] + planted, record["floor_rows"] + fits))[key] \
        == (better, better)


def test_the_shipped_tiles_that_the_floor_triton_compiled_fit_there():
    """Every shipped tile the record holds a floor-release compile of fits there (python benchmarks/kernel_fit.py
    --record under Triton FLOOR_TRITON adds them)."""
    record = kernel_fit.read_record()
    def picked(row: dict) -> bool:  # the shipped tile of the row's lookup, in the row's masking mode
        tiles = TILES.get(kernel_fit.lookup_key(row))
        return tiles is not None and kernel_fit._candidate(row) == tiles[row["mode"] == "padmask"]

    floor = [row for row in record["floor_rows"] if picked(row)]
    assert floor, "no floor-release compile of a shipped tile recorded"
    failed = [row for row in floor if not kernel_fit.qualifies(row)]
    assert not failed, "shipped tiles that do not fit under the floor's Triton:\n" + kernel_fit.table(failed)


def test_a_recorded_failure_is_what_keeps_a_challenger_out():
    """Changed in the record, a challenger that spilled (sm_90 forward at d = 128, dv = 256: 64x64 8w 3s, recorded
    in causal mode only: its other modes were skipped after that failure) becomes the pick once it fits in every
    mode; the recorded spill is what keeps the shipped 64x32 8w 3s."""
    key, challenger = (90, "fp16", 128, 256, "fwd"), (64, 64, 8, 3)
    rows = kernel_fit.rows_to_pick(kernel_fit.read_record())
    causal = kernel_fit.candidates_by_lookup(rows)[key][challenger][(90, "causal")]
    assert not kernel_fit.qualifies(causal)
    assert kernel_fit.choose(rows)[key] == TILES[key] != (challenger, challenger)
    fitting = [causal | dict(mode=mode, spill_bytes=0, error=None, shared=causal["shared_limit"])
               for mode in kernel_fit.MODES["fwd"]]
    assert kernel_fit.choose(rows + fitting)[key] == (challenger, challenger)
    assert kernel_fit.choose(rows + fitting[:-1])[key] == TILES[key]  # a mode short: not a candidate


def test_a_row_qualifies_by_its_figures():
    row = _rows((64, 64, 8, 2))[0]
    assert kernel_fit.qualifies(row)
    assert not kernel_fit.qualifies(row | dict(spill_bytes=4))
    assert not kernel_fit.qualifies(row | dict(shared=row["shared_limit"] + 1))
    assert not kernel_fit.qualifies(row | dict(error="CompilationError: ..."))
    assert not kernel_fit.qualifies(None)  # not compiled in that mode


def test_challengers_are_the_tiles_one_step_ahead():
    assert kernel_fit.challengers((64, 32, 4, 2)) == [(128, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 8, 2)]
    assert kernel_fit.challengers((128, 128, 8, 3)) == []  # the grid's corner
    rows = [dict(registers=200, mma="mma.sync")]  # equal in all but the tile: only size, depth and warps differ
    for tile in kernel_fit.challengers((32, 16, 4, 1)):
        assert kernel_fit._order(tile, rows, 80) < kernel_fit._order((32, 16, 4, 1), rows, 80), tile


def test_a_saved_folder_ships_the_tile_table(tmp_path):
    """kernel_tiles.py travels with kernel_diff_flash.py (save_pretrained copies the relative imports): a folder
    loaded without the package has the diff_flash kernel, with the package's tiles."""
    folder = tmp_path / "model"
    build_stack("sdpa", "V1-GQA").save_pretrained(folder)
    assert (folder / "kernel_tiles.py").read_text() == kernel_fit.TILES_MODULE.read_text()
    out = run_without_package(f"""
        import sys
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        modeling = sys.modules[type(model).__module__]
        package = modeling.__name__.rpartition(".")[0]
        kernel = sys.modules[package + ".kernel_diff_flash"]
        assert sys.modules[package + ".attention_kernels"].diff_flash_attention is not None
        print("TILES", kernel.tile_config("dkdv", 128, 128, "float16", 89, masked=True))
    """, tmp_path)
    assert f"TILES {kernels.tile_config('dkdv', 128, 128, torch.float16, 89, masked=True)}" in out, out[-3000:]
