"""Publish a saved DIFF Transformer folder (model + tokenizer) to the Hugging Face Hub, from a checkout:

    python hub_upload.py MODEL_DIR REPO_ID [--dry-run] [--private] [--license mit]

The same command as `diff-transformer upload` (its parser, checks and code): --help and argument errors answer
before torch is imported."""

import sys

from diff_transformer_cli import main

if __name__ == "__main__":
    main(["upload", *sys.argv[1:]])
