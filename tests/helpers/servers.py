"""Talking to an OpenAI-compatible server the tests start in a subprocess (`diff-transformer serve` on vLLM,
`transformers serve`): a free port, a JSON POST, and waiting for /health."""

import json
import subprocess
import socket
import time
import urllib.request
from pathlib import Path

import pytest

START_S, REQUEST_S = 240, 120  # generous: the CI machine may be busy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
        return json.loads(response.read())


def wait_until_up(server: subprocess.Popen, port: int, log: Path) -> None:
    """Until the server answers /health; a failure with its log's tail when it exits or is silent for START_S."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
            return
        except OSError:  # URLError, refused or reset connections, timeouts
            time.sleep(1)
    pytest.fail(f"no server on port {port} after {START_S} s:\n{log.read_text()[-3000:]}")
