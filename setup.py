from setuptools import setup

setup(
    name="diff-transformer",
    version="0.1.0",
    description="The Differential Transformer (arXiv 2410.05258) as a first-class Hugging Face model",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    packages=["diff_transformer"],
    py_modules=["hub_upload"],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "transformers>=5.0,<6",
        "safetensors>=0.4",
        "tokenizers>=0.21",
        "accelerate>=1.0",
    ],
    extras_require={
        "triton": ["triton>=3.2"],
        "flash-attn": ["flash-attn>=2.6"],
        "peft": ["peft>=0.15"],
        "hub": ["huggingface_hub>=1.0"],
        "dev": [
            "pytest>=8",
            "peft>=0.15",
            "triton>=3.2",
            "matplotlib>=3.8",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6",
            "pyyaml>=6",
        ],
    },
    entry_points={"console_scripts": ["diff-transformer=diff_transformer.cli:main"]},
)
