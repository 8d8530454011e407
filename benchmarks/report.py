"""What the benchmarks share: the markdown table and machine line every report prints, and synthetic batches."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from lctrain.data import IGNORE_INDEX


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


def one_document_batch(input_ids: Tensor, shard: Callable[[Tensor], Tensor] = lambda x: x) -> dict:
    """A trainer micro-batch of the full rows ``input_ids`` ``[B, S]``, one document per row: labels shifted on the
    global row (the last token predicts nothing), positions 0..S-1, cut to this rank's part by ``shard``."""
    batch, seq = input_ids.shape
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return {
        "input_ids": shard(input_ids),
        "labels": shard(labels),
        "position_ids": shard(torch.arange(seq).expand(batch, seq)),
        "cu_seqlens": [torch.tensor([0, seq], dtype=torch.int32) for _ in range(batch)],
    }
