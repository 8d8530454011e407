"""What every benchmark's report shares: the command that made it, the machine line, the markdown table and a
least-squares line through measured figures. No torch here: the drivers of the fresh-process benchmarks only format
reports."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def command() -> str:
    """This run's command line: ``python -m benchmarks.NAME ARGS`` (the module run as ``__main__``)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return shlex.join(["python", *program, *sys.argv[1:]])


def commit() -> str:
    """The checkout's commit, short."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        )
    except OSError:
        return "unknown commit"
    return out.stdout.strip() or "unknown commit"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def machine_line() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPU cores ({model}), torch {importlib.metadata.version('torch')}, "
        f"transformers {importlib.metadata.version('transformers')}, python {platform.python_version()}, "
        f"load average at start {load}"
    )


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = intercept + slope × x`` through two or more points with at least two distinct ``xs``;
    returns (intercept, slope)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    return mean_y - slope * mean_x, slope
