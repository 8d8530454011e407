"""What the benchmarks share: the markdown table and machine line every report prints, synthetic batches, and the
resident-set peak that stands for device memory on CPU. torch is imported where a function needs it: the GPU
benchmarks' driver processes only format reports."""

from __future__ import annotations

import gc
import importlib.metadata
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


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


def one_document_batch(input_ids: Tensor, shard: Callable[[Tensor], Tensor] = lambda x: x) -> dict:
    """A trainer micro-batch of the full rows ``input_ids`` ``[B, S]``, one document per row: labels shifted on the
    global row (the last token predicts nothing), positions 0..S-1, cut to this rank's part by ``shard``."""
    import torch

    from lctrain.data import IGNORE_INDEX

    batch, seq = input_ids.shape
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    return {
        "input_ids": shard(input_ids),
        "labels": shard(labels),
        "position_ids": shard(torch.arange(seq).expand(batch, seq)),
        "cu_seqlens": [torch.tensor([0, seq], dtype=torch.int32) for _ in range(batch)],
    }


def document_lengths(seq: int, doc_len: int) -> list[int]:
    """The documents of a packed row of ``seq`` tokens cut every ``doc_len`` tokens (the last one shorter if
    ``doc_len`` does not divide ``seq``)."""
    return [min(doc_len, seq - start) for start in range(0, seq, doc_len)]


def packed_batch(input_ids: Tensor, doc_len: int, shard: Callable[[Tensor], Tensor] = lambda x: x) -> dict:
    """A trainer micro-batch of the full rows ``input_ids`` ``[B, S]``, each packed with documents of ``doc_len``
    tokens (``document_lengths``): labels shifted within each document (a document's last token predicts nothing),
    positions restarting at 0 at each document start, cut to this rank's part by ``shard``."""
    import torch

    from lctrain.data import IGNORE_INDEX

    batch, seq = input_ids.shape
    lengths = document_lengths(seq, doc_len)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    labels[:, bounds[1:-1] - 1] = IGNORE_INDEX
    positions = torch.cat([torch.arange(length) for length in lengths]).expand(batch, seq)
    return {
        "input_ids": shard(input_ids),
        "labels": shard(labels),
        "position_ids": shard(positions),
        "cu_seqlens": [bounds.clone() for _ in range(batch)],
    }


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Collect garbage, reset the resident-set high-water mark (VmHWM) to the current RSS and return that RSS."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def peak_since_reset() -> int:
    """The resident-set high-water mark (VmHWM) in bytes, since the last ``reset_peak``."""
    return _status_bytes("VmHWM")
