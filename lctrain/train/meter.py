"""What one training step measures, the one implementation the trainer's metrics line and the benchmarks share: its
time, tokens/s, MFU (FLOPs per token: ``lctrain.flops``) and the memory it reached, its peak reset at its start.

Memory on CUDA is ``torch.cuda``'s allocated bytes (``max_memory_allocated``, reset by ``reset_peak_memory_stats``)
and the caching allocator's reserved bytes. On CPU, which has no allocator statistics, it is the process's resident
set: its high-water mark ``VmHWM`` is reset to the current resident set by writing ``5`` to
``/proc/self/clear_refs`` (Linux) at the start of the step and read at its end; where that file cannot be written,
the peak is the process's since it started (``getrusage``).
"""

from __future__ import annotations

import contextlib
import gc
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lctrain.flops import mfu

GIB = 2**30
# Dense bf16 peak FLOP/s of GPUs we know, by a substring of the device name.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """The device's peak FLOP/s for the MFU estimate: the configured one, or a known GPU's; None if unknown."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _PEAK_FLOPS.items():
            if key in name:
                return flops
    return None


def proc_bytes(key: str, path: str = "/proc/self/status") -> int:
    """The figure ``key`` (given in kB) of a ``/proc`` file such as ``status``, ``smaps_rollup`` or ``meminfo``."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{key} not in {path}")


def reset_resident_peak() -> bool:
    """Reset this process's resident-set high-water mark (VmHWM) to its resident set; False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class StepMemory:
    """Around one step: ``before`` (bytes in use when it starts), ``peak`` (the most in use during it), ``growth``
    (peak − before) and ``reserved`` (CUDA: the caching allocator's peak; None on CPU). ``collect``: collect garbage
    first, so that cyclic garbage freed later does not count in ``before`` (the benchmarks)."""

    def __init__(self, device: torch.device, *, collect: bool = False):
        self.device, self.collect = device, collect
        self.reserved: int | None = None

    def __enter__(self) -> StepMemory:
        if self.collect:
            gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            self.resets = reset_resident_peak()
            self.before = proc_bytes("VmRSS") if self.resets else 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserved = torch.cuda.max_memory_reserved(self.device)
        elif self.resets:
            self.peak = proc_bytes("VmHWM")
        else:
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        self.growth = self.peak - self.before


class StepMeter:
    """The figures of each training step of a job: ``tokens`` per step (all ranks), ``per_token`` FLOPs
    (``lctrain.families.model_flops_per_token``), the ``peak`` FLOP/s of one of its ``devices`` (``peak_flops``)."""

    def __init__(self, device: torch.device, *, tokens: int, per_token: float, peak: float | None, devices: int):
        self.device, self.tokens, self.per_token, self.peak, self.devices = device, tokens, per_token, peak, devices

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict[str, float | None]]:
        """Around one step; the dict it gives is filled when the step ends: ``tokens_per_s``, ``mfu``,
        ``peak_mem_gib`` (this rank's peak during the step) and ``step_time_s``."""
        figures: dict[str, float | None] = {}
        with StepMemory(self.device) as memory:
            started = time.perf_counter()
            yield figures
            elapsed = time.perf_counter() - started
        tokens_per_s = self.tokens / elapsed
        figures["tokens_per_s"] = tokens_per_s
        figures["mfu"] = mfu(tokens_per_s, self.per_token, self.peak, self.devices)
        figures["peak_mem_gib"] = memory.peak / GIB
        figures["step_time_s"] = elapsed
