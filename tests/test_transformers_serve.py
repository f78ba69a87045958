"""transformers' own OpenAI-compatible server (`transformers serve`) on a saved folder with a chat template, through
`python -m diff_transformer.serving.transformers_serve`: `/v1/completions` and `/v1/chat/completions` answer with
plain `generate`'s greedy text, with and without `--continuous-batching`, and the server exits cleanly on Ctrl-C.
Each server is a subprocess on 127.0.0.1 with no Hub access, bounded in time."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import STACKS, tiny_config
from helpers.servers import START_S, free_port, post, wait_until_up
from transformers.utils.import_utils import is_serve_available

from diff_transformer import DiffForCausalLM
from diff_transformer.paged_cache import UPDATE_TAKES_KWARGS
from diff_transformer.tools.data import KeyValueTask

pytestmark = pytest.mark.skipif(not is_serve_available(), reason="pip install 'diff-transformer[serving]'")
ROOT = Path(__file__).resolve().parents[1]
PROMPT, MESSAGE = "k1 v2 k3 v4 ? k1", "k5 v9 ? k5"
NEW_TOKENS = 5
STOP_S = 120  # generous: the CI machine may be busy
# A bounded paged cache: without --cb-num-blocks transformers sizes it to most of the free memory (on a CPU, RAM)
BATCHING = ["--continuous-batching", "--cb-num-blocks", "8", "--cb-max-batch-tokens", "256"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny hybrid stack (differential and standard layers) with a word tokenizer and a chat template, saved."""
    tokenizer = KeyValueTask().tokenizer(chat=True)
    torch.manual_seed(0)
    config = tiny_config(**STACKS["hybrid"], vocab_size=len(tokenizer), initializer_range=0.2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("serve") / "model"
    DiffForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def expected_text(folder: Path, chat: bool) -> str:
    """Plain `generate`'s greedy continuation, decoded as the server decodes it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": MESSAGE}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(PROMPT)["input_ids"]
    model = DiffForCausalLM.from_pretrained(folder).eval()
    out = model.generate(torch.tensor([list(ids)]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def start(arguments: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A server subprocess: no Hub, no standard input, its output in a log file."""
    log = tmp_path / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, *arguments, "--host", "127.0.0.1", "--port", str(free_port())],
                                  cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    return server, log


def stop(server: subprocess.Popen, log: Path) -> int:
    """Ctrl-C, then the exit code within STOP_S (killed and failed past it)."""
    server.send_signal(signal.SIGINT)
    try:
        return server.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        pytest.fail(f"the server did not exit within {STOP_S} s of Ctrl-C:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def expected(folder) -> dict[bool, str]:
    return {chat: expected_text(folder, chat) for chat in (False, True)}


def ask(server: subprocess.Popen, folder: Path) -> tuple[str, str]:
    """The completion's text and the chat reply's content, greedy, NEW_TOKENS at most."""
    port = int(server.args[-1])
    completion = post(port, "/v1/completions", {"model": str(folder), "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                "temperature": 0})
    chat = post(port, "/v1/chat/completions", {"model": str(folder), "max_tokens": NEW_TOKENS, "temperature": 0,
                                               "messages": [{"role": "user", "content": MESSAGE}]})
    return completion["choices"][0]["text"], chat["choices"][0]["message"]["content"]


def test_transformers_serve_answers_with_generate_tokens(folder, expected, tmp_path):
    """Two servers at once (their start-up overlaps): plain generation and continuous batching."""
    modes = [False, *([True] if UPDATE_TAKES_KWARGS else [])]  # older transformers: batching is refused
    servers = {}
    try:
        for batching in modes:
            (tmp_path / str(batching)).mkdir()
            servers[batching] = start(["-m", "diff_transformer.serving.transformers_serve", str(folder),
                                       *(BATCHING if batching else [])], tmp_path / str(batching))
        for server, log in servers.values():
            wait_until_up(server, int(server.args[-1]), log)
        answers = {batching: ask(server, folder) for batching, (server, _) in servers.items()}
    finally:
        codes = {batching: stop(server, log) for batching, (server, log) in servers.items()}
    for batching, (text, reply) in answers.items():
        log = servers[batching][1].read_text()
        assert (text, reply) == (expected[False], expected[True]), (batching, text, reply, expected)
        assert codes[batching] == 0, f"exit code {codes[batching]}:\n{log[-3000:]}"
        assert f"CB: {batching}" in log, f"the server did not take the expected path (batching={batching})"


def test_plain_transformers_serve_cannot_load_the_folder(folder, tmp_path):
    """Why the launcher exists: `transformers serve` looks the folder's class up on the `transformers` module, so it
    fails on DIFF folders even with --trust-remote-code. If this test fails, transformers serves custom classes
    now, and the launcher (docs/serving.md) may become unnecessary."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", "from transformers.cli.transformers import app; app()", "serve", str(folder),
               "--trust-remote-code", "--host", "127.0.0.1", "--port", str(free_port())]
    result = subprocess.run(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=START_S)
    assert result.returncode != 0 and "has no attribute DiffForCausalLM" in result.stderr, result.stderr[-3000:]
