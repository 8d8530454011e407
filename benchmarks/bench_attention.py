"""Benchmark exact distributed attention on CPU: parallel efficiency, baselines, memory scaling and ring traffic.

Run from the repository root::

    python -m benchmarks.bench_attention                        # everything, S=16384, bf16, P=2
    python -m benchmarks.bench_attention --seq 2048 --iters 1 --only efficiency,baselines
    python -m benchmarks.bench_attention --only kernel          # the CPU op per pass: bf16 or fp32, layout

Every rank is a spawned gloo process with one thread. A timed iteration is one forward + backward; all ranks
pass a barrier before it, its time is the slowest rank's, and the reported figure is the median over ``--iters``
iterations after ``--warmup`` untimed ones. Sections 1 and 2 run every implementation (T1 on rank 0 alone) in the
same P processes, one iteration of each in turn, so a change in machine load hits them all alike. Peak memory is
the growth of a rank's resident set during a timed forward + backward. Every fused CPU kernel (T1, PyTorch's
ring op, DeepSpeed's local SDPA) computes each pass in the dtype that lctrain's CPU kernel computes that pass in
on this CPU (``kernels.cpu_compute_dtype``), so the comparisons measure the distribution, not the dtype. The
output is markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks import rings
from benchmarks.memory import MALLOC_MMAP_THRESHOLD, StepPeak
from benchmarks.report import command, machine_line, table
from lctrain.attention import kernels, ring_attention, shard_sequence, ulysses_attention, usp_attention
from lctrain.attention.kernels import accumulation_dtype
from lctrain.attention.ring_blocks import plan_ring
from lctrain.testing import run_distributed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SECTIONS = ("efficiency", "baselines", "memory", "kernel")
MIB = 2**20

Step = Callable[[], None]


@dataclass(frozen=True)
class Config:
    """Problem size and measurement settings shared by every rank."""

    seq: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    warmup: int
    iters: int


@dataclass
class Measurement:
    """One rank's figures for one implementation: per-iteration wall and CPU seconds (this process, all its
    threads) and peak RSS growth in bytes."""

    times: list[float]
    peak_bytes: int
    checks: dict[str, float] = field(default_factory=dict)
    cpu_times: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------
# Measurement (inside the ranks)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One implementation ready to run on this rank: its forward+backward and any correctness figures."""

    step: Step
    checks: dict[str, float] = field(default_factory=dict)


def measure(cases: dict[str, Case], cfg: Config) -> dict[str, Measurement]:
    """Warm up every case, then run ``cfg.iters`` rounds that time each case once, barrier-aligned.

    Interleaving the cases spreads any drift in machine load evenly over them. Peak memory is the largest RSS
    growth over a case's timed iterations.
    """
    for _ in range(cfg.warmup):
        for case in cases.values():
            case.step()
    results = {name: Measurement([], 0, case.checks) for name, case in cases.items()}
    for _ in range(cfg.iters):
        for name, case in cases.items():
            with StepPeak(torch.device("cpu")) as peak:
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                case.step()
                results[name].times.append(time.perf_counter() - start)
                results[name].cpu_times.append(time.process_time() - cpu_start)
            results[name].peak_bytes = max(results[name].peak_bytes, peak.growth)
    return results


def make_inputs(cfg: Config, seq: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Full-sequence q, k, v, dout ``[B, S, H, D]``, identical on every rank (fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    dtype = DTYPES[cfg.dtype]

    def randn(heads: int) -> Tensor:
        return torch.randn(cfg.batch, seq, heads, cfg.head_dim, generator=generator).to(dtype)

    return randn(cfg.heads), randn(cfg.kv_heads), randn(cfg.kv_heads), randn(cfg.heads)


def shard(tensors: tuple[Tensor, ...], layout: str) -> tuple[Tensor, ...]:
    """This rank's pieces (pure ring over the default group), leaves that require grad except the last (dout)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    pieces = [shard_sequence(t, dim=1, ring_rank=rank, ring_size=size, layout=layout).clone() for t in tensors]
    for piece in pieces[:-1]:
        piece.requires_grad_(True)
    return tuple(pieces)


def autograd_step(
    attend: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor
) -> Step:
    """Forward + backward of ``attend``; the gradients are dropped at the end so no state carries over."""

    def step() -> None:
        torch.autograd.grad(attend(q, k, v), (q, k, v), dout)

    return step


def compare(ours: tuple[Tensor, ...], theirs: tuple[Tensor, ...]) -> dict[str, float]:
    """Max abs difference of (out, dq, dk, dv) and the largest magnitude in ours, for out and for the grads."""
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs)]
    sizes = [a.float().abs().max().item() for a in ours]
    return {"out": diffs[0], "grads": max(diffs[1:]), "out_max": sizes[0], "grads_max": max(sizes[1:])}


def outputs_and_grads(
    attend: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, dout: Tensor
) -> tuple[Tensor, ...]:
    out = attend(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


# ---------------------------------------------------------------------------------------------------------------
# Rank programs
# ---------------------------------------------------------------------------------------------------------------


def cpu_compute(t: Tensor, pass_name: str = "forward") -> Tensor:
    """``t`` in the dtype lctrain's CPU kernel computes a pass's blocks in (``kernels.cpu_compute_dtype``)."""
    return t.to(kernels.cpu_compute_dtype(t.dtype, pass_name))


class CausalCpuFlash(torch.autograd.Function):
    """PyTorch's fused causal CPU flash op on ``[B, H, S, D]``, each pass computing in the dtype lctrain's CPU kernel
    computes that pass in; it keeps its inputs in their own dtype, as lctrain does, and returns theirs."""

    @staticmethod
    def forward(ctx, q, k, v):  # noqa: ANN001, ANN205 (autograd signature)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*map(cpu_compute, (q, k, v)), 0.0, True)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        operands = (cpu_compute(t, "backward") for t in (dout, q, k, v, out))
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*operands, lse, 0.0, True)
        return tuple(g.to(q.dtype) for g in grads)


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Fused causal attention on ``[B, H, S, D]``, each pass in the dtype lctrain's CPU kernel computes it in."""
    return CausalCpuFlash.apply(q, k, v)


def cpu_compute_op(op: Callable[..., tuple[Tensor, ...]], pass_name: str) -> Callable[..., tuple[Tensor, ...]]:
    """``op`` with its tensor arguments cast like lctrain's CPU kernel casts a pass's blocks (``cpu_compute``)."""

    def run(*args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
        args = tuple(cpu_compute(a, pass_name) if isinstance(a, Tensor) else a for a in args)
        kwargs = {name: cpu_compute(a, pass_name) if isinstance(a, Tensor) else a for name, a in kwargs.items()}
        return op(*args, **kwargs)

    return run


def single_process_case(full: tuple[Tensor, ...]) -> Case:
    """T1: fused causal SDPA on the whole sequence ``[B, H, S, D]``, computed by rank 0 alone (the others idle)."""
    if dist.get_rank() != 0:
        return Case(lambda: None)
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in full)
    for t in (q, k, v):
        t.requires_grad_(True)
    return Case(autograd_step(causal_sdpa, q, k, v, dout))


def ring_case(full: tuple[Tensor, ...], layout: str) -> Case:
    q, k, v, dout = shard(full, layout)
    group = dist.group.WORLD
    return Case(autograd_step(lambda q, k, v: ring_attention(q, k, v, group, layout=layout), q, k, v, dout))


def torch_ring_case(full: tuple[Tensor, ...]) -> Case:
    """PyTorch context parallel's ring (``rings.torch_ring``), its CPU ops cast like lctrain's blocks."""
    group = dist.group.WORLD
    forward_op = cpu_compute_op(rings.CPU_FORWARD, "forward")
    backward_op = cpu_compute_op(rings.CPU_BACKWARD, "backward")
    passes = rings.torch_ring(*shard(full, "zigzag"), group, forward_op=forward_op, backward_op=backward_op)

    def forward_backward() -> tuple[Tensor, ...]:
        return (passes.forward(), *passes.backward())

    ours = outputs_and_grads(lambda q, k, v: ring_attention(q, k, v, group), *shard(full, "zigzag"))
    return Case(forward_backward, compare(ours, forward_backward()))


def ulysses_case(full: tuple[Tensor, ...]) -> Case:
    q, k, v, dout = shard(full, "contiguous")
    group = dist.group.WORLD
    return Case(autograd_step(lambda q, k, v: ulysses_attention(q, k, v, group), q, k, v, dout))


def deepspeed_case(full: tuple[Tensor, ...]) -> Case:
    """DeepSpeed-Ulysses ``DistributedAttention`` on ``[B, S/P, H, D]`` (batch dim 0: scatter heads, gather seq)."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    with contextlib.redirect_stdout(sys.stderr):  # it announces the CPU op it builds; keep stdout markdown
        deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing torch process group
    group = dist.group.WORLD

    def local_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [B, S, H/P, D]
        return causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    attention = DistributedAttention(local_attention, group, scatter_idx=2, gather_idx=1)
    q, k, v, dout = shard(full, "contiguous")

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, 0)

    ours = outputs_and_grads(lambda q, k, v: ulysses_attention(q, k, v, group), q, k, v, dout)
    theirs = outputs_and_grads(attend, q, k, v, dout)
    return Case(autograd_step(attend, q, k, v, dout), compare(ours, theirs))


CASES: dict[str, Callable[[tuple[Tensor, ...]], Case]] = {
    "single": single_process_case,
    "ring_zigzag": lambda full: ring_case(full, "zigzag"),
    "ring_contiguous": lambda full: ring_case(full, "contiguous"),
    "torch_ring": torch_ring_case,
    "ulysses": ulysses_case,
    "deepspeed": deepspeed_case,
}


def parallel_cases(cfg: Config, names: list[str]) -> dict[str, Measurement]:
    """Build the named implementations on the same global inputs, then measure them interleaved."""
    full = make_inputs(cfg, cfg.seq)
    return measure({name: CASES[name](full) for name in names}, cfg)


class SendCounter:
    """Stands in for ``dist.batch_isend_irecv`` and adds up the bytes of every ``isend`` it is given."""

    def __init__(self) -> None:
        self.original = dist.batch_isend_irecv
        self.sent = 0

    def __call__(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return self.original(ops)


def memory_and_traffic(cfg: Config, seq_per_rank: int) -> dict[str, int]:
    """Bytes sent per rank by one ``usp_attention`` fwd+bwd (ring over all ranks, Ulysses 1), then the peak RSS
    growth of a second one."""
    size = dist.get_world_size()
    q, k, v, dout = shard(make_inputs(cfg, seq_per_rank * size), "zigzag")
    group = dist.group.WORLD

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return usp_attention(q, k, v, ulysses_group=None, ring_group=group)

    counter = SendCounter()
    dist.batch_isend_irecv = counter
    try:  # the counted iteration doubles as the warm-up of the memory measurement
        out = attend(q, k, v)
        forward_sent = counter.sent
        torch.autograd.grad(out, (q, k, v), dout)
    finally:
        dist.batch_isend_irecv = counter.original
    del out
    with StepPeak(torch.device("cpu")) as peak:
        dist.barrier()
        autograd_step(attend, q, k, v, dout)()
    return {"peak_bytes": peak.growth, "forward_sent": forward_sent, "backward_sent": counter.sent - forward_sent}


# ---------------------------------------------------------------------------------------------------------------
# Report (parent process)
# ---------------------------------------------------------------------------------------------------------------


def time_ms(per_rank: list[Measurement]) -> float:
    """Median over iterations of the slowest rank's time, in milliseconds."""
    return 1e3 * statistics.median(max(times) for times in zip(*(m.times for m in per_rank), strict=True))


def cpu_ms(per_rank: list[Measurement]) -> float:
    """Median over iterations of the busiest rank's CPU time (its process, all threads), in milliseconds: on a
    machine shared with other jobs it moves less than the wall time, which counts the time spent descheduled."""
    return 1e3 * statistics.median(max(times) for times in zip(*(m.cpu_times for m in per_rank), strict=True))


def peak_mib(per_rank: list[Measurement]) -> float:
    return max(m.peak_bytes for m in per_rank) / MIB


def check(per_rank: list[Measurement], key: str) -> float:
    return max(m.checks[key] for m in per_rank)


def deepspeed_version() -> str | None:
    return importlib.metadata.version("deepspeed") if importlib.util.find_spec("deepspeed") else None


def kernel_pass_times(cfg: Config, reps: int) -> list[list[str]]:
    """CPU time (this thread, min of ``reps``) of PyTorch's CPU flash op on the blocks of a zigzag ring of two
    (the causal diagonal S/2 × S/2 and the off-diagonal S/2 × S/4), forward and backward, for each compute dtype
    and input layout: what ``kernels.cpu_bf16_dtypes`` and the contiguous copy are chosen from. Each timing
    includes the copy of the bf16 inputs into the op's dtype and layout."""
    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    piece = cfg.seq // 2
    generator = torch.Generator().manual_seed(0)
    rows = []
    for q_len, k_len, causal in ((piece, piece, True), (piece, piece // 2, False)):
        shapes = [(q_len, cfg.heads), (k_len, cfg.kv_heads), (k_len, cfg.kv_heads), (q_len, cfg.heads)]
        q, k, v, dout = (torch.randn(1, n, h, cfg.head_dim, generator=generator).bfloat16() for n, h in shapes)
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            for layout in ("contiguous", "transposed view"):

                def operands(*tensors: Tensor, dtype: torch.dtype = dtype, layout: str = layout) -> list[Tensor]:
                    if layout == "contiguous":
                        return [t.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format) for t in tensors]
                    return [t.to(dtype).transpose(1, 2) for t in tensors]

                forward, backward = [], []
                for _ in range(reps):
                    start = time.thread_time()
                    qo, ko, vo = operands(q, k, v)
                    out, lse = forward_op(qo, ko, vo, 0.0, causal)
                    forward.append(time.thread_time() - start)
                    start = time.thread_time()
                    backward_op(*operands(dout), qo, ko, vo, out.to(dtype), lse, 0.0, causal)
                    backward.append(time.thread_time() - start)
                results[(dtype, layout)] = (min(forward), min(backward))
        base_forward, base_backward = results[(torch.float32, "contiguous")]
        for (dtype, layout), (forward, backward) in results.items():
            rows.append(
                [
                    f"{q_len}×{k_len}{' causal' if causal else ''}",
                    str(dtype).removeprefix("torch."),
                    layout,
                    f"{forward * 1e3:.0f} ({forward / base_forward:.2f}×)",
                    f"{backward * 1e3:.0f} ({backward / base_backward:.2f}×)",
                ]
            )
    return rows


def report_kernel(cfg: Config, reps: int) -> None:
    torch.set_num_threads(1)
    rows = kernel_pass_times(cfg, reps)
    dtypes = kernels.cpu_bf16_dtypes()
    print(f"\n## 4. The CPU op per pass (blocks of a zigzag ring of 2 at S={cfg.seq}, one thread)\n")
    print(table(["block", "compute dtype", "input layout", "forward ms (vs fp32 contiguous)", "backward ms"], rows))
    print(
        f"\nThread CPU time, min of {reps}, bf16 inputs copied into the op's dtype and layout inside the timing. "
        f"lctrain uses {dtypes.forward} forward, {dtypes.backward} backward ({dtypes.reason}), contiguous."
    )


def report_efficiency(cfg: Config, results: dict[str, list[Measurement]], ranks: int) -> None:
    t1 = results["single"]
    base = time_ms(t1)
    rows = [["fused SDPA, one process (T1)", "1", f"{base:.1f}", f"{peak_mib(t1):.1f}", "—"]]
    for name, label in (
        ("ring_zigzag", "ours: ring_attention, zigzag (TP)"),
        ("ring_contiguous", "ours: ring_attention, contiguous"),
    ):
        tp = time_ms(results[name])
        rows.append([label, str(ranks), f"{tp:.1f}", f"{peak_mib(results[name]):.1f}", f"{base / (ranks * tp):.3f}"])
    print(f"\n## 1. Parallel efficiency (S={cfg.seq}, P={ranks}, causal)\n")
    print(table(["implementation", "ranks", "fwd+bwd (ms)", "peak mem/rank (MiB)", "efficiency T1/(P·TP)"], rows))
    print(
        "\nT1 runs on rank 0 while the other ranks wait at a barrier (no CPU), interleaved with the ring runs. "
        "Target: efficiency ≥ 0.85 for zigzag. Contiguous sharding leaves rank 0 idle after the diagonal block "
        "under causal masking."
    )


def report_baselines(cfg: Config, results: dict[str, list[Measurement]], ranks: int) -> None:
    pairs = [
        (
            "ring_zigzag",
            "ours: ring_attention (zigzag)",
            "torch_ring",
            "PyTorch `_templated_ring_attention` (+ `_backward`)",
        )
    ]
    version = deepspeed_version()
    if version is not None:
        pairs.append(
            ("ulysses", "ours: ulysses_attention", "deepspeed", f"DeepSpeed {version} `DistributedAttention` + SDPA")
        )
    rows = []
    for ours, ours_label, theirs, theirs_label in pairs:
        a, b = results[ours], results[theirs]
        rows.append(
            [
                ours_label,
                f"{time_ms(a):.1f}",
                f"{peak_mib(a):.1f}",
                theirs_label,
                f"{time_ms(b):.1f}",
                f"{peak_mib(b):.1f}",
                f"{time_ms(a) / time_ms(b):.2f}",
                f"{cpu_ms(a) / cpu_ms(b):.2f} ({cpu_ms(a):.0f} / {cpu_ms(b):.0f} ms)",
                f"{peak_mib(a) / peak_mib(b):.2f}",
                f"{check(b, 'out'):.1e} / {check(b, 'grads'):.1e} "
                f"(max \\|out\\| {check(b, 'out_max'):.2f}, \\|grad\\| {check(b, 'grads_max'):.2f})",
            ]
        )
    print(f"\n## 2. Baselines (S={cfg.seq}, P={ranks}, causal, same inputs)\n")
    print(
        table(
            [
                "ours",
                "ms",
                "MiB/rank",
                "theirs",
                "ms",
                "MiB/rank",
                "time ours/theirs",
                "CPU time ours/theirs (busiest rank)",
                "mem ours/theirs",
                "max abs diff out / grads",
            ],
            rows,
        )
    )
    if version is None:
        print("\ndeepspeed not installed (pip install -e .[deepspeed]): the Ulysses row is skipped.")
    print(
        "\nPyTorch's ring runs with its module defaults: head-tail load balancing (fed our zigzag shards), "
        "K/V rotated by one all-gather in the forward and all-to-all for dK/dV in the backward, fp32 merging. "
        "The diffs compare its outputs (and dq, dk, dv) with ours on every rank before timing; DeepSpeed is "
        "compared with our ulysses_attention the same way."
    )


def planned_bytes(ranks: int, seq_per_rank: int, row_bytes: int, gradient_row_bytes: int) -> list[tuple[int, int]]:
    """(forward, backward) bytes each rank sends by its ring plan (zigzag, causal): the K/V rows other ranks fetch
    from it, in the forward, and again in the backward but for the last step's (which the forward kept), plus in
    the backward the dK/dV of the rows it fetched, returned to their owners."""
    sent = []
    for rank in range(ranks):
        plan = plan_ring(rank, ranks, seq_per_rank, causal=True, layout="zigzag")
        forward = sum(step.send.stop - step.send.start for step in plan) * row_bytes
        again = forward - (plan[-1].send.stop - plan[-1].send.start) * row_bytes
        returned = sum(step.keys.stop - step.keys.start for step in plan if step.source) * gradient_row_bytes
        sent.append((forward, again + returned))
    return sent


def report_memory(cfg: Config, seq_per_rank: int, results: dict[int, list[dict[str, int]]]) -> None:
    element = DTYPES[cfg.dtype].itemsize
    accumulator = accumulation_dtype(DTYPES[cfg.dtype]).itemsize
    d_model = cfg.kv_heads * cfg.head_dim
    rows = []
    for ranks, per_rank in results.items():
        peak = max(r["peak_bytes"] for r in per_rank) / MIB
        if ranks == 1:
            traffic = ["—", "—", "—", "—"]
        else:
            planned = planned_bytes(ranks, seq_per_rank, 2 * element * d_model, 2 * accumulator * d_model)
            measured = [(r["forward_sent"], r["backward_sent"]) for r in per_rank]
            ok = " ✓" if measured == planned else " ✗"
            traffic = [
                f"{min(f for f, _ in measured):,} … {max(f for f, _ in measured):,}",
                f"{max(f for f, _ in planned):,}" + ok,
                f"{min(b for _, b in measured):,} … {max(b for _, b in measured):,}",
                f"{max(b for _, b in planned):,}" + ok,
            ]
        rows.append([str(ranks), str(seq_per_rank * ranks), f"{peak:.1f}", *traffic])
    print(f"\n## 3. Memory scaling at fixed S/P={seq_per_rank} (usp_attention: ring over P ranks, Ulysses 1)\n")
    print(
        table(
            [
                "P",
                "S",
                "peak mem/rank (MiB)",
                "fwd bytes sent/rank (min … max)",
                "plan (max; ✓ = every rank)",
                "bwd bytes sent/rank (min … max)",
                "plan (max; ✓ = every rank)",
            ],
            rows,
        )
    )
    print(
        f"\nd_model = Hkv·D = {d_model}. Forward: at ring step s each rank sends ring rank + s the K/V rows it needs "
        f"({cfg.dtype}): the whole piece when that rank comes earlier in the sequence, the first half otherwise "
        f"(zigzag, causal), so one step sends at most 2·{element}·(S/P)·d_model bytes. Backward: the same K/V again "
        f"but the last step's (kept from the forward), plus the dK/dV ({accumulation_dtype(DTYPES[cfg.dtype])}) of "
        f"the rows each rank fetched, returned to their owner. No timings here: P>2 oversubscribes "
        f"{os.cpu_count()} cores. The peak should stay flat from P=2 on (O(S/P)); P=1 has no receive buffers."
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS[:3]), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--seq", type=int, default=16384, help="global sequence length for sections 1 and 2")
    parser.add_argument("--ranks", type=int, default=2, help="P for sections 1 and 2")
    parser.add_argument("--seq-per-rank", type=int, default=4096, help="S/P for section 3")
    parser.add_argument("--memory-ranks", default="1,2,4,8", help="values of P for section 3")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA when fewer than --heads)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


def main() -> None:
    args = parse_args()
    cfg = Config(args.seq, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype, args.warmup, args.iters)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MALLOC_MMAP_THRESHOLD
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skips DeepSpeed's accelerator probe and its warning
    started = time.perf_counter()
    print("# Attention benchmark\n")
    print(f"- command: `{command()}`")
    print(f"- machine: {machine_line()}")
    print(
        f"- problem: B={cfg.batch}, Hq={cfg.heads}, Hkv={cfg.kv_heads}, D={cfg.head_dim}, {cfg.dtype}, causal; "
        f"forward+backward, one thread per rank, {cfg.warmup} warm-up + median of {cfg.iters} timed iterations, "
        f"time = slowest rank"
    )
    sys.stdout.flush()

    names: list[str] = []
    if "efficiency" in args.only:
        names += ["single", "ring_zigzag", "ring_contiguous"]
    if "baselines" in args.only:
        names += [n for n in ("ring_zigzag", "torch_ring") if n not in names]
        names += ["ulysses", "deepspeed"] if deepspeed_version() is not None else []
    results: dict[str, list[Measurement]] = {}
    if names:
        per_rank = run_distributed(parallel_cases, args.ranks, cfg, names)
        results = {name: [r[name] for r in per_rank] for name in names}
    if "efficiency" in args.only:
        report_efficiency(cfg, results, args.ranks)
        sys.stdout.flush()
    if "baselines" in args.only:
        report_baselines(cfg, results, args.ranks)
        sys.stdout.flush()
    if "kernel" in args.only:
        report_kernel(cfg, max(cfg.iters, 3))
        sys.stdout.flush()
    if "memory" in args.only:
        memory_ranks = [int(p) for p in args.memory_ranks.split(",")]
        report_memory(
            cfg,
            args.seq_per_rank,
            {p: run_distributed(memory_and_traffic, p, cfg, args.seq_per_rank) for p in memory_ranks},
        )
    forward, backward = (kernels.cpu_compute_dtype(DTYPES[cfg.dtype], name) for name in ("forward", "backward"))
    if (forward, backward) != (DTYPES[cfg.dtype],) * 2:
        print(
            f"\nCompute dtype: lctrain's CPU kernel computes {cfg.dtype} blocks in {forward} forward and {backward} "
            f"backward (`kernels.cpu_bf16_dtypes`: {kernels.cpu_bf16_dtypes().reason}; section 4 measures both); T1, "
            f"PyTorch's ring op and DeepSpeed's local attention get the same cast per pass (inputs, outputs and "
            f"everything communicated stay {cfg.dtype})."
        )
    print(
        "\nPeak memory = VmHWM − VmRSS around a forward+backward (VmHWM reset by writing 5 to /proc/self/clear_refs "
        "just before it), max over the timed iterations and over ranks (section 3: one forward+backward after a "
        f"warm-up one). Every rank runs with MALLOC_MMAP_THRESHOLD_={MALLOC_MMAP_THRESHOLD} so freed large buffers "
        "go back to the OS and one phase cannot hide another's memory; the timings run with that setting too, "
        "for every implementation alike."
    )
    print(f"\nTotal wall time {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
