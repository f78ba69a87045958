"""CPU seconds of `diff-transformer --help` and of an argument error, beside the import of the package (torch +
transformers) that they no longer pay for (under 1 s of CPU). Each command runs in a fresh interpreter;
the figure is the median of --repeats runs' user + system time.

    python benchmarks/bench_cli.py [--repeats 5]
"""

import argparse
import resource
import statistics
import subprocess
import sys

COMMANDS = {
    "diff-transformer --help": ["-m", "diff_transformer_cli", "--help"],
    "diff-transformer train --help": ["-m", "diff_transformer_cli", "train", "--help"],
    "argument error (--learning-rate inf)": ["-m", "diff_transformer_cli", "train", "--learning-rate", "inf"],
    "import diff_transformer (reference)": ["-c", "import diff_transformer"],
}


def cpu_seconds(arguments: list[str]) -> float:
    """User + system CPU seconds of one `python arguments` run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, *arguments], capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times = {name: statistics.median(cpu_seconds(argv) for _ in range(args.repeats)) for name, argv in COMMANDS.items()}
    reference = times["import diff_transformer (reference)"]
    print("| command | CPU s (median) | vs import |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.2f} | {seconds / reference:.2f}x |")


if __name__ == "__main__":
    main()
