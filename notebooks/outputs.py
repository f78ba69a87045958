"""Execute the notebooks and keep their outputs, and check that stored outputs still match the code.

    python notebooks/outputs.py            # execute every notebook in a scratch folder, write its outputs in place
    python notebooks/outputs.py --check    # execute again and compare with the stored outputs (what CI does)

A notebook runs in a temporary working directory (its runs/ and PNG files land there), one thread, seeded in its
first cell; what it writes to stderr (progress bars, library warnings) is neither stored nor compared, and adjacent
stdout pieces count as one (the kernel sends a print in pieces when its flush timer fires mid-print, as on a loaded
machine). Stored and fresh outputs are compared cell by cell (`differences`): the same kinds of output; text equal
once numbers are taken out, and each number within NUMBER_TOLERANCE of the stored one (the notebooks train small
models on the CPU, and another torch release may round a loss or an accuracy differently in its last digits); an
image where the stored notebook has one, of the same size to within IMAGE_SIZE_TOLERANCE.
"""

import argparse
import base64
import math
import re
import struct
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = sorted(Path(__file__).resolve().parent.glob("*.ipynb"))
TIMEOUT_S = 300  # per cell
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
NUMBER_TOLERANCE = (0.05, 0.05)  # |fresh - stored| <= abs + rel * |stored|
IMAGE_SIZE_TOLERANCE = 0.02  # relative, per side in pixels
# timings, throughputs and addresses: not compared
VOLATILE = re.compile(r"'(?:train|eval)_(?:runtime|samples_per_second|steps_per_second)': '[^']*'"
                      r"|'eval_model_preparation_time': '[^']*'|\d+(?:\.\d+)? ?s\b|0x[0-9a-f]+")


def execute(path: Path, workdir: Path) -> nbformat.NotebookNode:
    """The notebook at `path`, executed top to bottom in `workdir`, without its stderr outputs (progress bars and
    library warnings, which name this machine's paths); CellExecutionError on any error."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=TIMEOUT_S, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(workdir)}}).execute()
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = joined_streams([o for o in cell.outputs
                                           if not (o["output_type"] == "stream" and o["name"] == "stderr")])
    return notebook


def joined_streams(outputs: list) -> list:
    """`outputs` with each run of adjacent stdout streams joined into one."""
    joined = []
    for output in outputs:
        if output["output_type"] == "stream" and joined and joined[-1]["output_type"] == "stream" \
                and joined[-1]["name"] == output["name"]:
            joined[-1] = nbformat.v4.new_output("stream", name=output["name"], text=joined[-1]["text"] + output["text"])
        else:
            joined.append(output)
    return joined


def output_text(output: dict) -> str:
    if output["output_type"] == "stream":
        return output["text"]
    return output.get("data", {}).get("text/plain", "") if output["output_type"] != "error" else output["evalue"]


def png_size(output: dict) -> tuple[int, int] | None:
    """(width, height) of an output's PNG image, None without one."""
    data = output.get("data", {}).get("image/png")
    if not data:
        return None
    header = base64.b64decode(data)[:24]
    return struct.unpack(">II", header[16:24])


def text_differences(stored: str, fresh: str) -> list[str]:
    stored, fresh = VOLATILE.sub("<t>", stored), VOLATILE.sub("<t>", fresh)
    if NUMBER.sub("<n>", stored) != NUMBER.sub("<n>", fresh):
        return [f"text changed: {stored.strip()[:200]!r} -> {fresh.strip()[:200]!r}"]
    problems = []
    absolute, relative = NUMBER_TOLERANCE
    for a, b in zip(NUMBER.findall(stored), NUMBER.findall(fresh)):
        if not math.isclose(float(a), float(b), rel_tol=relative, abs_tol=absolute):
            problems.append(f"number {a} -> {b}")
    return problems


def differences(stored: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> list[str]:
    """What differs between the stored outputs and a fresh execution, per code cell; empty when they match."""
    problems = []
    code = lambda nb: [c for c in nb.cells if c.cell_type == "code"]
    for index, (old, new) in enumerate(zip(code(stored), code(fresh), strict=True)):
        old_outputs, new_outputs = joined_streams(old.outputs), joined_streams(new.outputs)
        kinds = lambda outs: [(o["output_type"], png_size(o) is not None) for o in outs]
        if kinds(old_outputs) != kinds(new_outputs):
            problems.append(f"code cell {index}: outputs {kinds(old_outputs)} -> {kinds(new_outputs)}")
            continue
        for a, b in zip(old_outputs, new_outputs):
            problems += [f"code cell {index}: {p}" for p in text_differences(output_text(a), output_text(b))]
            if (size := png_size(a)) and not all(abs(x - y) <= IMAGE_SIZE_TOLERANCE * x
                                                 for x, y in zip(size, png_size(b))):
                problems.append(f"code cell {index}: image {size} -> {png_size(b)}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored outputs; write nothing")
    parser.add_argument("names", nargs="*", help="notebook file names (default: every notebook)")
    args = parser.parse_args()
    failed = False
    for path in [p for p in NOTEBOOKS if not args.names or p.name in args.names]:
        with tempfile.TemporaryDirectory() as workdir:
            fresh = execute(path, Path(workdir))
        if args.check:
            problems = differences(nbformat.read(path, as_version=4), fresh)
            failed |= bool(problems)
            print(f"{path.name}: " + ("outputs match" if not problems else "\n  ".join(["differs:", *problems])))
        else:
            nbformat.write(fresh, path)
            print(f"{path.name}: outputs written")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
