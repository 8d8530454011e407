"""Runs: sides (``sides.py``) of jobs trained step by step in processes of their own, each step measured (time,
CPU time, loss, gradient norm, memory); the figures are described in ``docs/benchmarks.md``."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks import memory
from benchmarks.jobs import process_env
from benchmarks.timing import clock, rounds, slowest

OUT_OF_MEMORY = "out of memory"
STOPPED = {"ok": False, "error": "over budget, stopped", "aborted": True}
Steps = list[tuple[int, int]]  # (seq, seed) of each step
Specs = dict[str, dict[str, Any]]


def with_run_dirs(specs: Specs, directory: str) -> Specs:
    """``specs`` with each side's trainer writing under ``directory`` (a directory of its own)."""
    return {name: spec | {"job": [*spec["job"], f"train.run_dir={directory}/side{i}"]} for i, (name, spec) in
            enumerate(specs.items())}  # fmt: skip


class Measured:
    """The sides of ``specs`` in this process, each step measured."""

    def __init__(self, specs: Specs):
        import torch

        from benchmarks.sides import build_side
        from lctrain.config import load_config
        from lctrain.runtime import init_distributed, resolve_device

        if threads := next(iter(specs.values())).get("threads"):
            torch.set_num_threads(threads)
        configs = {name: load_config(spec["job"]) for name, spec in specs.items()}
        cfg = next(iter(configs.values()))
        self.device = resolve_device(cfg.train.device)
        # what is in use before the sides are built: the runtime (CPU resident set), earlier runs' leftovers
        self.base = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else memory.reset_peak()
        if any(spec["side"] == "lctrain" for spec in specs.values()):  # a process group of one, as `lctrain train`
            init_distributed(self.device, timeout_s=1800, host_collectives=cfg.parallel.cpu_offload)
        self.sides = {name: build_side(configs[name], spec) for name, spec in specs.items()}

    def describe(self, name: str) -> dict[str, Any]:
        """What every result of a side shares: the device, its dense bf16 peak FLOP/s (None on CPU), the allocator
        setting, the model (parameters, FSDP2's counted in full; trained ones; layers; width)."""
        import torch

        from lctrain.train.meter import peak_flops

        side, cuda = self.sides[name], self.device.type == "cuda"
        params = list(side.model.parameters())
        model = {"params": sum(p.numel() for p in params), "trained": sum(p.numel() for p in params if p.requires_grad)}
        model |= {"layers": side.hf_config.num_hidden_layers, "hidden": side.hf_config.hidden_size}
        device_name = torch.cuda.get_device_name(self.device) if cuda else "cpu"
        return {"ok": True, "error": None, "device_name": device_name, "peak_flops": peak_flops(self.device, None),
                "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "model": model}  # fmt: skip

    def step(self, name: str, seq: int, seed: int, *, budget: int | None = None, marker: Path | None = None) -> dict:
        """One step of side ``name`` on rows of ``seq`` tokens (``seed``); past ``budget`` bytes of step peak (CPU)
        the watchdog writes ``marker`` and ends the process."""
        import torch.distributed as dist

        from lctrain.train.meter import StepMemory

        side = self.sides[name]
        batch = side.batch(seq, seed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the ranks' steps start together
        with StepMemory(self.device, collect=True) as peak:
            pss_before = memory.pss() if self.device.type == "cpu" else None
            watchdog = (
                contextlib.nullcontext() if budget is None else memory.BudgetWatchdog(peak.before, budget, marker)
            )
            with watchdog, clock(self.device) as seconds:
                figures = side.step(batch)
        in_use = figures.pop("in_use", None)
        return {"ok": True, "error": None, "seq": seq, "step_s": seconds["wall"], "cpu_s": seconds["cpu"], **figures,
                "kept": None if in_use is None else in_use - peak.before, "before": peak.before,
                "pss_before": pss_before, "step_peak": peak.growth, "peak": peak.peak - self.base, "base": self.base,
                "reserved": peak.reserved}  # fmt: skip

    def profile(self, name: str, seq: int, seed: int, top: int) -> dict[str, Any]:
        """One step of side ``name`` under ``torch.profiler``: the ``top`` kernels (CUDA; operators by self time on
        CPU) and FSDP2's share (``docs/benchmarks.md``)."""
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
        if cuda:
            kernels: dict[str, list[float]] = {}
            for event in (e for e in events if e.device_type == kinds.CUDA):
                kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
            totals = {name: (sum(times), len(times)) for name, times in kernels.items()}
        else:
            totals = {a.key: (a.self_cpu_time_total, a.count) for a in prof.key_averages()}
        total_us = sum(us for us, _ in totals.values())
        if cuda:
            result |= {"kernel_ms": total_us / 1e3, "fsdp_kernel_ms": sum(e.device_time_total for e in fsdp) / 1e3}
            result["fsdp_kernel_share"] = result["fsdp_kernel_ms"] * 1e3 / total_us if total_us else None
        ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
        result["top"] = [(name, us / 1e3, count, us / total_us) for name, (us, count) in ranked]
        return result


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


def serve(specs: Specs, conn: Connection) -> None:
    """The fresh process of a ``Run``: build the sides, then answer each request on ``conn`` (a step: ``side``,
    ``seq``, ``seed``, ``budget``, ``marker``; a profiled step: ``profile``: top) until the parent closes its end.
    An error (an out-of-memory: ``OUT_OF_MEMORY``) is answered and ends the process."""
    import torch
    import torch.distributed as dist

    try:
        with contextlib.redirect_stdout(sys.stderr):  # the parent's stdout is its report
            measured = Measured(specs)
            conn.send({"ok": True, "error": None, "sides": {name: measured.describe(name) for name in specs}})
            while True:  # until the parent closes its end: EOFError
                request = conn.recv()
                name, seq, seed = request["side"], request["seq"], request["seed"]
                if "profile" not in request:
                    conn.send(measured.step(name, seq, seed, budget=request["budget"], marker=request["marker"]))
                    continue
                try:
                    conn.send(measured.profile(name, seq, seed, request["profile"]))
                except Exception as error:  # noqa: BLE001 (a profiler that cannot run must not lose the figures)
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
    """The sides of ``specs`` in one fresh (spawned) process, driven step by step; a context manager (the process ends
    on exit). ``timeout_s``: for building the sides and for each step; ``allocator``: its ``PYTORCH_CUDA_ALLOC_CONF``
    (None: lctrain's default unless the user set one). ``ready``: ``ok`` false when a side could not be built."""

    def __init__(self, specs: Specs, *, timeout_s: float, allocator: str | None = None):
        self.timeout_s, self.failure = timeout_s, None
        self._dir = tempfile.TemporaryDirectory(prefix="bench_run_")  # its run directories, watchdog markers
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        with mock.patch.dict(os.environ, process_env(allocator), clear=True):  # what the process inherits
            self._proc = context.Process(target=serve, args=(with_run_dirs(specs, self._dir.name), child))
            self._proc.start()
        child.close()
        self.ready = self._answer(None)

    def _answer(self, marker: Path | None) -> dict[str, Any]:
        """The next answer, or the failure: a timeout, the watchdog's stop (``marker``) or the process's end."""
        if not self._conn.poll(self.timeout_s):
            self._proc.kill()
            answer = {"ok": False, "error": f"timed out after {self.timeout_s:.0f} s"}
        else:
            try:
                answer = self._conn.recv()
            except EOFError:
                self._proc.join()
                if marker is not None and marker.is_file():
                    answer = STOPPED | {"step_peak": json.loads(marker.read_text())["growth"]}
                else:
                    answer = {"ok": False, "error": f"exit status {self._proc.exitcode}"}
        if answer.get("ok") is False:
            self.failure = answer
        return answer

    def _request(self, request: dict[str, Any], marker: Path | None = None) -> dict[str, Any]:
        if self.failure is not None:
            return self.failure
        self._conn.send(request)
        return self._answer(marker)

    def describe(self, name: str) -> dict[str, Any]:
        """Side ``name``'s description (``Measured.describe``), or why the sides could not be built."""
        return self.ready["sides"][name] if self.ready.get("ok") else self.ready

    def step(self, name: str, seq: int, seed: int, *, budget: int | None = None) -> dict[str, Any]:
        """One measured step of side ``name`` (``Measured.step``); past ``budget`` bytes of step peak it stops."""
        marker = Path(self._dir.name) / f"step{seed}.json"
        return self._request({"side": name, "seq": seq, "seed": seed, "budget": budget, "marker": marker}, marker)

    def profile(self, name: str, seq: int, seed: int, top: int) -> dict[str, Any]:
        """One more step of side ``name`` under the profiler (``Measured.profile``)."""
        return self._request({"profile": top, "side": name, "seq": seq, "seed": seed})

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._dir.cleanup()


def group_steps(specs: Specs, warmup: Steps, steps: Steps, budget: int | None, out_dir: str) -> dict:
    """On each rank of a ``run_group``: build the sides, then take their steps in rounds (``warmup``, then the
    measured ``steps``), each measured one appended to ``out_dir/rank{r}.jsonl`` (kept when a later step is stopped).
    Returns ``ready`` (each side's ``Measured.describe``) and each side's measured ``steps``."""
    import torch.distributed as dist

    measured, every, rank = Measured(specs), [*warmup, *steps], dist.get_rank()
    log, marker = Path(out_dir) / f"rank{rank}.jsonl", Path(out_dir) / f"rank{rank}.json"

    def step(name: str, index: int) -> dict[str, Any]:
        timed = index >= len(warmup)
        result = measured.step(name, *every[index], budget=budget if timed else None, marker=marker)
        if timed:
            with log.open("a") as f:
                f.write(json.dumps({"side": name, **result}) + "\n")
        return result

    sides = {name: lambda index, name=name: step(name, index) for name in specs}
    records = rounds(sides, len(warmup), len(steps), timed=False)
    return {"ready": {name: measured.describe(name) for name in specs}, "steps": records}


def run_group(
    specs: Specs, ranks: int, warmup: Steps, steps: Steps, *, budget: int | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """``group_steps`` on a fresh gloo group of ``ranks`` CPU processes: each rank's ``ready`` and ``steps`` and,
    when a step passed ``budget`` on a rank (its watchdog ended it), the growth seen (else None): then each rank's
    ``steps`` are those all ranks finished before it, and ``ready`` is None."""
    from lctrain.testing import run_distributed

    with tempfile.TemporaryDirectory(prefix="bench_group_") as out_dir:
        sides = with_run_dirs(specs, out_dir)
        try:
            return run_distributed(group_steps, ranks, sides, warmup, steps, budget, out_dir), None
        except Exception:
            stopped = memory.aborted_growth(Path(out_dir))
            if stopped is None:
                raise
            logs = [Path(out_dir) / f"rank{rank}.jsonl" for rank in range(ranks)]
            lines = [[json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else [] for f in logs]
            per_rank = [{name: [r for r in rank if r["side"] == name] for name in specs} for rank in lines]
            done = {name: min(len(rank[name]) for rank in per_rank) for name in specs}
            return [{"ready": None, "steps": {n: rank[n][: done[n]] for n in specs}} for rank in per_rank], stopped


def run_steps(
    specs: Specs, ranks: int, warmup: Steps, steps: Steps, *, budget: int | None = None, timeout_s: float = 1800
) -> dict[str, dict[str, Any]]:
    """The sides of ``specs`` in rounds: ``warmup``, then the measured ``steps`` (seq, seed), on ``ranks`` processes
    (one: a ``Run``, NCCL on CUDA, ``timeout_s`` for each step; more: a ``run_group`` on CPU). Per side: ``ready``
    (``Measured.describe`` of rank 0, or why it failed), ``steps`` (each step's figures, the largest over the ranks:
    ``timing.slowest``; a step stopped past ``budget`` ends them, ``ok`` false) and ``per_rank`` (each rank's)."""
    if ranks == 1:
        with Run(specs, timeout_s=timeout_s) as run:
            every = [*warmup, *steps]
            sides = {name: lambda i, name=name: run.step(name, *every[i], budget=budget if i >= len(warmup) else None)
                     for name in specs}  # fmt: skip
            records = rounds(sides, len(warmup), len(steps), timed=False)
            per_rank, stopped = [{"ready": {name: run.describe(name) for name in specs}, "steps": records}], None
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
