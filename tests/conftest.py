import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

# Tiny test models run fastest on one thread; more threads oversubscribe the CI machine's few cores (and the
# 2-process data-parallel test), which slows OpenMP down.
torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


# Files next to the checkout (or at $DIFF_TEST_SHARED) that the project may not copy in; CI provides them (.ci/run
# says so when it does not).
SHARED = Path(os.environ.get("DIFF_TEST_SHARED", Path(__file__).resolve().parents[2] / "shared"))


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    """../shared/data/tinyshakespeare.txt, the text corpus of the CLI and evaluation tests; without it they skip
    with this reason."""
    path = SHARED / "data" / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip(f"needs {path}: tiny Shakespeare (../shared/data/tinyshakespeare.txt, or set DIFF_TEST_SHARED)")
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than a few seconds per case; not in the default run")
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line("markers", "rehearsal: the GPU suite on a CPU (minutes); CI's floor pass runs it")
