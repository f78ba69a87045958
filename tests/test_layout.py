"""The tests' layout: test modules hold tests; what several of them share lives in the helpers package
(tests/helpers/), the scripts they launch on several processes in tests/workers/. A test module that imports another
runs that module's tests' setup at import and ties the two files' names together, so none may."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Besides test modules, the only files at the top of tests/: pytest's hooks, and the documented fault command
# (`python tests/faults.py`, run by .ci/run).
TOP_LEVEL = {"conftest.py", "faults.py"}


def imported_modules(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports, anywhere in it (also inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_imported_modules_sees_nested_imports(tmp_path):
    script = tmp_path / "test_example.py"
    script.write_text("import os\nfrom helpers.folders import x\n\ndef f():\n    from test_other import y\n")
    assert imported_modules(script) == {"os", "helpers", "test_other"}


def test_no_test_module_imports_another():
    test_modules = sorted(TESTS.rglob("test_*.py"))
    found = [f"{path.relative_to(TESTS)} imports {name}" for path in test_modules
             for name in sorted(imported_modules(path)) if name.startswith("test_")]
    assert not found, "move what they share into tests/helpers/: " + "; ".join(found)


def test_shared_code_lives_in_the_helpers_package():
    loose = sorted(path.name for path in TESTS.glob("*.py") if not path.name.startswith("test_")
                   and path.name not in TOP_LEVEL)
    assert not loose, f"modules at the top of tests/ that are not test modules: {loose}; move them to tests/helpers/"
    assert (TESTS / "helpers" / "__init__.py").is_file()
