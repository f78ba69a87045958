import os

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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than a few seconds per case; not in the default run")
    config.addinivalue_line("markers", "gpu: needs CUDA")
