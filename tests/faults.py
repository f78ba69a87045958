"""Planted faults: each plausible bug below must make at least one test fail.

    python tests/faults.py                 # every fault; exits 1 if any is not caught
    python tests/faults.py --list          # the faults' names
    python tests/faults.py NAME [NAME ...] # some of them

The repository (without .git and virtual environments) is copied once into a temporary folder; each fault edits one
line of that copy's package (the text it replaces must occur exactly once, so a fault cannot silently become a no-op
when the code moves), runs pytest on the copy with `-x` over the test files where the faulty code runs, most
sensitive first, so that the run stops at the first test that catches it, prints that test's node id, and restores
the line. The working tree is never edited. Tests run under the default selection
(`-m 'not slow and not gpu and not rehearsal'`). The faults of the vLLM plugin need vLLM's CPU build: under a venv
without vLLM they are skipped, saying so; run them in the venv `bash .ci/run vllm` builds.
"""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MODELING = "diff_transformer/modeling_diff.py"
LAMBDA = "diff_transformer/diff_lambda.py"
KERNELS = "diff_transformer/attention_kernels.py"
COMMON = "diff_transformer/kernel_common.py"
TILED = "diff_transformer/kernel_tiled.py"
FLASH = "diff_transformer/kernel_diff_flash.py"
MOTIF = "diff_transformer/tools/motif.py"
UNILM_MODULE = "diff_transformer/multihead_diffattn.py"
POLY_NORM = "diff_transformer/poly_norm.py"
TRAINER = "diff_transformer/tools/training.py"
SAFE_WRITE = "diff_transformer/tools/safe_write.py"
VLLM_MODEL = "diff_transformer/serving/vllm_model.py"
PAPER_SMALL = "benchmarks/paper_small.py"

# Test files by what they exercise, most sensitive (and fastest) first.
LAYER = ["tests/test_modeling.py::test_attention_matches_reference"]
V2_LAYER = ["tests/test_v2.py::test_v2_attention_matches_reference"]
BACKENDS = ["tests/test_backends.py::test_loss_and_all_gradients_match_eager"]
DECODE = ["tests/test_modeling.py::test_cached_decode_logits_equal_full_forward",
          *(f"tests/test_generation.py::{name}" for name in (  # the cache under either argument name
              "test_cache_under_either_name_continues_the_sequence", "test_both_names_at_once_are_never_silent",
              "test_cache_under_a_foreign_name_raises", "test_output_carries_the_cache_where_transformers_llama_does",
              "test_past_key_values_warns_where_transformers_renamed_it")),
          "tests/test_v2.py::test_v2_cached_generation_equals_uncached"]
TRAINING = ["tests/test_training.py::test_trainer_gradients_equal_a_plain_backward"]
GDA = ["tests/test_gda.py::test_kernel_matches_reference"]
MOTIF_LOGITS = ["tests/test_motif.py::test_logits_match_the_float64_reference"]
# vLLM's CPU build serving over 2 ranks (about a minute each; run in the venv `bash .ci/run vllm` builds)
VLLM_TP = "tests/vllm_serving/test_vllm_serving.py::test_parallel_engine_matches_transformers"


class Fault(NamedTuple):
    name: str
    path: str  # the file it edits (of the package, or a benchmark script)
    old: str  # text that occurs exactly once in that file
    new: str
    tests: list[str]  # pytest arguments, run with -x in this order
    needs: str | None = None  # a module the tests need: without it the fault is skipped, saying so


FAULTS = [
    Fault("lambda sign flipped", LAMBDA,
          "return torch.exp(torch.dot(upcast(q1), upcast(k1))) - torch.exp(",
          "return -torch.exp(torch.dot(upcast(q1), upcast(k1))) + torch.exp(", LAYER),
    Fault("lambda 1% too large", LAMBDA,
          "torch.exp(torch.dot(upcast(q2), upcast(k2))) + lambda_init",
          "torch.exp(torch.dot(upcast(q2), upcast(k2))) + lambda_init + 0.01 * lambda_init", LAYER),
    Fault("lambda 3e-4 off (fp32 tolerance)", LAMBDA,
          "torch.exp(torch.dot(upcast(q2), upcast(k2))) + lambda_init",
          "torch.exp(torch.dot(upcast(q2), upcast(k2))) + lambda_init + 3e-4", LAYER),
    # forward unchanged, lambda's gradient negated where the lambda vectors are bf16 (as in a bf16 model)
    Fault("lambda gradient sign flipped in bf16", LAMBDA,
          "    return torch.exp(torch.dot(upcast(q1), upcast(k1))) - torch.exp(torch.dot(upcast(q2), upcast(k2))) "
          "+ lambda_init\n",
          "    lam = torch.exp(torch.dot(upcast(q1), upcast(k1))) - torch.exp(torch.dot(upcast(q2), upcast(k2))) "
          "+ lambda_init\n    return 2 * lam.detach() - lam if q1.dtype == torch.bfloat16 else lam\n",
          ["tests/test_modeling.py::test_attention_matches_reference", "tests/test_v2.py", "tests/test_backends.py"]),
    Fault("lambda gets no gradient", LAMBDA,
          "torch.exp(torch.dot(upcast(q2), upcast(k2))) + lambda_init",
          "torch.exp(torch.dot(upcast(q2), upcast(k2))).detach() + lambda_init", LAYER),
    Fault("eager map uses +lambda", KERNELS,
          "diff_map = torch.addcmul(a1, a2, lam, value=-1)  # A1 - lambda A2",
          "diff_map = torch.addcmul(a1, a2, lam, value=1)", LAYER),
    Fault("decode step lambda 20% off", KERNELS,
          "return torch.addcmul(out[:, :, 0], out[:, :, 1], lam, value=-1)",
          "return torch.addcmul(out[:, :, 0], out[:, :, 1], 1.2 * lam, value=-1)", DECODE),
    Fault("decode step lambda = 0", KERNELS,
          "return torch.addcmul(out[:, :, 0], out[:, :, 1], lam, value=-1)",
          "return torch.addcmul(out[:, :, 0], out[:, :, 1], 0 * lam, value=-1)", DECODE),
    Fault("decode step drops the oldest cached key", KERNELS,
          "    batch, d, h_kv, dv = q.shape[0], q.shape[-1], k.shape[1], v.shape[-1]\n",
          "    batch, d, h_kv, dv = q.shape[0], q.shape[-1], k.shape[1], v.shape[-1]\n"
          "    k, v = k[:, :, 1:], v[:, :, 1:]\n"
          "    attention_mask = None if attention_mask is None else attention_mask[..., 1:]\n", DECODE),
    Fault("SubLN gain ignored", MODELING,
          "return (self.subln(out) * self.output_scale if",
          "return (self.subln(out) / self.subln.weight * self.output_scale if", LAYER),
    Fault("(1 - lambda_init) scale dropped", MODELING,
          "return 1.0 - self.lambda_params.lambda_init if self.use_subln else 1.0",
          "return 1.0", LAYER),
    Fault("standard layers' o_proj bias follows q/k/v's", MODELING,
          "if config.attention_out_bias != config.attention_bias:", "if False:",
          ["tests/test_hybrid.py::test_every_layer_kind_takes_each_bias_setting"]),
    Fault("query branch rows swapped", COMMON,
          "return q[:, :h], q[:, h:], k[..., :d], k[..., d:]",
          "return q[:, h:], q[:, :h], k[..., :d], k[..., d:]", LAYER),
    Fault("key branch halves swapped in packing", MODELING,
          "k = k.view(batch, 2, -1, length, d).permute(0, 2, 3, 1, 4)",
          "k = k.view(batch, 2, -1, length, d).flip(1).permute(0, 2, 3, 1, 4)", LAYER),
    Fault("standard calls use +lambda", KERNELS,
          "return branch_outputs[0] - lam * per_head(branch_outputs[1], group, dim=2), None",
          "return branch_outputs[0] + lam * per_head(branch_outputs[1], group, dim=2), None", LAYER),
    Fault("standard calls ignore the mask", KERNELS,
          "parts = [attend(caller, *call, attention_mask, dropout=0.0",
          "parts = [attend(caller, *call, None, dropout=0.0", LAYER + ["tests/test_modeling.py"]),
    Fault("tiled kernel: row 0's padding mask for all", TILED,
          "return forward_tiles(*branch_views(q, k, scaling), v, lam, branch_mask(mask, k.shape[1]), rows)",
          "return forward_tiles(*branch_views(q, k, scaling), v, lam, branch_mask(None if mask is None or "
          "mask.shape[0] == 1 else mask[:1].expand_as(mask), k.shape[1]), rows)",
          ["tests/test_tiled_kernel.py", "tests/test_backends.py::test_sdpa_tiled_cpu_route_matches_eager"]),
    Fault("tiled backward: lambda gradient sign", TILED,
          "dlam -= torch.dot(probs[1].view(-1), d_map.view(-1))",
          "dlam += torch.dot(probs[1].view(-1), d_map.view(-1))",
          ["tests/test_tiled_kernel.py", "tests/test_backends.py::test_sdpa_tiled_cpu_route_matches_eager"]),
    Fault("tiled backward: dV doubled", TILED,
          "return dq, dk.view(k.shape), dv_flat.view(v.shape), dlam, None, None, None",
          "return dq, dk.view(k.shape), 2 * dv_flat.view(v.shape), dlam, None, None, None",
          ["tests/test_tiled_kernel.py", "tests/test_backends.py::test_sdpa_tiled_cpu_route_matches_eager"]),
    Fault("diff_flash backward: lambda gradient sign", FLASH,
          "grad_lam = -delta2.sum()", "grad_lam = delta2.sum()",
          ["tests/test_diff_flash_kernel.py", "tests/test_backends.py"]),
    Fault("bf16 looks up fp16's tiles", FLASH,
          '_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}',
          '_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "fp16", "float32": "fp32"}',
          ["tests/test_diff_flash_kernel.py::test_a_lookup_without_a_tile_in_its_dtype_makes_the_standard_calls"]),
    Fault("diff_flash forgets a launch that ran out of shared memory", FLASH,
          "_LAUNCH_FAILURES[_failure_key(like, head_dim, value_dim)] = reason", "reason = reason",
          ["tests/test_diff_flash_kernel.py::test_a_launch_without_the_resources_falls_back"]),
    Fault("diff_flash decode steps run the fused kernel", KERNELS,
          '        implementation = "sdpa"  # a decode step', '        pass  # a decode step',
          ["tests/test_kernel_selection.py"]),
    Fault("diff_flash's forward keeps torch.compile's fp64 scale", FLASH,
          "        qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile", "        pass  # torch.compile",
          ["tests/test_kernel_fit.py::test_the_kernels_compile_with_the_scales_torch_compile_passes"]),
    Fault("a diff_flash launch out of shared memory crashes the step", KERNELS,
          "    except TileDoesNotFit as error:", "    except ValueError as error:",
          ["tests/test_diff_flash_kernel.py::test_a_launch_without_the_resources_falls_back"]),
    Fault("gradients doubled in training mode", MODELING,
          "return self.o_proj(out.to(hidden_states.dtype).reshape(batch, length, -1)), attn_map",
          "out = self.o_proj(out.to(hidden_states.dtype).reshape(batch, length, -1))\n"
          "        return (2 * out - out.detach() if self.training else out), attn_map", TRAINING),
    Fault("V2 gate off", MODELING,
          "gate = torch.sigmoid(gate.float())  # [B, T, h]",
          "gate = 0 * torch.sigmoid(gate.float())  # [B, T, h]", V2_LAYER),
    Fault("V2 gate sign in the sdpa path", MODELING,
          "return attn[..., 0, :].float() - gate[..., None] * attn[..., 1, :].float(), weights",
          "return attn[..., 0, :].float() + gate[..., None] * attn[..., 1, :].float(), weights", V2_LAYER),
    Fault("V2 head pairs mis-grouped", MODELING,
          "attn = attn.view(*hidden_states.shape[:2], -1, 2, self.head_dim)  # [B, T, h, pair, d]",
          "attn = attn.view(*hidden_states.shape[:2], 2, -1, self.head_dim).transpose(2, 3)", V2_LAYER),
    # Llama's inherited forward reads what Llama's __init__ sets; DiffModel builds its modules itself
    Fault("DiffModel drops an attribute LlamaModel sets", MODELING,
          "        self.gradient_checkpointing = False\n        self.post_init()\n\n    # LlamaModel's forward",
          "        self.post_init()\n\n    # LlamaModel's forward",
          ["tests/test_modeling.py::test_classes_hold_what_their_llama_parent_builds"]),
    Fault("checkpoints written in place", TRAINER,
          "            self.staging = str(folder.parent)\n",
          "            self.staging = None\n",
          ["tests/test_safe_writes.py::test_full_disk_during_a_checkpoint_is_one_line"]),
    Fault("a failed write leaves its staging folder", SAFE_WRITE,
          "        size = max(needed() if callable(needed) else needed, folder_bytes(private))\n"
          "        shutil.rmtree(private, ignore_errors=True)\n",
          "        size = max(needed() if callable(needed) else needed, folder_bytes(private))\n"
          "        private = private.with_name(private.name + '-kept')\n",
          ["tests/test_safe_writes.py::test_a_full_disk_is_one_line_and_leaves_nothing"]),
    Fault("paper_small stores a run in place", PAPER_SMALL,
          "        write_file(stored_path(unit), lambda staged, row=row: torch.save(row, staged))\n",
          "        torch.save(row, stored_path(unit))\n",
          ["tests/test_evaluation.py::test_paper_small_run_killed_while_stored_resumes_to_the_same_result"]),
    Fault("per-layer lambda_init in the layer repr", LAMBDA,
          'return f"head_dim={self.q1.numel()}"',
          'return f"head_dim={self.q1.numel()}, lambda_init={self.lambda_init:.4f}"',
          ["tests/test_modeling.py::test_print_folds_identical_layers_like_llama"]),
    Fault("GDA: noise map of the wrong group (eager)", KERNELS,
          "a2 = per_head(a2, group, dim=1)", "a2 = a2.repeat(1, group, 1, 1)", GDA),
    Fault("GDA: noise output of the wrong group (standard calls)", KERNELS,
          "lam * per_head(branch_outputs[1], group, dim=2)", "lam * branch_outputs[1].repeat(1, 1, group, 1)",
          GDA),
    Fault("GDA: noise query of the wrong group (expanded at call)", COMMON,
          "per_head(q2, group, dim=1)", "q2.repeat(1, group, 1, 1)", GDA),
    Fault("GDA: tiled inference subtracts another noise head's map", TILED,
          "torch.addcmul(grouped, p2.unsqueeze(3), lam", "torch.addcmul(grouped, p2.flip(2).unsqueeze(3), lam",
          ["tests/test_gda.py::test_tiled_inference_computes_each_noise_map_once"]),
    Fault("GDA converter: noise rows of the wrong group", MOTIF,
          "else torch.arange(groups)", "else torch.arange(groups).roll(1)", MOTIF_LOGITS),
    # F.pad's default value: a partial rel_pos padded to head_dim / 2 with cos 0 zeroes the unrotated dims
    Fault("unilm module: rel_pos padded with cos = 0", UNILM_MODULE,
          "    rotary = 2 * cos.shape[-1]\n",
          "    cos, sin = (torch.nn.functional.pad(t, (0, x.shape[-1] // 2 - t.shape[-1])) for t in (cos, sin))\n"
          "    rotary = 2 * cos.shape[-1]\n",
          ["tests/test_multihead_diffattn.py"]),
    Fault("PolyNorm in bf16 without the fp32 upcast", POLY_NORM, "        z = upcast(x)\n", "        z = x\n",
          ["tests/test_modeling.py::test_poly_norm_mlp_in_bf16_rounds_only_the_activation_output"]),
    Fault("Motif: SubLN eps defaults to rms_norm_eps's", MOTIF,
          'subln_eps=fields.get("attn_rms_norm_eps", ATTN_RMS_NORM_EPS)',
          'subln_eps=fields.get("attn_rms_norm_eps", fields.get("rms_norm_eps", 1e-6))',
          ["tests/test_motif.py::test_omitted_fields_take_the_publishers_defaults"]),
    Fault("vLLM TP: a differential pair split across ranks", VLLM_MODEL,
          "            return branch_halves_rank_major(rows, self.ranks, self.signal_rows)\n        if projection == \"k",
          "            return rows\n        if projection == \"k", [f"{VLLM_TP}[hybrid_v1_mha-tp2]"], "vllm"),
    Fault("vLLM TP: grouped noise heads' queries cut in equal halves", VLLM_MODEL,
          "branch_halves_rank_major(rows, self.ranks, self.signal_rows)", "branch_halves_rank_major(rows, self.ranks)",
          [f"{VLLM_TP}[motif_gda-tp2]"], "vllm"),
    Fault("model code registers nothing on import", MODELING,
          "register_model_code()  # here", "pass  # here",
          ["tests/test_modeling.py::test_remote_code_loads_without_package"]),
    Fault("an unknown backend's error does not name diff_flash", KERNELS,
          'return name is not None and "/" not in name and name.removeprefix("paged|") not in known', "return False",
          ["tests/test_saved_folder.py::test_unknown_attention_names_diff_flash"]),
    Fault("vLLM GDA: noise map of the wrong group", VLLM_MODEL,
          "noise = per_head(noise, self.group, dim=2)", "noise = noise.repeat(1, 1, self.group, 1)",
          ["tests/vllm_serving/test_vllm_serving.py::test_offline_generate_matches_transformers[v1_gda]"], "vllm"),
    Fault("vLLM TP: lambda from one rank's slice", VLLM_MODEL,
          "self.lam = compute_lambda(p.q1, p.k1, p.q2, p.k2, self.lambda_init)",
          "self.lam = compute_lambda(*(x[: self.d // self.ranks] for x in (p.q1, p.k1, p.q2, p.k2)), "
          "self.lambda_init)", [f"{VLLM_TP}[hybrid_v1_mha-tp2]"], "vllm"),
    Fault("vLLM TP: PolyNorm without the all-reduce", VLLM_MODEL,
          "squares = tensor_model_parallel_all_reduce(u.pow(2).sum(-1, keepdim=True))",
          "squares = 2 * u.pow(2).sum(-1, keepdim=True)", [f"{VLLM_TP}[motif_gda-tp2]"], "vllm"),
]


def copy_repository(target: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", ".pytest_cache", "notebooks",
                                    "benchmarks")
    shutil.copytree(ROOT, target, ignore=ignore, symlinks=True)
    (target / "benchmarks").mkdir()
    for script in (ROOT / "benchmarks").glob("*.py"):  # the scripts, not their committed runs and figures
        shutil.copy2(script, target / "benchmarks" / script.name)


def run_fault(fault: Fault, copy: Path, timeout: float) -> tuple[str | None, float, str]:
    """(the node id of the first failing test or None, seconds, the output's tail)."""
    path = copy / fault.path
    original = path.read_text()
    count = original.count(fault.old)
    if count != 1:
        raise SystemExit(f"fault {fault.name!r}: the text to replace occurs {count} times in {fault.path}")
    path.write_text(original.replace(fault.old, fault.new))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider",
                                 *fault.tests], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        output = f"timed out after {timeout:.0f} s\n{error.stdout or ''}"
    finally:
        path.write_text(original)
    seconds = time.monotonic() - start
    failed = re.search(r"^(?:FAILED|ERROR) (\S+::\S+)", output, re.MULTILINE)  # a test, not a collection error
    return (failed.group(1) if failed else None), seconds, output[-2000:]


def check_copy_is_imported(copy: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")])}
    found = subprocess.run([sys.executable, "-c", "import diff_transformer; print(diff_transformer.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy's package is not the one imported: {found}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="faults to plant (default: all)")
    parser.add_argument("--list", action="store_true", help="print the faults' names and exit")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per fault")
    args = parser.parse_args()
    if args.list:
        print("\n".join(fault.name for fault in FAULTS))
        return 0
    unknown = set(args.names) - {fault.name for fault in FAULTS}
    if unknown:
        parser.error(f"unknown fault(s) {sorted(unknown)}; see --list")
    faults = [fault for fault in FAULTS if not args.names or fault.name in args.names]
    missed, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="diff-faults-") as tmp:
        copy = Path(tmp) / "repo"
        copy_repository(copy)
        check_copy_is_imported(copy)
        print(f"{'fault':44} {'seconds':>7}  caught by")
        for fault in faults:
            if fault.needs and importlib.util.find_spec(fault.needs) is None:
                print(f"{fault.name:44} {'-':>7}  skipped: needs {fault.needs} (run in its venv)", flush=True)
                skipped.append(fault.name)
                continue
            node, seconds, tail = run_fault(fault, copy, args.timeout)
            print(f"{fault.name:44} {seconds:7.0f}  {node or 'NOT CAUGHT'}", flush=True)
            if node is None:
                missed.append(fault.name)
                print(tail, file=sys.stderr)
    ran = len(faults) - len(skipped)
    print(f"{ran - len(missed)} of {ran} faults caught" + (f", {len(skipped)} skipped" if skipped else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
