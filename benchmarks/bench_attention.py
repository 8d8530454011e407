"""Benchmark exact distributed attention on CPU: parallel efficiency, baselines, memory scaling and ring traffic; the
CPU op per pass, and on a block that a sliding window cuts."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks import rings
from benchmarks.report import MIB, arguments, listed, table, title
from benchmarks.runs import MALLOC_MMAP_THRESHOLD, follow_malloc_env
from benchmarks.timing import clock, gathered_slowest, median, median_seconds, rounds, slowest
from lctrain.attention import kernels, ring_attention, ulysses_attention, usp_attention
from lctrain.attention.kernels import accumulation_dtype, bands
from lctrain.attention.kernels.base import visible_keys
from lctrain.attention.kernels.torch_cpu import TORCH_CPU_FLASH, cpu_attend, cpu_attend_backward
from lctrain.testing import run_distributed
from lctrain.train.meter import StepMemory

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SECTIONS = ("efficiency", "baselines", "memory", "kernel", "window")
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def inputs(cfg: argparse.Namespace, seq: int) -> tuple[Tensor, ...]:
    """Full-sequence q, k, v, dout ``[B, S, H, D]``, identical on every rank."""
    return rings.random_inputs(seq, cfg.heads, cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype], batch=cfg.batch)


Case = tuple[Callable[[], Any], dict[str, float]]  # an implementation on this rank: its fwd+bwd, its checks


def autograd_step(attend: Attend, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> Callable[[], Any]:
    """Forward + backward of ``attend``; the gradients are dropped at the end so no state carries over."""
    return lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), dout)


def outputs_and_grads(attend: Attend, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> tuple[Tensor, ...]:
    out = attend(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def compare(ours: tuple[Tensor, ...], theirs: tuple[Tensor, ...]) -> dict[str, float]:
    """Max abs difference of (out, dq, dk, dv) and the largest magnitude in ours, for out and for the grads."""
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs)]
    sizes = [a.float().abs().max().item() for a in ours]
    return {"out": diffs[0], "grads": max(diffs[1:]), "out_max": sizes[0], "grads_max": max(sizes[1:])}


def sharded(attend: Callable[..., Tensor], layout: str) -> Callable[[tuple[Tensor, ...]], Case]:
    """``attend(q, k, v, group)`` over the default group on this rank's ``layout`` shards."""
    return lambda full: (
        autograd_step(lambda q, k, v: attend(q, k, v, dist.group.WORLD), *rings.rank_shards(full, layout)),
        {},
    )


def cast_op(op: Callable[..., tuple[Tensor, ...]], pass_name: str) -> Callable[..., tuple[Tensor, ...]]:
    """``op`` with its tensors cast to the dtype lctrain's CPU kernel computes a pass in (``cpu_compute_dtype``)."""

    def cast(a: Any) -> Any:
        return a.to(kernels.cpu_compute_dtype(a.dtype, pass_name)) if isinstance(a, Tensor) else a

    return lambda *args, **kwargs: op(*map(cast, args), **{name: cast(a) for name, a in kwargs.items()})


def single_process_case(full: tuple[Tensor, ...]) -> Case:
    """T1: lctrain's kernel on the whole sequence (``ring_attention`` without a group), on rank 0 alone."""
    if dist.get_rank() != 0:
        return (lambda: None), {}
    return autograd_step(ring_attention, *(t.clone().requires_grad_(i < 3) for i, t in enumerate(full))), {}


def torch_ring_case(full: tuple[Tensor, ...]) -> Case:
    """PyTorch context parallel's ring (``rings.torch_ring``), its CPU ops cast like lctrain's blocks."""
    ops = {"forward_op": cast_op(rings.CPU_FORWARD, "forward"), "backward_op": cast_op(rings.CPU_BACKWARD, "backward")}
    passes = rings.torch_ring(*rings.rank_shards(full, "zigzag"), dist.group.WORLD, **ops)
    ours = outputs_and_grads(functools.partial(ring_attention, group=dist.group.WORLD), *rings.rank_shards(full))
    return (lambda: (passes.forward(), passes.backward())), compare(ours, (passes.forward(), *passes.backward()))


def deepspeed_case(full: tuple[Tensor, ...]) -> Case:
    """DeepSpeed-Ulysses ``DistributedAttention`` on ``[B, S/P, H, D]``, its local attention the CPU op of T1."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    with contextlib.redirect_stdout(sys.stderr):  # it announces the CPU op it builds; keep stdout markdown
        deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing torch process group
    attention = DistributedAttention(ring_attention, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    q, k, v, dout = rings.rank_shards(full, "contiguous")

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, 0)

    ours = outputs_and_grads(lambda q, k, v: ulysses_attention(q, k, v, dist.group.WORLD), q, k, v, dout)
    return autograd_step(attend, q, k, v, dout), compare(ours, outputs_and_grads(attend, q, k, v, dout))


CASES: dict[str, Callable[[tuple[Tensor, ...]], Case]] = {
    "single": single_process_case,
    "ring_zigzag": sharded(functools.partial(ring_attention, layout="zigzag"), "zigzag"),
    "ring_contiguous": sharded(functools.partial(ring_attention, layout="contiguous"), "contiguous"),
    "torch_ring": torch_ring_case,
    "ulysses": sharded(ulysses_attention, "contiguous"),
    "deepspeed": deepspeed_case,
}


def parallel_cases(cfg: argparse.Namespace, names: list[str]) -> dict[str, dict[str, Any]]:
    """Build the named implementations on the same global inputs, then measure them in rounds (``timing.rounds``,
    each round's figures the slowest rank's): per case its ``rounds`` (seconds and peak memory growth) and
    ``checks`` (the largest over ranks)."""
    follow_malloc_env()
    cases = {name: CASES[name](inputs(cfg, cfg.seq)) for name in names}
    steps = {name: lambda _, case=case: case[0]() for name, case in cases.items()}
    measured = gathered_slowest(rounds(steps, cfg.warmup, cfg.iters, memory=True, barrier=True))
    checks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(checks, {name: case[1] for name, case in cases.items()})
    return {name: {"rounds": measured[name], "checks": slowest([[c[name]] for c in checks])[0]} for name in names}


def memory_and_traffic(cfg: argparse.Namespace, seq_per_rank: int) -> dict[str, int]:
    """Bytes sent per rank by one ``usp_attention`` fwd+bwd (a ring of all ranks), then a second one's peak growth."""
    follow_malloc_env()
    q, k, v, dout = rings.rank_shards(inputs(cfg, seq_per_rank * dist.get_world_size()), "zigzag")
    attend = functools.partial(usp_attention, ulysses_group=None, ring_group=dist.group.WORLD)
    sent, original = [0], dist.batch_isend_irecv

    def counted(ops: list[dist.P2POp]) -> list[dist.Work]:  # dist.batch_isend_irecv, adding up what it sends
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return original(ops)

    with mock.patch.object(dist, "batch_isend_irecv", counted):  # doubles as the memory measurement's warm-up
        out = attend(q, k, v)
        forward_sent = sent[0]
        torch.autograd.grad(out, (q, k, v), dout)
    del out
    with StepMemory(torch.device("cpu"), collect=True) as peak:
        dist.barrier()
        autograd_step(attend, q, k, v, dout)()
    return {"peak_bytes": peak.growth, "forward_sent": forward_sent, "backward_sent": sent[0] - forward_sent}


def time_ms(case: dict[str, Any], key: str = "wall") -> float:
    """Median over rounds of the slowest rank's time (``cpu``: the busiest rank's CPU time), in milliseconds."""
    return 1e3 * median(case["rounds"], key)


def peak_mib(case: dict[str, Any]) -> float:
    return max(r["growth"] for r in case["rounds"]) / MIB


def deepspeed_version() -> str | None:
    return importlib.metadata.version("deepspeed") if importlib.util.find_spec("deepspeed") else None


def block_passes(inputs: list[Tensor], dtype: torch.dtype, layout: str, causal: bool, _round: int = 0) -> dict:
    """One forward and one backward of PyTorch's CPU flash op on a block (``inputs``: q, k, v, dout in bf16, ``[1, S,
    H, D]``) computing in ``dtype``, its operands copied contiguous or given as transposed views (``layout``): this
    thread's seconds of each pass, the copy of the inputs into the op's dtype and layout included."""

    def operands(*tensors: Tensor) -> list[Tensor]:
        if layout == "contiguous":
            return [t.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format) for t in tensors]
        return [t.to(dtype).transpose(1, 2) for t in tensors]

    q, k, v, dout = inputs
    with clock() as forward:
        qo, ko, vo = operands(q, k, v)
        out, lse = rings.CPU_FORWARD(qo, ko, vo, 0.0, causal)
    with clock() as backward:
        rings.CPU_BACKWARD(*operands(dout), qo, ko, vo, out.to(dtype), lse, 0.0, causal)
    return {"forward": forward["thread"], "backward": backward["thread"]}


def report_kernel(cfg: argparse.Namespace, reps: int) -> None:
    """CPU time (this thread, min of ``reps``) of ``block_passes`` on the blocks of a zigzag ring of two (the causal
    diagonal S/2 × S/2 and the off-diagonal S/2 × S/4), for each compute dtype and input layout: what
    ``kernels.cpu_bf16_dtypes`` and the contiguous copy are chosen from."""
    torch.set_num_threads(1)
    piece, rows, generator = cfg.seq // 2, [], torch.Generator().manual_seed(0)
    ways = [(d, layout) for d in (torch.float32, torch.bfloat16) for layout in ("contiguous", "transposed view")]
    for q_len, k_len, causal in ((piece, piece, True), (piece, piece // 2, False)):
        shapes = [(q_len, cfg.heads), (k_len, cfg.kv_heads), (k_len, cfg.kv_heads), (q_len, cfg.heads)]
        inputs = [torch.randn(1, n, h, cfg.head_dim, generator=generator).bfloat16() for n, h in shapes]
        sides = {way: functools.partial(block_passes, inputs, *way, causal) for way in ways}
        timed = rounds(sides, 0, reps, alternate=False, timed=False)
        fastest = {way: [min(r[key] for r in timed[way]) for key in ("forward", "backward")] for way in ways}
        base, block = fastest[(torch.float32, "contiguous")], f"{q_len}×{k_len}{' causal' if causal else ''}"
        for (dtype, layout), seconds in fastest.items():
            times = [f"{t * 1e3:.0f} ({t / b:.2f}×)" for t, b in zip(seconds, base)]
            rows.append([block, str(dtype).removeprefix("torch."), layout, *times])
    dtypes = kernels.cpu_bf16_dtypes()
    print(f"\n## 4. The CPU op per pass (blocks of a zigzag ring of 2 at S={cfg.seq}, one thread)\n")
    print(table(["block", "compute dtype", "input layout", "forward ms (vs fp32 contiguous)", "backward ms"], rows))
    print(
        f"\nThread CPU time, min of {reps}, bf16 inputs copied into the op's dtype and layout inside the timing. "
        f"lctrain uses {dtypes.forward} forward, {dtypes.backward} backward ({dtypes.reason}), contiguous."
    )


def window_pass(tensors: list[Tensor], scale: float, window_left: int | None, visible: Any = None) -> None:
    """Forward + backward of ``TORCH_CPU_FLASH`` on a causal block (row tiles when ``window_left`` is set); with the
    band's mask ``visible``, of the CPU op once over the whole block."""
    q, k, v, dout = tensors
    if visible is not None:
        cpu_attend_backward(dout, q, k, v, *cpu_attend(q, k, v, visible, scale), visible, scale)
        return
    out, lse = TORCH_CPU_FLASH.forward(q, k, v, causal=True, scale=scale, window_left=window_left)
    TORCH_CPU_FLASH.backward(dout, q, k, v, out, lse, causal=True, scale=scale, window_left=window_left)


def report_window(cfg: argparse.Namespace) -> None:
    """A diagonal block of ``--rows`` queries cut by each window of ``--windows``: one masked call of the CPU op, row
    tiles of each ``--tiles`` (``bands.BAND_TILE_ROWS``), and the plain causal block (fp32, one thread)."""
    torch.set_num_threads(1)
    gen, rows = torch.Generator().manual_seed(0), []
    tensors = [torch.randn(1, cfg.rows, cfg.heads, cfg.head_dim, generator=gen) for _ in range(4)]
    scale = cfg.head_dim**-0.5
    plain = median_seconds(functools.partial(window_pass, tensors, scale, None), cfg.iters) * 1e3
    for window in cfg.windows:
        seen = sum(min(window, row + 1) for row in range(cfg.rows))
        visible = visible_keys(cfg.rows, cfg.rows, causal=True, window_left=window - 1, device=torch.device("cpu"))
        ms = median_seconds(functools.partial(window_pass, tensors, scale, None, visible), cfg.iters) * 1e3
        rows.append([str(window), "one masked call", f"{ms:.0f}", f"{cfg.rows**2 / seen:.2f}"])
        for tile in cfg.tiles:
            bands.BAND_TILE_ROWS = tile  # band_tiles reads it from its own module, kernels.bands
            tiles = bands.band_tiles(cfg.rows, cfg.rows, causal=True, window_left=window - 1)
            computed = sum((r.stop - r.start) * (c.stop - c.start) for r, c in tiles)
            ms = median_seconds(functools.partial(window_pass, tensors, scale, window - 1), cfg.iters) * 1e3
            rows.append([str(window), f"row tiles of {tile}", f"{ms:.0f}", f"{computed / seen:.2f}"])
        rows.append([str(window), "plain causal block (no window)", f"{plain:.0f}", f"{cfg.rows**2 / 2 / seen:.2f}"])
    where = f"{cfg.heads} heads × {cfg.head_dim}, fp32, one thread, forward+backward, a warm-up + median of {cfg.iters}"
    print(f"\n## 5. A diagonal block of {cfg.rows} queries that a window cuts ({where})\n")
    print(table(["window", "way", "ms", "pairs computed / pairs seen"], rows))


def report_efficiency(cfg: argparse.Namespace, results: dict[str, dict[str, Any]], ranks: int) -> None:
    base = time_ms(results["single"])
    rows = [["fused SDPA, one process (T1)", "1", f"{base:.1f}", f"{peak_mib(results['single']):.1f}", "—"]]
    for name, label in (("ring_zigzag", "zigzag (TP)"), ("ring_contiguous", "contiguous")):
        tp, peak = time_ms(results[name]), peak_mib(results[name])
        rows.append([f"ours: ring_attention, {label}", str(ranks), f"{tp:.1f}", f"{peak:.1f}"])
        rows[-1].append(f"{base / (ranks * tp):.3f}")
    print(f"\n## 1. Parallel efficiency (S={cfg.seq}, P={ranks}, causal)\n")
    print(table(["implementation", "ranks", "fwd+bwd (ms)", "peak mem/rank (MiB)", "efficiency T1/(P·TP)"], rows))


def report_baselines(cfg: argparse.Namespace, results: dict[str, dict[str, Any]], ranks: int) -> None:
    torch_ring = "PyTorch `_templated_ring_attention` (+ `_backward`)"
    pairs = [("ring_zigzag", "ours: ring_attention (zigzag)", "torch_ring", torch_ring)]
    if (version := deepspeed_version()) is not None:
        deepspeed = f"DeepSpeed {version} `DistributedAttention` + SDPA"
        pairs.append(("ulysses", "ours: ulysses_attention", "deepspeed", deepspeed))
    rows = []
    for ours, ours_label, theirs, theirs_label in pairs:
        a, b = results[ours], results[theirs]
        checks = b["checks"]
        diffs = f"{checks['out']:.1e} / {checks['grads']:.1e} (max \\|out\\| {checks['out_max']:.2f}, "
        diffs += f"\\|grad\\| {checks['grads_max']:.2f})"
        cpu = f"{time_ms(a, 'cpu') / time_ms(b, 'cpu'):.2f} ({time_ms(a, 'cpu'):.0f} / {time_ms(b, 'cpu'):.0f} ms)"
        cells = [ours_label, f"{time_ms(a):.1f}", f"{peak_mib(a):.1f}", theirs_label, f"{time_ms(b):.1f}"]
        cells += [f"{peak_mib(b):.1f}", f"{time_ms(a) / time_ms(b):.2f}", cpu, f"{peak_mib(a) / peak_mib(b):.2f}"]
        rows.append([*cells, diffs])
    print(f"\n## 2. Baselines (S={cfg.seq}, P={ranks}, causal, same inputs)\n")
    header = ["ours", "ms", "MiB/rank", "theirs", "ms", "MiB/rank", "time ours/theirs"]
    header += ["CPU time ours/theirs (busiest rank)", "mem ours/theirs", "max abs diff out / grads"]
    print(table(header, rows))
    if version is None:
        print("\ndeepspeed not installed (pip install -e .[deepspeed]): the Ulysses row is skipped.")


def report_memory(cfg: argparse.Namespace, seq_per_rank: int, results: dict[int, list[dict[str, int]]]) -> None:
    accumulator, d_model, rows = accumulation_dtype(DTYPES[cfg.dtype]), cfg.kv_heads * cfg.head_dim, []
    for ranks, per_rank in results.items():
        peak = max(r["peak_bytes"] for r in per_rank) / MIB
        traffic = ["—"] * 4
        if ranks > 1:
            rates = (2 * DTYPES[cfg.dtype].itemsize * d_model, 2 * accumulator.itemsize * d_model)  # K+V, dK+dV rows
            planned = [t.bytes(*rates) for t in rings.ring_traffic(ranks, seq_per_rank)]
            measured = [(r["forward_sent"], r["backward_sent"]) for r in per_rank]
            ok = " ✓" if measured == planned else " ✗"
            traffic = []
            for index in (0, 1):
                sent = [m[index] for m in measured]
                traffic += [f"{min(sent):,} … {max(sent):,}", f"{max(p[index] for p in planned):,}" + ok]
        rows.append([str(ranks), str(seq_per_rank * ranks), f"{peak:.1f}", *traffic])
    print(f"\n## 3. Memory scaling at fixed S/P={seq_per_rank} (usp_attention: ring over P ranks, Ulysses 1)\n")
    header = ["P", "S", "peak mem/rank (MiB)", "fwd bytes sent/rank (min … max)", "plan (max; ✓ = every rank)"]
    header += ["bwd bytes sent/rank (min … max)", "plan (max; ✓ = every rank)"]
    print(table(header, rows))
    print(f"\nd_model = Hkv·D = {d_model}; K/V sent in {cfg.dtype}, dK/dV in {accumulator}; {os.cpu_count()} cores.")


def main() -> None:
    flags = {"seq": (16384, "global sequence length for sections 1 and 2"), "ranks": (2, "P for sections 1 and 2")}
    flags |= {"seq_per_rank": (4096, "S/P for section 3"), "batch": 1, "rows": (4096, "section 5's block")}
    flags |= {"windows": ([512, 2048], "section 5's windows"), "tiles": ([64, 128, 256, 512, 1024], "its row tiles")}
    parser = arguments(__doc__, heads=8, kv_heads=8, head_dim=64, warmup=1, iters=3, **flags)
    only = f"comma-separated subset of {SECTIONS}"
    parser.add_argument("--only", type=listed(str, SECTIONS), default=list(SECTIONS[:3]), help=only)
    parser.add_argument("--memory-ranks", type=listed(int), default=[1, 2, 4, 8], help="values of P for section 3")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MALLOC_MMAP_THRESHOLD
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skips DeepSpeed's accelerator probe and its warning
    started = time.perf_counter()
    sys.stdout.reconfigure(line_buffering=True)
    print(title("Attention benchmark"))
    print(f"- problem: B={args.batch}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, causal; "
          f"forward+backward, one thread per rank, {args.warmup} warm-up + median of {args.iters} timed iterations, "
          "time = slowest rank")  # fmt: skip
    names: list[str] = []
    if "efficiency" in args.only:
        names += ["single", "ring_zigzag", "ring_contiguous"]
    if "baselines" in args.only:
        names += [n for n in ("ring_zigzag", "torch_ring") if n not in names]
        names += ["ulysses", "deepspeed"] if deepspeed_version() is not None else []
    results = run_distributed(parallel_cases, args.ranks, args, names)[0] if names else {}
    if "efficiency" in args.only:
        report_efficiency(args, results, args.ranks)
    if "baselines" in args.only:
        report_baselines(args, results, args.ranks)
    if "kernel" in args.only:
        report_kernel(args, max(args.iters, 3))
    if "window" in args.only:
        report_window(args)
    if "memory" in args.only:
        measured = {p: run_distributed(memory_and_traffic, p, args, args.seq_per_rank) for p in args.memory_ranks}
        report_memory(args, args.seq_per_rank, measured)
    forward, backward = (kernels.cpu_compute_dtype(DTYPES[args.dtype], name) for name in ("forward", "backward"))
    in_dtype = {"efficiency", "baselines", "memory"} & set(args.only)  # sections 4 and 5 state their dtypes
    if in_dtype and (forward, backward) != (DTYPES[args.dtype],) * 2:
        reason = kernels.cpu_bf16_dtypes().reason
        print(f"\nCompute dtype: {args.dtype} blocks computed in {forward} forward, {backward} backward ({reason}).")
    print(f"\nTotal wall time {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
