"""What CPU memory measurements share beyond a step's figures (``lctrain.train.meter``): the glibc setting they run
under, and a watchdog that ends a step past its budget."""

from __future__ import annotations

import contextlib
import ctypes
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


def follow_malloc_env() -> None:
    """In a forked rank (``lctrain.testing.run_distributed``), whose allocator started before ``malloc_env`` set the
    variable: apply it as a spawned rank's glibc would."""
    if threshold := os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        ctypes.CDLL(None).mallopt(-3, int(threshold))  # -3: M_MMAP_THRESHOLD


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
