"""A run: one side (``sides.py``) of one job, trained step by step in processes of its own, each step measured: its
time, the process's CPU time, loss and gradient norm, and its memory (``memory.StepPeak``).

- ``Run``: one fresh process (``python -m benchmarks.runs SPEC``) at world size 1 (an NCCL group of one on CUDA,
  gloo on CPU), driven step by step from the parent: each step is a request, answered when it is done; a step past
  its budget, an out-of-memory or a timeout is an answer (``ok`` false), not a failure. One process per run, so that
  each peak and each allocator state is that run's own; two runs can be driven in turn.
- ``run_group``: one spawned CPU gloo group of several ranks (``lctrain.testing.run_distributed``) running a list
  of steps; every rank measures its own.

``spec``: ``side`` (``lctrain`` or ``hf``), ``job`` (the Hydra overrides), ``doc_len`` (None: one document per
row; else packed rows of such documents) and ``threads`` (torch threads; None: torch's default).

A step's figures: ``step_s``, ``cpu_s``, ``loss``, ``grad_norm``; ``before`` (bytes in use when it started: CUDA
allocated, CPU resident set; on CPU also ``pss_before``, the proportional set size), ``step_peak`` (the most it
added to them), ``peak`` (the most in use during it: CUDA ``max_memory_allocated``; CPU the resident-set peak less
the resident set before the side was built, i.e. parameters, optimizer states, activations and buffers, as on a
GPU) and ``reserved`` (CUDA's caching allocator).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import memory
from benchmarks.jobs import REPO, process_env

READY, RESULT = "READY ", "RESULT "
OUT_OF_MEMORY = "out of memory"


# ---------------------------------------------------------------------------------------------------------------
# Inside the run's processes
# ---------------------------------------------------------------------------------------------------------------


class Measured:
    """One side of ``spec``'s job in this process, measuring each training step."""

    def __init__(self, spec: dict[str, Any]):
        import torch

        from benchmarks.sides import build_side
        from lctrain.config import load_config
        from lctrain.runtime import init_distributed, resolve_device

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        cfg = load_config(spec["job"])
        self.device = resolve_device(cfg.train.device)
        self.doc_len = spec.get("doc_len")
        self.base = memory.reset_peak()  # the resident set before the side: the runtime
        if spec["side"] == "lctrain":  # a process group of one, as a plain `python -m lctrain train` run makes
            init_distributed(self.device, timeout_s=1800, host_collectives=cfg.parallel.cpu_offload)
        self.side = build_side(spec["side"], cfg)
        config = self.side.hf_config
        self.vocab_size = config.vocab_size
        self.model = {
            "params": sum(p.numel() for p in self.side.model.parameters()),  # FSDP2's DTensors count in full
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
        }

    def describe(self) -> dict[str, Any]:
        """What every result of this run shares: the device, its peak FLOP/s, the allocator setting, the model."""
        import torch

        from lctrain.train.meter import peak_flops

        cuda = self.device.type == "cuda"
        return {
            "ok": True,
            "error": None,
            "device_name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "peak_flops": peak_flops(self.device, None),  # a known GPU's dense bf16 peak; None on CPU
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "model": self.model,
        }

    def step(self, seq: int, seed: int, *, budget: int | None = None, marker: Path | None = None) -> dict[str, Any]:
        """One training step on random rows of ``seq`` tokens (``seed``); past ``budget`` bytes of step peak (CPU)
        the watchdog writes ``marker`` and ends the process."""
        import torch.distributed as dist

        from benchmarks.sides import random_rows

        rows = random_rows(self.vocab_size, 1, seq, seed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the ranks' steps start together
        with memory.StepPeak(self.device) as peak:
            pss_before = memory.pss() if self.device.type == "cpu" else None
            watchdog = contextlib.nullcontext()
            if budget is not None:
                watchdog = memory.BudgetWatchdog(peak.before, budget, marker)
            with watchdog:
                started, cpu_started = time.perf_counter(), time.process_time()
                loss, grad_norm = self.side.step(rows, self.doc_len)
                step_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        absolute = peak.peak if self.device.type == "cuda" else peak.peak - self.base
        return {
            "ok": True,
            "error": None,
            "seq": seq,
            "step_s": step_s,
            "cpu_s": cpu_s,
            "loss": loss,
            "grad_norm": grad_norm,
            "before": peak.before,
            "pss_before": pss_before,
            "step_peak": peak.growth,
            "peak": absolute,
            "reserved": peak.reserved,
        }

    def profile(self, seq: int, seed: int, top: int) -> dict[str, Any]:
        """One step under ``torch.profiler``: the ``top`` kernels (CUDA; operators by self time on CPU) and FSDP2's
        share (its outermost ``FSDP::*`` ranges: the kernel time launched inside them over all kernel time of the
        step, and their host time over the step's wall time)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        from benchmarks.sides import random_rows

        rows = random_rows(self.vocab_size, 1, seq, seed)
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            self.side.step(rows, self.doc_len)
            wall_us = (time.perf_counter() - started) * 1e6
        events = prof.events()
        fsdp = _outermost([e for e in events if e.device_type == torch.autograd.DeviceType.CPU], "FSDP::")
        result: dict[str, Any] = {"wall_ms": wall_us / 1e3, "fsdp_host_ms": sum(e.cpu_time_total for e in fsdp) / 1e3}
        result["fsdp_host_share"] = result["fsdp_host_ms"] * 1e3 / wall_us
        if cuda:
            kernels: dict[str, list[float]] = {}
            for event in events:
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
            total_us = sum(sum(times) for times in kernels.values())
            result["kernel_ms"] = total_us / 1e3
            result["fsdp_kernel_ms"] = sum(e.device_time_total for e in fsdp) / 1e3
            result["fsdp_kernel_share"] = result["fsdp_kernel_ms"] * 1e3 / total_us if total_us else None
            ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
            result["top"] = [(name, sum(times) / 1e3, len(times), sum(times) / total_us) for name, times in ranked]
        else:
            averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
            total_us = sum(a.self_cpu_time_total for a in averages)
            result["top"] = [
                (a.key, a.self_cpu_time_total / 1e3, a.count, a.self_cpu_time_total / total_us) for a in averages[:top]
            ]
        return result


def _outermost(events: list, prefix: str) -> list:
    """The profiler's ranges named ``prefix...`` that lie inside no other such range."""
    outer = []
    for event in events:
        if not event.name.startswith(prefix):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(prefix):
            parent = parent.cpu_parent
        if parent is None:
            outer.append(event)
    return outer


def serve(spec: dict[str, Any]) -> None:
    """The fresh process of a ``Run``: build the side, then answer one request a line on stdin (a step:
    ``{"seq", "seed", "budget", "marker"}``; a profiled step: ``{"profile": top, "seq", "seed"}``) until stdin
    closes. An out-of-memory is answered and ends the process."""
    import torch
    import torch.distributed as dist

    def answer(prefix: str, message: dict[str, Any]) -> None:
        print(prefix + json.dumps(message), flush=True)

    try:
        measured = Measured(spec)
        answer(READY, measured.describe())
        for line in sys.stdin:
            request = json.loads(line)
            if "profile" in request:
                try:
                    result = measured.profile(request["seq"], request["seed"], request["profile"])
                except Exception as error:  # noqa: BLE001 (a profiler that cannot run must not lose the figures)
                    result = {"error": f"{type(error).__name__}: {error}"}
            else:
                marker = request.get("marker")
                result = measured.step(
                    request["seq"], request["seed"], budget=request.get("budget"), marker=marker and Path(marker)
                )
            answer(RESULT, result)
    except torch.cuda.OutOfMemoryError:
        answer(RESULT, {"ok": False, "error": OUT_OF_MEMORY})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


class Run:
    """One side in one fresh process, driven step by step; a context manager (the process ends on exit).
    ``ready``: the run's description (``Measured.describe``), or ``ok`` false when the side could not be built."""

    def __init__(self, spec: dict[str, Any], *, timeout_s: float, allocator: str | None = None):
        """``timeout_s``: for building the side and for each step; ``allocator``: the process's
        ``PYTORCH_CUDA_ALLOC_CONF`` (None: lctrain's default unless the user set one)."""
        self.timeout_s = timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="bench_run_")  # its stderr, run directory, watchdog markers
        self._stderr = (Path(self._dir.name) / "stderr.log").open("w+")
        job = [*spec["job"], f"train.run_dir={self._dir.name}/run"]  # what the trainer writes goes there
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.runs", json.dumps(spec | {"job": job})],
            cwd=REPO,
            env=process_env(allocator),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            start_new_session=True,  # its whole process group is killed on a timeout
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.failure: dict[str, Any] | None = None
        self.ready = self._answer(READY, marker=None)

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, prefix: str, marker: Path | None) -> dict[str, Any]:
        """The next answer, or the failure: a timeout, the watchdog's stop (``marker``) or the process's end."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._kill()
                return self._fail({"ok": False, "error": f"timed out after {self.timeout_s:.0f} s"})
            if line is None:
                return self._fail(self._ended(marker))
            if line.startswith(prefix):
                answer = json.loads(line[len(prefix) :])
                return answer if answer.get("ok") is not False else self._fail(answer)

    def _ended(self, marker: Path | None) -> dict[str, Any]:
        code = self._proc.wait()
        if marker is not None and marker.is_file():
            growth = json.loads(marker.read_text())["growth"]
            return {"ok": False, "error": "over budget, stopped", "aborted": True, "step_peak": growth}
        self._stderr.seek(0)
        lines = self._stderr.read().strip().splitlines() or ["(no output)"]
        tail = "\n".join(lines[-30:])
        return {"ok": False, "error": f"exit status {code}: {lines[-1]}", "stderr_tail": tail}  # the exception's line

    def _fail(self, failure: dict[str, Any]) -> dict[str, Any]:
        self.failure = failure
        return failure

    def _request(self, request: dict[str, Any], marker: Path | None = None) -> dict[str, Any]:
        if self.failure is not None:
            return self.failure
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            return self._fail(self._ended(marker))
        return self._answer(RESULT, marker)

    def step(self, seq: int, seed: int, *, budget: int | None = None) -> dict[str, Any]:
        """One measured training step (``Measured.step``); past ``budget`` bytes of step peak (CPU) it is stopped."""
        marker = Path(self._dir.name) / f"step{seed}.json"
        request = {"seq": seq, "seed": seed, "budget": budget, "marker": str(marker)}
        return self._request(request, marker)

    def profile(self, seq: int, seed: int, top: int) -> dict[str, Any]:
        """One more step under the profiler (``Measured.profile``)."""
        return self._request({"profile": top, "seq": seq, "seed": seed})

    def _kill(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._kill()
        self._proc.wait()
        self._stderr.close()
        self._dir.cleanup()


def group_steps(
    spec: dict[str, Any], warmup: list[tuple[int, int]], steps: list[tuple[int, int]], budget: int | None, out_dir: str
) -> dict[str, Any]:
    """On each rank of a ``run_group``: build the side, run the (seq, seed) steps of ``warmup``, then measure those
    of ``steps`` in order, each appended to ``out_dir/rank{r}.jsonl`` as it ends (kept when a later step is
    stopped). Returns ``ready`` (``Measured.describe``) and the measured ``steps``."""
    import torch.distributed as dist

    measured = Measured(spec)
    rank = dist.get_rank()
    for seq, seed in warmup:
        measured.step(seq, seed)
    results = []
    for seq, seed in steps:
        results.append(measured.step(seq, seed, budget=budget, marker=Path(out_dir) / f"rank{rank}.json"))
        with (Path(out_dir) / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(results[-1]) + "\n")
    return {"ready": measured.describe(), "steps": results}


def run_group(
    spec: dict[str, Any],
    ranks: int,
    warmup: list[tuple[int, int]],
    steps: list[tuple[int, int]],
    *,
    budget: int | None = None,
) -> tuple[list[dict[str, Any]], int | None]:
    """``warmup`` then the measured ``steps`` (seq, seed) on a fresh gloo group of ``ranks`` CPU processes; returns
    each rank's ``group_steps`` and, when a step passed ``budget`` on a rank (its watchdog ended it), the growth
    seen (else None): then each rank's ``steps`` are those all ranks finished before it, and ``ready`` is None."""
    from lctrain.testing import run_distributed

    with tempfile.TemporaryDirectory(prefix="bench_group_") as out_dir:
        try:
            job = [*spec["job"], f"train.run_dir={out_dir}/run"]  # what the trainer writes goes there
            return run_distributed(group_steps, ranks, spec | {"job": job}, warmup, steps, budget, out_dir), None
        except Exception:
            stopped = memory.aborted_growth(Path(out_dir))
            if stopped is None:
                raise
            logs = [Path(out_dir) / f"rank{rank}.jsonl" for rank in range(ranks)]
            per_rank = [[json.loads(line) for line in f.read_text().splitlines()] if f.is_file() else [] for f in logs]
            done = min(len(results) for results in per_rank)
            return [{"ready": None, "steps": results[:done]} for results in per_rank], stopped


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
