"""Sides (``sides.py``) of jobs trained step by step in processes of their own, each step measured
(``docs/benchmarks.md``); on CPU the glibc setting of memory runs, and a watchdog that ends a step past its budget; the
longest sequence that fits, found by such runs (``Search``)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.jobs import process_env
from benchmarks.timing import clock, rounds, slowest

OUT_OF_MEMORY = "out of memory"
STOPPED = {"ok": False, "error": "over budget, stopped", "aborted": True}
Steps = list[tuple[int, int]]  # (seq, seed) of each step
Specs = dict[str, dict[str, Any]]
# glibc serves buffers of 64 KiB or more with mmap and returns them to the OS when freed: the resident set then
# follows the live buffers (as torch.cuda's allocated bytes do) instead of keeping a heap's high-water mark
MALLOC_MMAP_THRESHOLD = "65536"
ABORT_EXIT_CODE = 3  # a process the watchdog ended


@contextlib.contextmanager
def malloc_env(*, for_memory: bool) -> Iterator[None]:
    """Processes started inside get ``MALLOC_MMAP_THRESHOLD_`` (memory) or glibc's default (timings: the low
    threshold turns every large allocation into fresh page faults)."""
    with mock.patch.dict(os.environ):  # this process's environment as it was, afterwards
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        os.environ.update({"MALLOC_MMAP_THRESHOLD_": MALLOC_MMAP_THRESHOLD} if for_memory else {})
        yield


def follow_malloc_env() -> None:
    """In a forked rank (``lctrain.testing.run_distributed``): apply ``malloc_env``'s setting as glibc would."""
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
        from lctrain.train.meter import proc_bytes  # torch only in the processes that measure

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


def with_run_dirs(specs: Specs, directory: str) -> Specs:
    """``specs`` with each side's trainer writing under ``directory`` (a directory of its own)."""
    return {name: spec | {"job": [*spec["job"], f"train.run_dir={directory}/side{i}"]} for i, (name, spec) in
            enumerate(specs.items())}  # fmt: skip


class Measured:
    """The sides of ``specs`` in this process, each step measured; past its budget the watchdog writes ``marker``."""

    def __init__(self, specs: Specs, marker: Path | None = None):
        import torch

        from benchmarks.sides import HFSide, LctrainSide
        from lctrain.config import load_config
        from lctrain.runtime import init_distributed, resolve_device
        from lctrain.train.meter import proc_bytes

        if threads := next(iter(specs.values())).get("threads"):
            torch.set_num_threads(threads)
        configs = {name: load_config(spec["job"]) for name, spec in specs.items()}
        cfg, self.marker = next(iter(configs.values())), marker
        self.device = resolve_device(cfg.train.device)
        gc.collect()  # what is in use before the sides are built: the runtime (CPU resident set), leftovers
        cuda = self.device.type == "cuda"
        self.base = torch.cuda.memory_allocated(self.device) if cuda else proc_bytes("VmRSS")
        if any(spec["side"] == "lctrain" for spec in specs.values()):  # a process group of one, as `lctrain train`
            init_distributed(self.device, timeout_s=1800, host_collectives=cfg.parallel.cpu_offload)
        build = {"lctrain": LctrainSide, "hf": HFSide}
        self.sides = {name: build[spec["side"]](configs[name], spec) for name, spec in specs.items()}

    def describe(self, name: str) -> dict[str, Any]:
        """The device, its dense bf16 peak FLOP/s (None on CPU), the allocator setting, the model's sizes."""
        import torch

        from lctrain.train.meter import peak_flops

        side, params = self.sides[name], list(self.sides[name].model.parameters())
        model = {"params": sum(p.numel() for p in params), "trained": sum(p.numel() for p in params if p.requires_grad),
                 "layers": side.hf_config.num_hidden_layers, "hidden": side.hf_config.hidden_size}  # fmt: skip
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"ok": True, "error": None, "device_name": device_name, "peak_flops": peak_flops(self.device, None),
                "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "model": model}  # fmt: skip

    def step(self, name: str, seq: int, seed: int, *, budget: int | None = None) -> dict[str, Any]:
        """One step of side ``name`` on rows of ``seq`` tokens (``seed``), stopped past ``budget`` bytes of peak."""
        import torch.distributed as dist

        from lctrain.train.meter import StepMemory, proc_bytes

        side = self.sides[name]
        batch = side.batch(seq, seed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the ranks' steps start together
        with StepMemory(self.device, collect=True) as peak:
            pss_before = proc_bytes("Pss", "/proc/self/smaps_rollup") if self.device.type == "cpu" else None
            watchdog = budget and BudgetWatchdog(peak.before, budget, self.marker)
            with watchdog or contextlib.nullcontext(), clock(self.device) as seconds:
                figures = side.step(batch)
        in_use = figures.pop("in_use", None)
        return {"ok": True, "error": None, "seq": seq, "step_s": seconds["wall"], "cpu_s": seconds["cpu"], **figures,
                "kept": None if in_use is None else in_use - peak.before, "before": peak.before,
                "pss_before": pss_before, "step_peak": peak.growth, "peak": peak.peak - self.base, "base": self.base,
                "reserved": peak.reserved}  # fmt: skip

    def profile(self, name: str, seq: int, seed: int, top: int) -> dict[str, Any]:
        """One step of side ``name`` under ``torch.profiler``: the ``top`` kernels (CPU: operators), FSDP2's share."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        side, cuda, kinds = self.sides[name], self.device.type == "cuda", torch.autograd.DeviceType
        batch = side.batch(seq, seed)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            started = time.perf_counter()
            side.step(batch)
            wall_us = (time.perf_counter() - started) * 1e6
        events = prof.events()
        fsdp = _outermost([e for e in events if e.device_type == kinds.CPU], "FSDP::")
        result: dict[str, Any] = {"wall_ms": wall_us / 1e3, "fsdp_host_ms": sum(e.cpu_time_total for e in fsdp) / 1e3}
        result["fsdp_host_share"] = result["fsdp_host_ms"] * 1e3 / wall_us
        kernels: dict[str, list[float]] = {}
        for event in (e for e in events if e.device_type == kinds.CUDA):
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
        totals = {name: (sum(times), len(times)) for name, times in kernels.items()}
        totals = totals if cuda else {a.key: (a.self_cpu_time_total, a.count) for a in prof.key_averages()}
        total_us = sum(us for us, _ in totals.values())
        if cuda:
            result |= {"kernel_ms": total_us / 1e3, "fsdp_kernel_ms": sum(e.device_time_total for e in fsdp) / 1e3}
            result["fsdp_kernel_share"] = result["fsdp_kernel_ms"] * 1e3 / total_us if total_us else None
        ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
        return result | {"top": [(name, us / 1e3, count, us / total_us) for name, (us, count) in ranked]}


def _outermost(events: list, prefix: str) -> list:
    """The profiler's ranges named ``prefix...`` that lie inside no other such range."""
    outer = []
    for event in (e for e in events if e.name.startswith(prefix)):
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(prefix):
            parent = parent.cpu_parent
        if parent is None:
            outer.append(event)
    return outer


def serve(specs: Specs, marker: Path, conn: Connection) -> None:
    """The fresh process of a ``Run``: build the sides, then answer each request on ``conn`` (``Measured.step``, or
    with ``top`` ``Measured.profile``) until the parent closes it; an error is answered and ends the process."""
    import torch
    import torch.distributed as dist

    try:
        with contextlib.redirect_stdout(sys.stderr):  # the parent's stdout is its report
            measured = Measured(specs, marker)
            conn.send({"ok": True, "error": None, "sides": {name: measured.describe(name) for name in specs}})
            while True:  # until the parent closes its end: EOFError
                request = conn.recv()
                try:
                    conn.send(measured.profile(**request) if "top" in request else measured.step(**request))
                except Exception as error:  # noqa: BLE001 (a profiler that cannot run must not lose the figures)
                    if "top" not in request:
                        raise
                    conn.send({"error": f"{type(error).__name__}: {error}"})
    except EOFError:  # the parent is done
        pass
    except torch.cuda.OutOfMemoryError:
        conn.send({"ok": False, "error": OUT_OF_MEMORY})
    except Exception as error:  # noqa: BLE001 (the run's failure, reported by the parent)
        conn.send({"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Run:
    """The sides of ``specs`` in one fresh (spawned) process, stepped until the context ends; ``timeout_s`` for each
    request, ``allocator``: its ``PYTORCH_CUDA_ALLOC_CONF`` (None: lctrain's)."""

    def __init__(self, specs: Specs, *, timeout_s: float, allocator: str | None = None):
        self.timeout_s, self.failure = timeout_s, None
        self._dir = tempfile.TemporaryDirectory(prefix="bench_run_")  # its run directories, the watchdog's marker
        self._marker = Path(self._dir.name) / "stopped.json"
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        with mock.patch.dict(os.environ, process_env(allocator), clear=True):  # what the process inherits
            self._proc = context.Process(target=serve, args=(with_run_dirs(specs, self._dir.name), self._marker, child))
            self._proc.start()
        child.close()
        self.ready = self._request(None)

    def _request(self, request: dict[str, Any] | None) -> dict[str, Any]:
        """Send ``request``, then its answer or the failure: a timeout, the watchdog's stop or the process's end."""
        if self.failure is not None:
            return self.failure
        if request is not None:
            self._conn.send(request)
        if not self._conn.poll(self.timeout_s):
            self._proc.kill()
            answer = {"ok": False, "error": f"timed out after {self.timeout_s:.0f} s"}
        else:
            try:
                answer = self._conn.recv()
            except EOFError:
                self._proc.join()
                if self._marker.is_file():
                    answer = STOPPED | {"step_peak": json.loads(self._marker.read_text())["growth"]}
                else:
                    answer = {"ok": False, "error": f"exit status {self._proc.exitcode}"}
        if answer.get("ok") is False:
            self.failure = answer
        return answer

    def describe(self, name: str) -> dict[str, Any]:
        """Side ``name``'s description (``Measured.describe``), or why the sides could not be built."""
        return self.ready["sides"][name] if self.ready.get("ok") else self.ready

    def step(self, name: str, seq: int, seed: int, *, budget: int | None = None) -> dict[str, Any]:
        """One measured step of side ``name`` (``Measured.step``); past ``budget`` bytes of step peak it stops."""
        return self._request({"name": name, "seq": seq, "seed": seed, "budget": budget})

    def profile(self, name: str, seq: int, seed: int, top: int) -> dict[str, Any]:
        """One more step of side ``name`` under the profiler (``Measured.profile``)."""
        return self._request({"name": name, "seq": seq, "seed": seed, "top": top})

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._dir.cleanup()


def in_rounds(run: Measured | Run, names: list[str], warmup: Steps, steps: Steps, budget: int | None,
              log: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """The steps of sides ``names`` of ``run`` in rounds, each measured one appended to ``log``: ``ready`` (each side's
    ``describe``) and each side's measured ``steps``."""
    every = [*warmup, *steps]

    def step(name: str, index: int) -> dict[str, Any]:
        result = run.step(name, *every[index], budget=budget if index >= len(warmup) else None)
        if log is not None and index >= len(warmup):
            with log.open("a") as f:
                f.write(json.dumps({"side": name, **result}) + "\n")
        return result

    records = rounds({name: functools.partial(step, name) for name in names}, len(warmup), len(steps), timed=False)
    return {"ready": {name: run.describe(name) for name in names}, "steps": records}


def group_steps(specs: Specs, warmup: Steps, steps: Steps, budget: int | None, out_dir: str) -> dict:
    """On each rank of a ``run_group``: ``in_rounds`` of the sides built here, logged to ``out_dir/rank{r}.jsonl``."""
    import torch.distributed as dist

    follow_malloc_env()
    out = Path(out_dir) / f"rank{dist.get_rank()}"
    return in_rounds(
        Measured(specs, out.with_suffix(".json")), list(specs), warmup, steps, budget, out.with_suffix(".jsonl")
    )


def run_group(
    specs: Specs, ranks: int, warmup: Steps, steps: Steps, *, budget: int | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """``group_steps`` on a fresh gloo group of ``ranks`` CPU processes: each rank's ``ready`` and ``steps``, and the
    growth seen when a step passed ``budget`` (else None; then the steps all ranks finished, ``ready`` None)."""
    from lctrain.testing import run_distributed

    with tempfile.TemporaryDirectory(prefix="bench_group_") as out_dir:
        try:
            return run_distributed(
                group_steps, ranks, with_run_dirs(specs, out_dir), warmup, steps, budget, out_dir
            ), None
        except Exception:
            stopped = [json.loads(m.read_text())["growth"] for m in Path(out_dir).glob("rank*.json")]
            if not stopped:
                raise
            logs = [Path(out_dir) / f"rank{rank}.jsonl" for rank in range(ranks)]
            lines = [[json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else [] for f in logs]
            per_rank = [{name: [r for r in rank if r["side"] == name] for name in specs} for rank in lines]
            done = {name: min(len(rank[name]) for rank in per_rank) for name in specs}
            return [{"ready": None, "steps": {n: rank[n][: done[n]] for n in specs}} for rank in per_rank], max(stopped)


def run_steps(
    specs: Specs, ranks: int, warmup: Steps, steps: Steps, *, budget: int | None = None, timeout_s: float = 1800
) -> dict[str, dict[str, Any]]:
    """``in_rounds`` on ``ranks`` processes (one: a ``Run``; more: a ``run_group`` on CPU). Per side: ``ready`` (rank
    0's), ``steps`` (``timing.slowest``; a step stopped past ``budget`` ends them, ``ok`` false) and ``per_rank``."""
    if ranks == 1:
        with Run(specs, timeout_s=timeout_s) as run:
            per_rank, stopped = [in_rounds(run, list(specs), warmup, steps, budget)], None
    else:
        per_rank, stopped = run_group(specs, ranks, warmup, steps, budget=budget)
    result = {}
    for name in specs:
        ranks_steps = [rank["steps"][name] for rank in per_rank]
        ready = per_rank[0]["ready"][name] if per_rank[0]["ready"] else {"ok": False, "error": STOPPED["error"]}
        result[name] = {"ready": ready, "steps": slowest(ranks_steps), "per_rank": ranks_steps}
        if stopped is not None:
            result[name]["steps"].append(STOPPED | {"step_peak": stopped})
    return result


@dataclass
class Probe:
    """One length tried: whether it fits, and the run's result (``error``: why not, when it failed)."""

    seq: int
    fits: bool
    result: dict[str, Any]

    @property
    def reason(self) -> str:
        """Why it does not fit: the run's error, or its memory over the budget."""
        return self.result.get("error") or "over the memory budget"


@dataclass
class Search:
    """The longest fitting S for one side; ``probe(seq)`` runs one probe (once per length) and keeps it."""

    probe_fn: Callable[[int], Probe]
    unit: int
    max_seq: int
    probes: dict[int, Probe] = field(default_factory=dict)

    def probe(self, seq: int) -> Probe:
        if seq not in self.probes:
            self.probes[seq] = self.probe_fn(seq)
        return self.probes[seq]

    def longest(self) -> int | None:
        return max((p.seq for p in self.probes.values() if p.fits), default=None)

    def shortest_failure(self) -> int | None:
        best = self.longest() or 0
        return min((p.seq for p in self.probes.values() if not p.fits and p.seq > best), default=None)

    def run(self, start: int, *, bisect: int, jump: bool = False) -> int | None:
        """Double from ``start`` while it fits (not above ``max_seq``); while ``start`` does not fit, halve (not below
        ``unit``); then ``bisect`` bisection steps between the longest fit and the shortest failure above it.
        ``jump``: when ``start`` fits, try ``max_seq`` first (a fit there ends the search)."""
        seq = start
        if self.probe(seq).fits:
            if not (jump and self.probe(self.max_seq).fits):
                while seq < self.max_seq and self.probe(min(2 * seq, self.max_seq)).fits:
                    seq = min(2 * seq, self.max_seq)
        else:
            while seq // 2 >= self.unit and not self.probe(seq // 2 // self.unit * self.unit).fits:
                seq = seq // 2 // self.unit * self.unit
        for _ in range(bisect):
            best, failure = self.longest(), self.shortest_failure()
            if best is None or failure is None:
                break
            middle = (best + failure) // 2 // self.unit * self.unit
            if not best < middle < failure:
                break
            self.probe(middle)
        return self.longest()
