"""How a checkpoint problem found by one rank becomes the same error on every rank (none is left waiting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def fix_hint(path: Path) -> str:
    return (
        f"resume from an earlier checkpoint (checkpoint.resume=<its directory>) or delete {path} "
        f"(checkpoint.resume=auto then takes the newest one left)"
    )


def config_hint(path: Path) -> str:
    config = path.parent.parent / "config.yaml"
    return f" (they are in {config})" if config.is_file() else ""


def all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# A problem found by one rank: (sort key, exception type name, message). Every rank raises the smallest one found.
Problem = tuple[tuple, str, str]
ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def raise_first(gathered: list[list[Problem]]) -> None:
    problems = sorted(problem for rank_problems in gathered for problem in rank_problems)
    if problems:
        _, kind, message = problems[0]
        if len(problems) > 1:
            message += f" ({len(problems) - 1} more problem(s) found in the same checkpoint)"
        raise ERRORS[kind](message)
