"""Every benchmark and example imports cleanly: they use lctrain's public names and the package's shared modules
(``benchmarks/sides.py``, ``benchmarks/runs.py``, ``benchmarks/report.py``, ...), so a change in the library that
breaks one fails here and not months later on a GPU. Their figures are produced by running them
(``docs/benchmarks.md``), never in tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
