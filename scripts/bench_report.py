"""What every benchmark report prints: a markdown table and the machine it ran on."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

import torch


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
        f"{os.cpu_count()} CPU cores ({model}), torch {torch.__version__}, "
        f"transformers {importlib.metadata.version('transformers')}, python {platform.python_version()}, "
        f"load average at start {load}"
    )
