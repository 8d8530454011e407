"""The memory figures of a process beyond a step's (``lctrain.train.meter.StepMemory``): its resident set, its
proportional set size, what the machine has left; the glibc setting CPU measurements run under; a watchdog."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

# glibc serves buffers of 64 KiB or more with mmap and returns them to the OS when freed: the resident set then
# follows the live buffers (as torch.cuda's allocated bytes do) instead of keeping a heap's high-water mark
MALLOC_MMAP_THRESHOLD = "65536"
ABORT_EXIT_CODE = 3  # a process the watchdog ended


def proc_bytes(key: str, path: str = "/proc/self/status") -> int:
    """``lctrain.train.meter.proc_bytes`` (imported here: torch only in the processes that measure)."""
    from lctrain.train.meter import proc_bytes

    return proc_bytes(key, path)


def reset_peak() -> int:
    """Collect garbage, reset the resident-set high-water mark (VmHWM) to the current RSS and return that RSS."""
    from lctrain.train.meter import reset_resident_peak

    gc.collect()
    reset_resident_peak()
    return proc_bytes("VmRSS")


def pss() -> int:
    """This process's proportional set size: its private pages plus its share of pages it maps with others."""
    return proc_bytes("Pss", "/proc/self/smaps_rollup")


def available() -> int:
    """The memory the machine can give without swapping (``MemAvailable``)."""
    return proc_bytes("MemAvailable", "/proc/meminfo")


@contextlib.contextmanager
def malloc_env(*, for_memory: bool) -> Iterator[None]:
    """Processes started inside get ``MALLOC_MMAP_THRESHOLD_`` (memory measurements) or glibc's default (timings:
    the low threshold turns every large allocation into fresh page faults, which would time the allocator)."""
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ.update({"MALLOC_MMAP_THRESHOLD_": MALLOC_MMAP_THRESHOLD} if for_memory else {})
    try:
        yield
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        os.environ.update({} if saved is None else {"MALLOC_MMAP_THRESHOLD_": saved})


class BudgetWatchdog(threading.Thread):
    """Polls VmHWM while a step runs; past ``base + budget`` it writes ``marker`` (JSON: the growth seen) and ends
    the process with ``ABORT_EXIT_CODE``: the step cannot fit, and the rest of it would only cost time and memory."""

    def __init__(self, base: int, budget: int, marker: Path, interval_s: float = 0.005):
        super().__init__(daemon=True)
        self.base, self.budget, self.marker, self.interval_s = base, budget, marker, interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            if (growth := proc_bytes("VmHWM") - self.base) > self.budget:
                self.marker.write_text(json.dumps({"growth": growth}))
                os._exit(ABORT_EXIT_CODE)

    def __enter__(self) -> BudgetWatchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.join()


def aborted_growth(marker_dir: Path) -> int | None:
    """The largest growth a watchdog wrote under ``marker_dir`` (``rank*.json``), or None if none stopped a step."""
    return max((json.loads(m.read_text())["growth"] for m in marker_dir.glob("rank*.json")), default=None)
