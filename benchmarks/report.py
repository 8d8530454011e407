"""What every benchmark's report shares: its flags, the command and machine lines, the markdown table and a
least-squares line. No torch here: the drivers of the fresh-process benchmarks only format reports."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from argparse import RawDescriptionHelpFormatter as RawDescription
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

MIB, GIB = 2**20, 2**30
# the flags several benchmarks share: their settings but the default
FLAGS = {
    "device": {"choices": ("cpu", "cuda"), "help": "where it runs"},
    "warmup": {"type": int, "help": "untimed rounds"},
    "iters": {"type": int, "help": "timed rounds (the figure: their median)"},
    "steps": {"type": int, "help": "timed steps of each side"},
    "heads": {"type": int, "help": "query heads"},
    "kv_heads": {"type": int, "help": "key/value heads (GQA when fewer than --heads)"},
    "head_dim": {"type": int, "help": "head dimension"},
    "json": {"metavar": "PATH", "help": "also write the figures as JSON"},
}


def command() -> str:
    """This run's command line: ``python -m benchmarks.NAME ARGS`` (the module run as ``__main__``)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return shlex.join(["python", *program, *sys.argv[1:]])


class OnDevice(NamedTuple):
    """A flag's default on CPU and on CUDA (``--device``), and its help."""

    cpu: Any
    cuda: Any
    help: str | None = None


class Parser(argparse.ArgumentParser):
    """``arguments``' parser: each flag of ``by_device`` (name: (CPU, CUDA)) left unset takes its default for
    ``--device``."""

    by_device: dict[str, tuple[Any, Any]]

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:
        parsed = super().parse_args(*args, **kwargs)
        for key, values in self.by_device.items():
            if getattr(parsed, key) is None:
                setattr(parsed, key, values[parsed.device == "cuda"])
        return parsed


def arguments(doc: str | None, **flags: Any) -> Parser:
    """A benchmark's parser. ``flags``: name=default or (default, help), of the default's type (a list: ``nargs="+"``;
    False: a switch), or ``OnDevice``; the shared ``FLAGS`` by name and default."""
    made = Parser(description=doc, epilog="The method: docs/benchmarks.md.", formatter_class=RawDescription)
    made.by_device = {}
    for name, value in flags.items():
        if isinstance(value, OnDevice):
            made.by_device[name] = value[:2]
            default, text = value.cpu, f"{value.help or FLAGS[name]['help']} (CPU {value.cpu}, CUDA {value.cuda})"
        else:
            default, text = value if isinstance(value, tuple) else (value, None)
        if name in FLAGS and text is None:
            kind = FLAGS[name]
        elif default is False:
            kind = {"action": "store_true", "help": text}
        else:
            many = isinstance(default, list)
            kind = {"type": type(default[0] if many else default), "nargs": "+" if many else None, "help": text}
        default = None if name in made.by_device else default
        made.add_argument(f"--{name.replace('_', '-')}", default=default, **kind)
    return made


def listed(kind: type = str, choices: Sequence[Any] | None = None) -> Any:
    """An argparse ``type``: a comma-separated list of ``kind``, each one of ``choices`` when given."""

    def parse(text: str) -> list[Any]:
        values = [kind(item.strip()) for item in text.split(",") if item.strip()]
        unknown = sorted(set(values) - set(choices or values))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(map(str, choices))}")
        return values

    return parse


def commit() -> str:
    """The checkout's commit, short."""
    git = ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]
    with contextlib.suppress(OSError):  # no git
        return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown commit"
    return "unknown commit"


def heading() -> str:
    """A report's first line: its command, the commit and the machine."""
    return f"`{command()}` at {commit()}; {machine_line()}"


def title(name: str) -> str:
    """A markdown report's first lines: its title, the command at its commit, the machine."""
    return f"# {name}\n\n- command: `{command()}` at {commit()}\n- machine: {machine_line()}"


def progress(text: str) -> None:
    """A line of progress on stderr (stdout is the report)."""
    print(text, file=sys.stderr, flush=True)


def save_json(path: str | None, **figures: Any) -> None:
    """``--json``: write the command and ``figures`` to ``path``, when given (again after each part: a run stopped by
    a timeout keeps what it measured)."""
    if path:
        Path(path).write_text(json.dumps({"command": command(), **figures}, indent=1))


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def machine_line() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor()
    )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} CPU cores ({model}), torch {importlib.metadata.version('torch')}, "
        f"transformers {importlib.metadata.version('transformers')}, python {platform.python_version()}, "
        f"load average at start {load}"
    )


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = intercept + slope × x`` (two distinct ``xs`` at least): (intercept, slope)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    return mean_y - slope * mean_x, slope
