"""The package's layers: every import goes down (or stays on its floor), none goes up, none closes a circle; the
bottom floor, `saved_folder.py`, imports the standard library only; and the command line answers a missing or broken
model folder, for every command that takes one, before torch or transformers are imported."""

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "diff_transformer"
# The floors, lowest first: a module may import from its own floor and those below. A flat module of the package
# that no floor names (a part of the model beside modeling_diff.py) sits on the lowest floor its imports allow.
FLOORS = (
    ("standard library", {"diff_transformer._version", "diff_transformer.saved_folder"}),
    ("configuration", {"diff_transformer.configuration_diff", "diff_transformer.tokenization_diff",
                       "diff_transformer.folder_defaults", "diff_transformer.diff_tensor_parallel",
                       "diff_transformer.peft_defaults", "diff_transformer.kernel_common",
                       "diff_transformer.kernel_tiles", "diff_transformer.kernel_naive",
                       "diff_transformer.paged_cache"}),
    ("kernels", {"diff_transformer.kernel_tiled", "diff_transformer.kernel_diff_flash",
                 "diff_transformer.attention_kernels"}),
    ("model", {"diff_transformer", "diff_transformer.modeling_diff", "diff_transformer.multihead_diffattn"}),
    ("serving", {"diff_transformer.serving"}),  # and its modules
    ("tools", {"diff_transformer.tools"}),
    ("command line", {"diff_transformer_cli", "hub_upload"}),
)
SUBPACKAGES = ("diff_transformer.serving", "diff_transformer.tools")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the package and the command line's two scripts, by dotted name."""
    paths = [*sorted((ROOT / PACKAGE).rglob("*.py")), ROOT / "diff_transformer_cli.py", ROOT / "hub_upload.py"]
    return {module_name(path): path for path in paths}


def floor(module: str, seen: frozenset[str] = frozenset()) -> int:
    for index, (_, members) in enumerate(FLOORS):
        if module in members:
            return index
    for subpackage in SUBPACKAGES:
        if module.startswith(subpackage + "."):
            return floor(subpackage)
    assert module.count(".") == 1 and module.startswith(PACKAGE + "."), f"{module} is on no floor: add it to FLOORS"
    below = import_graph()[module] - seen  # a circle among such modules is test_no_import_cycles's to report
    return max((floor(target, seen | {module}) for target in below), default=0)


def imported_names(path: Path, module: str) -> set[str]:
    """The absolute names of what `path` imports, at its top or inside a function: `from P import n` as P.n where
    that is a module, else P."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            names.update(f"{source}.{alias.name}" for alias in node.names)
            names.add(source)
    return names


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (a package's `__init__` under the package's name)."""
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        graph[module] = {name for name in imported_names(path, module) if name in modules} - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports():
    """The parser finds relative, absolute and in-function imports (a graph of nothing would pass every check)."""
    graph = import_graph()
    assert "diff_transformer.configuration_diff" in graph["diff_transformer.modeling_diff"]
    assert "diff_transformer.saved_folder" in graph["diff_transformer.configuration_diff"]
    assert "diff_transformer.tools.hub_upload" in graph["diff_transformer.tools.commands"]  # inside a function
    assert "diff_transformer" in graph["diff_transformer.tools.commands"]  # `from .. import DiffConfig`
    assert "diff_transformer_cli" in graph["hub_upload"]
    assert "diff_transformer.tokenization_diff" in graph["diff_transformer_cli"]


def test_no_upward_imports():
    upward = [f"{module} ({FLOORS[floor(module)][0]}) -> {target} ({FLOORS[floor(target)][0]})"
              for module, targets in sorted(import_graph().items()) for target in sorted(targets)
              if floor(target) > floor(module)]
    assert not upward, "imports from a floor above:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    edges = [f"{a} -> {b}" for component in found for a in component for b in sorted(graph[a]) if b in component]
    assert not found, f"import cycles {found}; their edges:\n" + "\n".join(edges)


def test_the_bottom_floor_imports_the_standard_library_only():
    for module in FLOORS[0][1]:
        path = project_modules()[module]
        outside = sorted(name for name in imported_names(path, module)
                         if name.split(".")[0] not in sys.stdlib_module_names)
        assert not outside, f"{path.name} imports beyond the standard library: {outside}"


def folder(root: Path, name: str, config: dict | str | None = None, files: tuple[str, ...] = ()) -> str:
    """A folder `name` with config.json (a dict as JSON, a str as it is; None: none) and empty `files`."""
    path = root / name
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for file in files:
        (path / file).write_text("{}")
    return str(path)


COMPLETE = ("tokenizer.json", "model.safetensors")
# fault: (the folder, a fragment of the answer, which commands refuse it: "all", "diff" (those that take a DIFF
# model only) or "files" (all that load the folder's own tokenizer and weights: all but convert))
FAULTS = {
    "missing": (lambda d: str(d / "typo"), "no such folder: {d}/typo ({d}/typo does not exist)", "all"),
    "a-file": (lambda d: folder(d, "parent", None, ("file.txt",)) + "/file.txt",
               "{d}/parent/file.txt is a file, not a folder", "all"),
    "adapter-only": (lambda d: folder(d, "adapter", None, ("adapter_config.json",)),
                     "{d}/adapter holds a PEFT adapter (adapter_config.json), not a model; merge it", "all"),
    "no-config": (lambda d: folder(d, "empty"), "{d}/empty has no config.json, so it is no saved model folder", "all"),
    "config-not-json": (lambda d: folder(d, "broken", '{"model_type": "diff_transformer",', COMPLETE),
                        "{d}/broken/config.json is not valid JSON: Expecting property name", "all"),
    "no-model-type": (lambda d: folder(d, "typeless", {"vocab_size": 9}, COMPLETE),
                      '{d}/typeless/config.json has no "model_type"; restore', "all"),
    "other-model": (lambda d: folder(d, "llama", {"model_type": "llama"}, COMPLETE),
                    "{d}/llama holds a 'llama' model, not a DIFF Transformer ('diff_transformer'); convert it first",
                    "diff"),
    "no-tokenizer": (lambda d: folder(d, "no-tokenizer", {"model_type": "diff_transformer"}, ("model.safetensors",)),
                     "{d}/no-tokenizer has no tokenizer (tokenizer.json", "files"),
    "no-weights": (lambda d: folder(d, "no-weights", {"model_type": "diff_transformer"}, ("tokenizer.json",
                                                                                          "pytorch_model.bin")),
                   "{d}/no-weights has no safetensors weights (only the pickled pytorch_model.bin", "files"),
}
COMMANDS = {  # command: (its arguments around the folder F, whether it takes a DIFF model only)
    "generate": (["generate", "F", "--prompt", "x"], True),
    "convert": (["convert", "F", "out"], False),
    "upload": (["upload", "F", "user/model", "--dry-run"], True),
    "serve": (["serve", "F"], True),
    "eval-needle": (["eval-needle", "F"], False),
    "attention-noise": (["attention-noise", "F"], True),
    "outliers": (["outliers", "F"], True),
}


def refused(fault: str, command: str) -> bool:
    scope, (_, diff) = FAULTS[fault][2], COMMANDS[command]
    return scope == "all" or (scope == "diff" and diff) or (scope == "files" and command != "convert")


CASES = [(fault, command) for fault in FAULTS for command in COMMANDS if refused(fault, command)]


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> tuple[Path, dict]:
    """Every refused (fault, command) run in one fresh interpreter: {(fault, command): (exit status, last line of
    stderr, whether torch or transformers was imported by then)}."""
    root = tmp_path_factory.mktemp("folders")
    folders = {fault: make(root) for fault, (make, _, _) in FAULTS.items()}
    cases = [(fault, command, [folders[fault] if a == "F" else a for a in COMMANDS[command][0]])
             for fault, command in CASES]
    code = f"""
import contextlib, io, json, sys
import diff_transformer_cli
results = []
for fault, command, arguments in {cases!r}:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            diff_transformer_cli.main(arguments)
            status = 0
        except SystemExit as stop:
            status = stop.code
    heavy = sorted({{"torch", "transformers"}} & set(sys.modules))
    results.append([fault, command, status, (err.getvalue().strip().splitlines() or [""])[-1], heavy])
print(json.dumps(results))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    return root, {(fault, command): (status, line, heavy) for fault, command, status, line, heavy in rows}


@pytest.mark.parametrize("fault, command", CASES, ids=[f"{command}-{fault}" for fault, command in CASES])
def test_a_bad_folder_is_answered_without_torch(answers, fault, command):
    root, found = answers
    status, line, heavy = found[fault, command]
    assert status == 2 and line.startswith(f"diff-transformer {command}: error: "), (status, line)
    assert FAULTS[fault][1].format(d=root) in line, line
    assert not heavy, f"{command} imported {heavy} before answering: {line}"
