"""The package version, in one place: setup.py reads it, `diff_transformer.__version__` re-exports it."""

__version__ = "0.1.0"
