"""Benchmark lctrain's training step against a plain Hugging Face + PyTorch loop on CPU: throughput at world size 1,
and the longest sequence each side trains within a fixed memory budget.

Run from the repository root::

    python benchmarks/bench_trainer.py            # both sections, default sizes (about 10 minutes on 2 cores)
    python benchmarks/bench_trainer.py --quick    # small sizes, a smoke run of a few minutes
    python benchmarks/bench_trainer.py --only throughput --seq 8192 --steps 20

Both sides train the tiny model of the default job (recipe ``tiny_cpu``; ``--override`` changes the job config of
both) in fp32 from the same initial weights (``lctrain.models.random_init_source`` with the job's seed),
on the same synthetic batches: random tokens, one document per row (``cu_seqlens = [0, S]``), so both do the same
causal attention and predict the same S−1 tokens per row. Both use lctrain's AdamW (``build_optimizer``: same
parameter groups), its warmup + cosine schedule and clipping to ``optim.max_grad_norm``. The baseline is the usual
loop: ``loss = model(input_ids=x, labels=x).loss`` (sdpa attention, full logits, Hugging Face's own loss),
``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``, ``zero_grad()``. lctrain is
``Trainer(cfg).train_step([batch])`` on a gloo process group: USP attention, FSDP2 (also at world size 1), the
chunked cross-entropy (``train.loss_chunk_tokens``), ``activation_checkpointing`` as configured.

1. Throughput (world size 1, no activation checkpointing on either side). Each side lives in its own spawned
   process, both with ``--threads`` torch threads (default 1: the figures do not depend on what else the cores do
   as much, and a ratio is what is reported). The parent drives them step by step, one process at a time (the
   other waits on a pipe and uses no CPU), in the order A,B,B,A,A,B,... so that drift in the machine's load hits
   both alike: ``--warmup`` untimed steps each, then ``--steps`` timed ones. A step's time is the whole optimizer
   step (forward, backward, clipping, AdamW, schedule, ``loss.item()``); reported: the median, tokens/s = B·S /
   median, the ratio lctrain/baseline (target ≥ 0.95), and the median CPU time of the process per step (less
   disturbed by other work on the machine than wall time). The losses and gradient norms of the first step must
   agree (same weights, same batch) and are printed with their difference. The timed processes run with glibc's
   default allocator settings; the memory figures come from a second pair of processes, run the same way with
   the memory settings below (one warm-up step, then the peak over two steps).
2. Longest trainable sequence within ``--budget-mib`` of memory per process (default 1 GiB). Baseline: the same
   plain loop in one process, no activation checkpointing, full logits. lctrain: ``--ring`` × ``--ulysses`` ranks
   (default ring 4 × Ulysses 1: the issue's "4 ranks, ring"; pure ring also keeps every activation at S/4 tokens
   per rank, and the tiny model's 2 KV heads would allow Ulysses 2 at most), activation checkpointing ``full``,
   the chunked loss (``--loss-chunk-tokens``, default the job's ``train.loss_chunk_tokens``). Each candidate
   length runs in a fresh spawned process group (one thread per rank): one warm-up training step at
   ``--warmup-seq``, then one measured training step at the candidate length; it fits if every rank's step peak
   (below) stays within the budget. A rank whose memory passes the budget during the step ends the probe at once
   (a watchdog thread): that length does not fit. Candidates are multiples of ``--seq-unit``. The baseline doubles
   from ``--baseline-start`` while it fits (halving if the start does not fit), then one bisection step between
   its longest fit and shortest failure (``--no-bisect`` skips it). lctrain starts at ``--target-ratio`` × the
   baseline's result (a fit there meets the target), then tries ``--max-seq``: the step peak grows with S, so a
   fit there means every length in between fits, and the search stops with "≥ max-seq" (the ratio is then a lower
   bound); otherwise it doubles and bisects like the baseline. ``--max-seq`` keeps the run time bounded: a ring
   step's attention work grows as S² (on 2 cores, S=32K took 1.5-2 minutes a step; each doubling is about 4×).
   No extrapolation: lctrain's step peak is the largest of several phases' (the loss chunks' logits, a recomputed
   decoder layer, ...) that grow with S at different rates, so a line through two probes would mislead.

Memory. On CPU there is no counterpart of ``torch.cuda.max_memory_allocated``: torch's profiler with
``profile_memory=True`` records allocation events per operator, not a high-water mark of the process, and does not
see memory outside torch's allocator (gloo's buffers, glibc's arenas). So the figure is the process's resident
set: the high-water mark VmHWM is reset (``5`` written to ``/proc/self/clear_refs``) right before a step, and the
step peak is VmHWM − VmRSS(before the step) after it. Each side runs in its own process, so the runtime (Python,
torch, transformers, gloo) is not counted. The measured steps come after a warm-up step, which creates the AdamW
states and pages in the code the step runs; so the step peak is what a training step adds on top of the model's
parameters and optimizer states (both in the "RSS before" figures, with the runtime): gradients, activations,
logits, communication buffers, allocator slack. Every process that measures memory runs with
``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves large buffers with mmap and returns them to the OS when freed,
so freed memory does not stay resident and hide a later allocation. The timed processes of section 1 do not: with
that setting every large temporary costs fresh page faults, which slowed lctrain's step (FSDP's unsharded
parameters, one logits chunk per 1024 tokens: more large temporaries) more than the baseline's here.

Caveats: two cores shared by four ranks in section 2 (their time is not a figure here); RSS counts pages touched,
not bytes allocated; the tiny model's LM head (vocab 8192 × hidden 128) makes up most of its matmul work, so the
loss's implementation weighs more in the ratio than on a real model; a micro-batch of B rows is B forward+backward
passes in lctrain (one row at a time) and one batched pass in the baseline.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import (
    MALLOC_MMAP_THRESHOLD,
    BudgetWatchdog,
    Rows,
    build_side,
    job_config,
    log,
    malloc_env,
)
from report import machine_line, peak_since_reset, reset_peak, table

from lctrain.testing import run_distributed

SECTIONS = ("throughput", "memory")
SIDES = ("lctrain", "baseline")
MEMORY_STEPS = 2  # measured steps per side in section 1's memory processes (after one warm-up step)
MIB = 2**20


# ---------------------------------------------------------------------------------------------------------------
# Section 1: throughput, two processes driven in turn
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputSetup:
    overrides: tuple[str, ...]
    seq: int
    batch: int
    threads: int
    seed: int
    run_dir: str


@dataclass(frozen=True)
class StepResult:
    seconds: float  # wall time
    cpu_seconds: float  # this process's CPU time (user + system, all threads)
    loss: float
    grad_norm: float
    rss_before: int  # bytes, VmRSS right before the step
    peak_growth: int  # bytes, VmHWM after the step − rss_before


def throughput_worker(side: str, setup: ThroughputSetup, conn: multiprocessing.connection.Connection) -> None:
    """One side in its own process: build it, then run one step per request (the step index) until ``None``."""
    try:
        torch.set_num_threads(setup.threads)
        if side == "lctrain":  # a process group of one, as a plain ``python -m lctrain train`` run makes
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        overrides = (
            *setup.overrides,
            "parallel.ring=1",
            "parallel.ulysses=1",
            "parallel.dp=1",
            "parallel.activation_checkpointing=none",
        )
        runner = build_side(side, job_config(overrides, seq=setup.seq, batch=setup.batch, run_dir=setup.run_dir))
        conn.send(("ready", runner.vocab_size))
        while (step := conn.recv()) is not None:
            rows = Rows.synthetic(runner.vocab_size, setup.batch, setup.seq, seed=setup.seed + step)
            rss_before = reset_peak()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss, grad_norm = runner.step(rows)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            peak = peak_since_reset() - rss_before
            conn.send(("ok", StepResult(seconds, cpu_seconds, loss, grad_norm, rss_before, peak)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _receive(conn: multiprocessing.connection.Connection, side: str) -> Any:
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"{side} process failed:\n{payload}")
    return payload


def run_throughput(
    setup: ThroughputSetup, warmup: int, steps: int
) -> tuple[dict[str, StepResult], dict[str, list[StepResult]]]:
    """Start both sides, then run warm-up + timed steps, one process at a time, in the order A,B,B,A,A,B,...;
    returns each side's first step (warm-up or not) and its timed steps."""
    ctx = mp.get_context("spawn")
    conns, procs = {}, {}
    for side in SIDES:
        conns[side], child = ctx.Pipe()
        procs[side] = ctx.Process(target=throughput_worker, args=(side, setup, child), daemon=True)
        procs[side].start()
        child.close()  # the child holds its own end: recv() here fails instead of waiting if the child dies
    first: dict[str, StepResult] = {}
    timed: dict[str, list[StepResult]] = {side: [] for side in SIDES}
    try:
        vocab = {side: _receive(conns[side], side) for side in SIDES}
        if len(set(vocab.values())) != 1:
            raise RuntimeError(f"the sides built different vocabularies: {vocab}")
        for step in range(warmup + steps):
            order = SIDES if step % 2 == 0 else SIDES[::-1]
            latest = {}
            for side in order:
                conns[side].send(step)
                latest[side] = _receive(conns[side], side)
                first.setdefault(side, latest[side])
                if step >= warmup:
                    timed[side].append(latest[side])
            kind = "warm-up" if step < warmup else "measured"
            log(
                f"  step {step + 1}/{warmup + steps} ({kind}): "
                + ", ".join(f"{s} {latest[s].seconds:.2f} s" for s in SIDES)
            )
    finally:
        for side in SIDES:
            if procs[side].is_alive():
                try:
                    conns[side].send(None)
                except OSError:
                    pass
            procs[side].join(timeout=60)
            if procs[side].is_alive():
                procs[side].kill()
    return first, timed


# ---------------------------------------------------------------------------------------------------------------
# Section 2: longest sequence within a memory budget, one fresh process group per candidate
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    seq: int
    fits: bool
    peak_growth: int  # bytes, max over ranks (for an aborted probe: what the watchdog saw)
    rss_before: int  # bytes, max over ranks; 0 when aborted
    seconds: float  # the measured step's time (slowest rank); wall time of the probe when aborted
    aborted: bool = False


def memory_probe(
    side: str, overrides: tuple[str, ...], seq: int, warmup_seq: int, budget: int, marker_dir: str, run_dir: str
) -> dict[str, float]:
    """On each rank: build the side, one warm-up step at ``warmup_seq``, then one watched step at ``seq``."""
    runner = build_side(side, job_config(overrides, seq=seq, batch=1, run_dir=run_dir))
    runner.step(Rows.synthetic(runner.vocab_size, 1, warmup_seq, seed=1))
    rows = Rows.synthetic(runner.vocab_size, 1, seq, seed=0)
    dist.barrier()
    rss_before = reset_peak()
    marker = Path(marker_dir) / f"rank{dist.get_rank()}.json"
    with BudgetWatchdog(rss_before, budget, marker):
        start = time.perf_counter()
        loss, _ = runner.step(rows)
        seconds = time.perf_counter() - start
    return {"peak_growth": peak_since_reset() - rss_before, "rss_before": rss_before, "seconds": seconds, "loss": loss}


@dataclass
class MemorySearch:
    """Runs probes for one side and keeps them."""

    side: str
    world: int
    overrides: tuple[str, ...]
    budget: int
    warmup_seq: int
    run_dir: str
    probes: dict[int, Probe] = field(default_factory=dict)

    def probe(self, seq: int) -> Probe:
        if seq in self.probes:
            return self.probes[seq]
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as marker_dir:
            try:
                per_rank = run_distributed(
                    memory_probe,
                    self.world,
                    self.side,
                    self.overrides,
                    seq,
                    self.warmup_seq,
                    self.budget,
                    marker_dir,
                    self.run_dir,
                )
            except Exception:
                markers = sorted(Path(marker_dir).glob("rank*.json"))
                if not markers:
                    raise
                growth = max(json.loads(m.read_text())["growth"] for m in markers)
                result = Probe(seq, False, growth, 0, time.perf_counter() - started, aborted=True)
            else:
                growth = max(int(r["peak_growth"]) for r in per_rank)
                result = Probe(
                    seq,
                    growth <= self.budget,
                    growth,
                    max(int(r["rss_before"]) for r in per_rank),
                    max(r["seconds"] for r in per_rank),
                )
        verdict = "fits" if result.fits else ("over budget, stopped" if result.aborted else "over budget")
        log(
            f"  {self.side} S={seq}: step peak {result.peak_growth / MIB:.0f} MiB, {verdict} "
            f"({time.perf_counter() - started:.0f} s)"
        )
        self.probes[seq] = result
        return result

    def longest(self) -> int | None:
        fits = [p.seq for p in self.probes.values() if p.fits]
        return max(fits) if fits else None

    def search(self, start: int, *, unit: int, max_seq: int, bisect: bool, jump: bool = False) -> int | None:
        """Double from ``start`` while it fits (up to ``max_seq``); if ``start`` does not fit, halve down to
        ``unit``; then one bisection step between the longest fit and the shortest failure above it.

        ``jump``: when ``start`` fits, try ``max_seq`` first, and double only if that does not fit (the step peak
        grows with S, so a fit at ``max_seq`` says every length in between fits: no need to run them)."""
        seq = start
        if self.probe(seq).fits:
            if not (jump and self.probe(max_seq).fits):
                while seq < max_seq and self.probe(min(2 * seq, max_seq)).fits:
                    seq = min(2 * seq, max_seq)
        else:
            while seq // 2 >= unit and not self.probe(seq // 2 // unit * unit).fits:
                seq = seq // 2 // unit * unit
        best = self.longest()
        failures = [p.seq for p in self.probes.values() if not p.fits and (best is None or p.seq > best)]
        if bisect and best is not None and failures:
            middle = (best + min(failures)) // 2 // unit * unit
            if best < middle < min(failures):
                self.probe(middle)
        return self.longest()


def round_down(value: int, unit: int) -> int:
    return max(unit, value // unit * unit)


# ---------------------------------------------------------------------------------------------------------------
# Report (parent process)
# ---------------------------------------------------------------------------------------------------------------


def mib(value: int) -> str:
    return f"{value / MIB:,.0f}"


@dataclass
class Report:
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def report_throughput(
    args: argparse.Namespace,
    first: dict[str, StepResult],
    timed: dict[str, list[StepResult]],
    memory: dict[str, list[StepResult]],
    report: Report,
) -> None:
    a, b = SIDES
    median = {side: statistics.median(r.seconds for r in timed[side]) for side in SIDES}
    cpu = {side: statistics.median(r.cpu_seconds for r in timed[side]) for side in SIDES}
    peak = {side: max(r.peak_growth for r in memory[side]) for side in SIDES}
    tokens = args.batch * args.seq

    def spread(side: str) -> str:
        return f"{min(r.seconds for r in timed[side]):.3f} … {max(r.seconds for r in timed[side]):.3f}"

    def first_step(side: str) -> str:
        return f"{first[side].loss:.6f} / {first[side].grad_norm:.6f}"

    where = f"world 1, S={args.seq:,}, B={args.batch}, {args.threads} thread(s) each"
    report.rows += [
        [f"median step time (s); {where}", f"{median[a]:.3f}", f"{median[b]:.3f}", f"{median[a] / median[b]:.3f}", ""],
        [
            "tokens/s",
            f"{tokens / median[a]:,.0f}",
            f"{tokens / median[b]:,.0f}",
            f"**{median[b] / median[a]:.3f}**",
            "≥ 0.95",
        ],
        ["step time min … max (s)", spread(a), spread(b), "", ""],
        ["median CPU time per step (s)", f"{cpu[a]:.3f}", f"{cpu[b]:.3f}", f"{cpu[a] / cpu[b]:.3f}", ""],
        [
            f"step peak memory (MiB), max of {MEMORY_STEPS} steps after a warm-up one",
            mib(peak[a]),
            mib(peak[b]),
            f"{peak[a] / peak[b]:.2f}",
            "",
        ],
        [
            "RSS before those steps (MiB, with runtime, params, AdamW states)",
            mib(memory[a][0].rss_before),
            mib(memory[b][0].rss_before),
            "",
            "",
        ],
        [
            "step 1 loss / grad norm",
            first_step(a),
            first_step(b),
            f"abs diff {abs(first[a].loss - first[b].loss):.1e} / {abs(first[a].grad_norm - first[b].grad_norm):.1e}",
            "equal up to fp32 rounding",
        ],
    ]
    report.notes.append(
        f"Throughput: {args.warmup} warm-up + {args.steps} timed steps per side, each side in its own process, run "
        "in turn (A,B,B,A,…); tokens/s ratio = baseline's median step time / lctrain's. The memory figures come "
        "from a second pair of processes run the same way (see Memory below). No activation checkpointing "
        "on either side; lctrain runs FSDP2 over its group of one and the chunked loss (train.loss_chunk_tokens = "
        f"{args.job_chunk_tokens}, the job's). CPU time = the process's user + system time (one side's process "
        "is idle while the other runs), less sensitive than wall time to other work on the machine. Losses of the "
        f"last step: lctrain {timed[a][-1].loss:.6f}, baseline {timed[b][-1].loss:.6f}."
    )


def probe_list(search: MemorySearch) -> str:
    return "; ".join(
        f"{p.seq:,} → {'>' if p.aborted else ''}{p.peak_growth / MIB:,.0f}{'' if p.fits else ' ✗'}"
        for p in (search.probes[seq] for seq in sorted(search.probes))
    )


def report_memory(
    args: argparse.Namespace, searches: dict[str, MemorySearch], longest: dict[str, int | None], report: Report
) -> None:
    a, b = SIDES

    def label(seq: int | None) -> str:
        if seq is None:
            return "none"
        return f"≥ {seq:,}" if seq >= args.max_seq else f"{seq:,}"

    la, lb = longest[a], longest[b]
    ratio = "—" if not la or not lb else f"**{'≥ ' if la >= args.max_seq else ''}{la / lb:.1f}×**"
    report.rows += [
        [
            f"longest trainable S, step peak ≤ {args.budget_mib:,} MiB/process",
            f"{label(la)} ({args.ring * args.ulysses} ranks)",
            f"{label(lb)} (1 process)",
            ratio,
            f"≥ {args.target_ratio:g}×",
        ],
        ["probes: S → step peak (MiB)", probe_list(searches[a]), probe_list(searches[b]), "", ""],
    ]
    fitted = {side: searches[side].probes[longest[side]] for side in SIDES if longest[side] is not None}
    times = ", ".join(f"{side} {p.seconds:.1f} s at S={p.seq:,}" for side, p in fitted.items()) or "—"
    rss = ", ".join(f"{side} {mib(p.rss_before)} MiB" for side, p in fitted.items()) or "—"
    report.notes.append(
        f"Longest sequence: lctrain = ring {args.ring} × ulysses {args.ulysses} ranks, activation checkpointing "
        f"full, chunked loss of {args.loss_chunk_tokens} tokens; baseline = one process, no checkpointing, full "
        f"logits. A probe = a fresh process group: a warm-up step at S={args.warmup_seq:,}, then one step at S; its "
        f"step peak is the max over ranks of VmHWM − VmRSS before that step; ✗ = over the budget (> = stopped by "
        f"the watchdog as it passed the budget). Candidates: multiples of {args.seq_unit}; the baseline doubles "
        f"from {args.baseline_start:,}, then {'one bisection step' if args.bisect else 'no bisection'}; lctrain "
        f"starts at {args.target_ratio:g}× the baseline's result, then tries --max-seq={args.max_seq:,} (≥ = fits "
        f"there: the peak grows with S, so every length in between fits; the ratio is then a lower bound). At the "
        f"longest fit, step time: {times} (the ranks share {os.cpu_count()} cores); RSS before the step (with "
        f"runtime, max over ranks): {rss}."
    )


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------

QUICK = {
    "seq": 1024,
    "warmup": 1,
    "steps": 3,
    "budget_mib": 256,
    "baseline_start": 1024,
    "max_seq": 8192,
    "warmup_seq": 256,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help=f"small sizes for a smoke run: {QUICK}")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override of the job config of both sides (model sizes, optim, seed); repeatable",
    )
    throughput = parser.add_argument_group("section 1: throughput at world size 1")
    throughput.add_argument("--seq", type=int, default=4096, help="sequence length")
    throughput.add_argument("--batch", type=int, default=1, help="rows per step")
    throughput.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    throughput.add_argument("--steps", type=int, default=10, help="timed steps per side")
    throughput.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    memory = parser.add_argument_group("section 2: longest sequence in a memory budget")
    memory.add_argument("--budget-mib", type=int, default=1024, help="allowed step peak per process (MiB)")
    memory.add_argument("--ring", type=int, default=4, help="lctrain's ring degree")
    memory.add_argument("--ulysses", type=int, default=1, help="lctrain's Ulysses degree")
    memory.add_argument(
        "--loss-chunk-tokens", type=int, default=None, help="lctrain's train.loss_chunk_tokens (default: the job's)"
    )
    memory.add_argument("--baseline-start", type=int, default=1024, help="first candidate S of the baseline")
    memory.add_argument("--target-ratio", type=float, default=4.0, help="lctrain starts at this × the baseline's S")
    memory.add_argument("--max-seq", type=int, default=32768, help="no candidate above this")
    memory.add_argument("--seq-unit", type=int, default=256, help="candidates are multiples of this")
    memory.add_argument("--warmup-seq", type=int, default=512, help="S of the warm-up step of each probe")
    memory.add_argument("--no-bisect", dest="bisect", action="store_false", help="skip the bisection step")
    raw = sys.argv[1:]
    args = parser.parse_args(raw)
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in raw if a.startswith("--")}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    divisor = 2 * args.ring * args.ulysses  # zigzag sharding
    for name in ("seq_unit", "warmup_seq", "baseline_start", "max_seq"):
        if getattr(args, name) % divisor:
            parser.error(f"--{name.replace('_', '-')} must be a multiple of 2·ring·ulysses = {divisor}")
    if args.baseline_start % args.seq_unit or args.max_seq % args.seq_unit:
        parser.error("--baseline-start and --max-seq must be multiples of --seq-unit")
    return args


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # section 2's ranks set 1 themselves (run_distributed)
    started = time.perf_counter()
    command = shlex.join(["python", *sys.argv])
    machine = machine_line()
    report = Report()
    overrides = tuple(args.override)
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as run_dir:
        args.job_chunk_tokens = job_config(overrides, seq=args.seq, batch=1, run_dir=run_dir).train.loss_chunk_tokens
        if args.loss_chunk_tokens is None:
            args.loss_chunk_tokens = args.job_chunk_tokens
        if "throughput" in args.only:
            log(f"throughput: S={args.seq}, B={args.batch}, {args.warmup} warm-up + {args.steps} timed steps per side")
            setup = ThroughputSetup(overrides, args.seq, args.batch, args.threads, seed=0, run_dir=run_dir)
            with malloc_env(for_memory=False):
                first, timed = run_throughput(setup, args.warmup, args.steps)
            log(f"throughput memory: 1 warm-up + {MEMORY_STEPS} measured steps per side, {MALLOC_MMAP_THRESHOLD=}")
            with malloc_env(for_memory=True):
                memory = run_throughput(setup, 1, MEMORY_STEPS)[1]
            report_throughput(args, first, timed, memory, report)
        if "memory" in args.only:
            budget = args.budget_mib * MIB
            lctrain_overrides = (
                *overrides,
                f"parallel.ring={args.ring}",
                f"parallel.ulysses={args.ulysses}",
                "parallel.dp=1",
                "parallel.activation_checkpointing=full",
                f"train.loss_chunk_tokens={args.loss_chunk_tokens}",
            )
            baseline_overrides = (*overrides, "parallel.ring=1", "parallel.ulysses=1", "parallel.dp=1")
            searches = {
                "lctrain": MemorySearch(
                    "lctrain", args.ring * args.ulysses, lctrain_overrides, budget, args.warmup_seq, run_dir
                ),
                "baseline": MemorySearch("baseline", 1, baseline_overrides, budget, args.warmup_seq, run_dir),
            }
            log(f"memory: budget {args.budget_mib} MiB per process, candidates up to S={args.max_seq}")
            unit = args.seq_unit
            with malloc_env(for_memory=True):
                longest = {
                    "baseline": searches["baseline"].search(
                        args.baseline_start, unit=unit, max_seq=args.max_seq, bisect=args.bisect
                    )
                }
                start = round_down(int(args.target_ratio * (longest["baseline"] or unit)), unit)
                start = min(args.max_seq, start)
                longest["lctrain"] = searches["lctrain"].search(
                    start, unit=unit, max_seq=args.max_seq, bisect=args.bisect, jump=True
                )
            report_memory(args, searches, longest, report)

    print("# Trainer benchmark: lctrain vs. a plain Hugging Face + PyTorch loop\n")
    print(f"- command: `{command}`")
    print(f"- machine: {machine}")
    print(
        "- model: the default job's tiny Llama (recipes/tiny_cpu.yaml"
        + (f" + {' '.join(overrides)}" if overrides else "")
        + "), fp32, same initial weights and synthetic batches (one document per row) on both sides; "
        "AdamW + warmup/cosine + clipping from lctrain.train.optim on both"
    )
    print(f"- total wall time {time.perf_counter() - started:.0f} s\n")
    print(table(["figure", "lctrain", "HF + PyTorch baseline", "ratio lctrain/baseline", "target"], report.rows))
    for note in report.notes:
        print(f"\n{note}")
    print(
        "\nMemory = resident set: step peak = VmHWM − VmRSS right before a step that follows a warm-up step "
        "(VmHWM reset via /proc/self/clear_refs), in a process of its own; the runtime, the parameters and the "
        f"AdamW states are in the RSS before the step. Processes that measure memory run with "
        f"MALLOC_MMAP_THRESHOLD_={MALLOC_MMAP_THRESHOLD} (freed large buffers return to the OS, so freed memory "
        "cannot hide a later allocation); the timed processes run with glibc's default allocator settings."
    )


if __name__ == "__main__":
    main()
