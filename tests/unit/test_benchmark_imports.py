"""Every benchmark and example imports cleanly: they use lctrain's public names and the shared benchmark modules
(``benchmarks/harness.py``, ``benchmarks/report.py``), so a change in the library that breaks one fails here and
not months later on a GPU. Their figures are produced by running them (``docs/benchmarks.md``), never in tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_benchmarks_and_examples_import() -> None:
    scripts = sorted((REPO / "benchmarks").glob("*.py")) + sorted((REPO / "examples").glob("*.py"))
    assert len(scripts) >= 10
    program = "import importlib.util, sys\n"
    for index, script in enumerate(scripts):
        program += (
            f"sys.path.insert(0, {str(script.parent)!r})\n"
            f"spec = importlib.util.spec_from_file_location('script_{index}', {str(script)!r})\n"
            f"module = sys.modules['script_{index}'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "sys.path.pop(0)\n"
        )
    result = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
