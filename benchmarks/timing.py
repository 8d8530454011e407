"""How the benchmarks time: the sides of a comparison in rounds (each side once per round, in turn, A B B A ...) after
untimed warm-up rounds; in a process group each round's figures the slowest rank's; the median over rounds."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

Record = dict[str, Any]
Side = Callable[[int], Mapping[str, Any] | None]  # one round of a side (its index); what it returns joins the record


@contextlib.contextmanager
def clock(device: Any = None) -> Iterator[Record]:
    """The block's seconds, filled in when it ends: ``wall``, ``cpu`` (this process, all its threads) and ``thread``
    (this thread's CPU time); on a CUDA ``device`` synchronized at both ends."""
    import torch

    synchronize = torch.cuda.synchronize if device is not None and device.type == "cuda" else lambda: None
    seconds: Record = {}
    synchronize()
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    yield seconds
    synchronize()
    seconds |= {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    seconds["thread"] = time.thread_time() - thread


def rounds(sides: Mapping[str, Side], warmup: int, iters: int, *, alternate: bool = True, device: Any = None,
           memory: bool = False, barrier: bool = False, timed: bool = True) -> dict[str, list[Record]]:  # fmt: skip
    """``warmup`` untimed rounds, then ``iters`` measured ones; per side each measured round's record: its ``clock``
    seconds, with ``memory`` ``StepMemory``'s ``growth``, ``peak`` and ``before``, and what the side returned.
    ``alternate``: A B B A (else A B A B); ``barrier``: the ranks start each round together (outside the clock);
    ``timed`` false: no clock (sides that time themselves)."""
    import torch
    import torch.distributed as dist

    from lctrain.train.meter import StepMemory

    names = list(sides)
    records: dict[str, list[Record]] = {name: [] for name in names}
    for index in range(warmup + iters):
        for name in names[::-1] if alternate and index % 2 else names:
            with contextlib.ExitStack() as stack:
                used = stack.enter_context(StepMemory(device or torch.device("cpu"), collect=True)) if memory else None
                if barrier:
                    dist.barrier()
                with clock(device) if timed else contextlib.nullcontext({}) as seconds:
                    returned = sides[name](index)
            if index >= warmup:
                record = {**seconds, **(returned if isinstance(returned, Mapping) else {})}
                if used is not None:
                    record |= {"growth": used.growth, "peak": used.peak, "before": used.before}
                records[name].append(record)
    return records


def median_seconds(fn: Callable[[], None], iters: int, device: Any = None) -> float:
    """Median wall seconds of ``fn()`` over ``iters`` runs after one warm-up (on a CUDA ``device``, synchronized); in
    a process group, of each run's slowest rank."""
    import torch.distributed as dist

    measured = rounds({"fn": lambda _: fn()}, 1, iters, device=device)
    return median((gathered_slowest(measured) if dist.is_initialized() else measured)["fn"], "wall")


def slowest(per_rank: Sequence[Sequence[Record]]) -> list[Record]:
    """Round by round, each figure's largest over the ranks (``ok`` when every rank's is, the first ``error``)."""

    def over_ranks(key: str, values: list[Any]) -> Any:
        if key in ("ok", "error"):
            return all(values) if key == "ok" else next((value for value in values if value), None)
        return None if any(value is None for value in values) else max(values)

    return [
        {key: over_ranks(key, [r.get(key) for r in same]) for key in same[0]} for same in zip(*per_rank, strict=True)
    ]


def median(records: Sequence[Record], key: str) -> float:
    """The median of ``key`` over ``records``."""
    return statistics.median(record[key] for record in records)


def gathered_slowest(records: dict[str, list[Record]]) -> dict[str, list[Record]]:
    """``slowest`` over the ranks of the default process group, inside the ranks (every rank gets it)."""
    import torch.distributed as dist

    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, records)
    return {name: slowest([rank[name] for rank in per_rank]) for name in records}
