"""Every benchmark and example imports cleanly: they use lctrain's public names and the package's shared modules
(``benchmarks/sides.py``, ``benchmarks/runs.py``, ``benchmarks/report.py``, ...), so a change in the library that
breaks one fails here and not months later on a GPU. Their figures are produced by running them
(``docs/benchmarks.md``), never in tests.

What the benchmarks and the tests share lives in ``testbed/``: the benchmarks import nothing from ``tests``, the
tests' shared helpers nothing from ``benchmarks`` (a test of a benchmark may import it), and ``testbed`` neither."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_benchmarks_and_examples_import() -> None:
    modules = [f"benchmarks.{path.stem}" for path in sorted((REPO / "benchmarks").glob("*.py"))]
    examples = sorted((REPO / "examples").glob("*.py"))
    assert len(modules) >= 10
    program = "import importlib, importlib.util, sys\n"
    program += "".join(f"importlib.import_module({name!r})\n" for name in modules)
    for index, script in enumerate(examples):
        program += (
            f"spec = importlib.util.spec_from_file_location('example_{index}', {str(script)!r})\n"
            f"module = sys.modules['example_{index}'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
        )
    result = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def imported_packages(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (absolute imports, at any depth of the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize(
    "folder,forbidden",
    [("benchmarks", {"tests"}), ("tests/helpers", {"benchmarks"}), ("testbed", {"tests", "benchmarks"})],
)
def test_shared_pieces_are_imported_from_testbed(folder: str, forbidden: set[str]) -> None:
    offenders = {
        path.relative_to(REPO).as_posix(): sorted(imported_packages(path) & forbidden)
        for path in sorted((REPO / folder).rglob("*.py"))
    }
    assert not {path: names for path, names in offenders.items() if names}
