"""`python -m diff_transformer.serving.transformers_serve FOLDER [transformers serve options]`: transformers' own
OpenAI-compatible server (`transformers serve`, from `pip install 'transformers[serving]'`) on a saved DIFF
Transformer (arXiv 2410.05258) folder, `--continuous-batching` included.

`transformers serve` itself cannot load a model whose class is not part of transformers: it resolves the class as
an attribute of the `transformers` module (`getattr(transformers, config.architectures[0])`), which a custom
architecture never is, with or without `--trust-remote-code` (the attribute lookup fails before any remote code
is read). This launcher imports the package, which registers `DiffConfig` and the model classes with transformers'
Auto classes (so no `--trust-remote-code` is needed), names the model classes on the `transformers` module, and
runs transformers' `serve` command with the given options. The server is transformers' own; on the way out the
launcher stops the continuous-batching manager, whose worker thread `transformers serve` leaves running after
Ctrl-C (the process would not exit), and exits with 0 after a Ctrl-C that stopped the server.
"""

import functools
import sys

import transformers

from .. import DiffForCausalLM, DiffForSequenceClassification, DiffModel


def serve_command() -> type:
    """transformers' `Serve` command, stopping its generation managers when the server returns."""
    from transformers.cli.serve import Serve

    class ServeAndStop(Serve):
        @functools.wraps(Serve.__init__)  # the command's options are read from this signature
        def __init__(self, *args, **kwargs):
            try:
                super().__init__(*args, **kwargs)  # serves until Ctrl-C / SIGTERM
            except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down: a normal stop
                if getattr(self, "server", None) is None:
                    raise
            finally:
                if getattr(self, "_generation_state", None) is not None:
                    self._generation_state.shutdown()

    return ServeAndStop


def main(argv: list[str] | None = None) -> None:
    """Run `transformers serve` with `argv` (default: this process's arguments) on DIFF folders."""
    from huggingface_hub import typer_factory
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise SystemExit("transformers serve needs its serving extras: pip install 'diff-transformer[serving]'")
    for model_class in (DiffForCausalLM, DiffModel, DiffForSequenceClassification):
        setattr(transformers, model_class.__name__, model_class)  # where `transformers serve` looks a class up
    app = typer_factory(help="transformers serve on DIFF Transformer folders")
    app.command(name="serve")(serve_command())
    app(args=["serve", *(sys.argv[1:] if argv is None else argv)], prog_name="transformers")


if __name__ == "__main__":
    main()
