"""lctrain's training step against the plain Hugging Face loop (``sides.py``), on CPU or one GPU: step time, tokens/s,
MFU, memory and their ratio; FSDP2's cost; on CUDA what the allocator default saves."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.jobs import add_job_args, job_from_args
from benchmarks.report import GIB, MIB, OnDevice, arguments, percent, progress, save_json, table, title
from benchmarks.runs import Run, malloc_env
from benchmarks.sides import ROWS, SIDES, document_lengths
from benchmarks.timing import median, rounds
from lctrain.flops import document_flops_per_token, flops_per_token, mfu

CHECKPOINTING = ("none", "full")
LABELS = {"lctrain": "lctrain", "hf": "HF loop"}
ALLOCATOR_OFF = "expandable_segments:False"
MEMORY_STEPS = 2  # CPU: measured steps of each memory run, after one warm-up step


@dataclass
class Case:
    """One run and, once it ran, its ``result``: ``ready``, ``first`` (its first step), ``steps`` (the measured
    ones), ``memory`` (the steps of its memory figures), ``profile``."""

    label: str
    side: str
    seq: int
    checkpointing: str
    job: list[str]
    allocator: str | None = None
    fsdp_share: bool = False
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> str | None:  # the first failure's; None when every step finished
        every = [self.result["ready"], *self.result["steps"], *self.result["memory"]]
        return next((r["error"] for r in every if not r["ok"]), None)


def plan(args: argparse.Namespace) -> list[list[Case]]:
    """The runs, by the point (S, checkpointing) whose runs are taken together on CPU."""
    points = []
    for seq in args.seq:
        for checkpointing in args.checkpointing:
            world1 = ("parallel.ring=1", "parallel.ulysses=1", "parallel.dp=1", f"data.seq_len={seq}")
            job = job_from_args(args, *world1, f"parallel.activation_checkpointing={checkpointing}")
            cases = [Case(LABELS[s], s, seq, checkpointing, job, fsdp_share=s == "lctrain") for s in args.sides]
            offloads = {"cpu_offload": args.cpu_offload}
            offloads["activation_offload"] = args.activation_offload and checkpointing == "full"
            for name in (name for name, on in offloads.items() if on and "lctrain" in args.sides):
                cases.append(Case(f"lctrain, {name}", "lctrain", seq, checkpointing, [*job, f"parallel.{name}=true"]))
            points.append(cases)
    if args.allocator_compare and args.device == "cuda" and "lctrain" in args.sides:
        last = next(c for c in points[-1] if c.label == "lctrain")
        off = dataclasses.replace(last, label=f"lctrain, {ALLOCATOR_OFF}", allocator=ALLOCATOR_OFF, fsdp_share=False)
        points.append([off])
    return points


def drive(cases: list[Case], args: argparse.Namespace, *, warmup: int, steps: int, profiles: bool) -> list[dict]:
    """Run ``cases`` side by side in rounds: each one's ``ready``, ``first`` and measured ``steps`` and, with
    ``profiles``, its profiled step."""
    outcomes: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        runs = []
        for case in cases:
            spec = {"side": case.side, "job": case.job, "threads": args.threads if args.device == "cpu" else None,
                    "doc_len": args.doc_len if args.rows == "packed" else None}  # fmt: skip
            runs.append(
                stack.enter_context(Run({case.side: spec}, timeout_s=args.run_timeout, allocator=case.allocator))
            )
            outcomes.append({"ready": runs[-1].describe(case.side)})

        def step(index: int, seed: int) -> dict[str, Any]:
            result = runs[index].step(cases[index].side, cases[index].seq, seed)
            outcomes[index].setdefault("first", result)
            shown = f"{result['step_s']:.2f} s" if result["ok"] else result["error"]
            progress(f"  step {seed + 1}/{warmup + steps}: {cases[index].label} {shown}")
            return result

        sides = {str(i): functools.partial(step, i) for i in range(len(cases))}
        measured = rounds(sides, warmup, steps, timed=False)
        for index, (case, run, outcome) in enumerate(zip(cases, runs, outcomes)):
            outcome["steps"] = measured[str(index)]
            if profiles and (args.profile or case.fsdp_share) and run.failure is None:
                outcome["profile"] = run.profile(case.side, case.seq, seed=99, top=args.top if args.profile else 0)
    return outcomes


def measure(points: list[list[Case]], args: argparse.Namespace) -> None:
    """Every case's results (``Case.result``): on CPU a point's runs together, then again for memory; on CUDA one
    run at a time, its memory figures from its measured steps."""
    for cases in points:
        where = f"S={cases[0].seq}, AC {cases[0].checkpointing}"
        groups = [cases] if args.device == "cpu" else [[case] for case in cases]
        for group in groups:
            progress(f"{where}: {', '.join(c.label for c in group)}")
            with malloc_env(for_memory=False):
                timed = drive(group, args, warmup=args.warmup, steps=args.steps, profiles=True)
            for case, outcome in zip(group, timed):
                case.result = outcome | {"memory": outcome["steps"]}
            if args.device == "cpu":
                progress(f"{where}: memory runs, MALLOC_MMAP_THRESHOLD_ set")
                with malloc_env(for_memory=True):
                    memory = drive(group, args, warmup=1, steps=MEMORY_STEPS, profiles=False)
                for case, outcome in zip(group, memory):
                    case.result["memory"] = outcome["steps"] if outcome["ready"]["ok"] else [outcome["ready"]]
        save_json(args.json, cases=[dataclasses.asdict(c) for cs in points for c in cs if c.result])


def figures(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Step and CPU time, tokens/s, MFU (and the document MFU for packed rows), memory of one finished case."""
    ready, steps, memory = case.result["ready"], case.result["steps"], case.result["memory"]
    step, model = median(steps, "step_s"), ready["model"]
    tokens_per_s, sizes = case.seq / step, (model["params"], model["layers"], model["hidden"])
    peak = args.peak_tflops * 1e12 if args.peak_tflops else ready["peak_flops"]
    document = document_flops_per_token(*sizes, document_lengths(case.seq, args.doc_len))
    reserved = [r["reserved"] for r in memory if r["reserved"] is not None]
    return {"step": step, "cpu": median(steps, "cpu_s"), "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, flops_per_token(*sizes, case.seq), peak),
            "document_mfu": mfu(tokens_per_s, document, peak) if args.rows == "packed" else None,
            "peak": max(r["peak"] for r in memory), "step_peak": max(r["step_peak"] for r in memory),
            "reserved": max(reserved) if reserved else None}  # fmt: skip


def report(args: argparse.Namespace, points: list[list[Case]], seconds: float) -> str:
    cases = [case for cases in points for case in cases]
    done = [c for c in cases if c.error is None]
    figs = {id(c): figures(c, args) for c in done}
    unit, unit_name = (GIB, "GiB") if args.device == "cuda" else (MIB, "MiB")

    def mem(value: float | None) -> str:
        return "—" if value is None else f"{value / unit:,.2f}" if unit == GIB else f"{value / unit:,.0f}"

    device = next((c.result["ready"]["device_name"] for c in done), args.device)
    model = next((c.result["ready"]["model"] for c in done), None)
    rows = f"- rows: {args.rows}" + (f" (documents of {args.doc_len} tokens)" if args.rows == "packed" else "")
    rows += f"; {args.warmup} warm-up + {args.steps} measured steps per run, each run a fresh process"
    rows += f", a point's runs in turn, {args.threads} thread(s) each" if args.device == "cpu" else ""
    lines = [title("Trainer benchmark: lctrain vs a plain Hugging Face loop")]
    lines += [f"- device: {device}"] * (args.device == "cuda")
    lines.append(f"- job (Hydra overrides of the lctrain runs): `{' '.join(cases[0].job)}`")
    lines[-1] += f"; {model['params']:,} parameters" if model else ""
    lines += [rows, f"- total wall time {seconds:.0f} s", ""]
    memory_note = "peak memory = `max_memory_allocated` over the measured steps, step peak = that less the allocated"
    memory_note = memory_note if args.device == "cuda" else (
        f"from a second run of each, 1 warm-up + {MEMORY_STEPS} measured steps with MALLOC_MMAP_THRESHOLD_ set; peak "
        "memory = the resident-set peak less the resident set before the side was built, step peak = VmHWM − VmRSS "
        "before the step")  # fmt: skip
    header = ["run", "S", "AC", "step (s)", "CPU time (s)", "tokens/s", "MFU", "MFU (document)"]
    header += [f"peak memory ({unit_name})", f"step peak ({unit_name})", f"reserved − allocated ({unit_name})"]
    rows = []
    for c in cases:
        where = [c.label, f"{c.seq:,}", c.checkpointing]
        if c.error is not None:
            rows.append([*where, f"**{c.error[:100]}**", *[""] * (len(header) - 3)])
            continue
        f = figs[id(c)]
        fragmentation = None if f["reserved"] is None else f["reserved"] - f["peak"]
        cells = [f"{f['step']:.3f}", f"{f['cpu']:.3f}", f"{f['tokens_per_s']:,.0f}", percent(f["mfu"])]
        cells += [percent(f["document_mfu"]) if args.rows == "packed" else "—", mem(f["peak"]), mem(f["step_peak"])]
        losses = f"{c.result['first']['loss']:.4f} → {c.result['steps'][-1]['loss']:.4f}"
        rows.append([*where, *cells, mem(fragmentation), losses])
    lines += [table([*header, "loss first → last"], rows), "", f"Memory: {memory_note} (`benchmarks/runs.py`).", ""]
    lines += ratio_section(cases, figs) + fsdp_section(cases) + allocator_section(cases, mem, unit_name)
    lines += offload_section(cases, figs, mem, unit_name)
    lines += profile_section(cases, args.device == "cuda") if args.profile else []
    return "\n".join(lines)


def _find(cases: list[Case], label: str, seq: int, checkpointing: str) -> Case | None:
    return next((c for c in cases if (c.label, c.seq, c.checkpointing) == (label, seq, checkpointing)), None)


def ratio_section(cases: list[Case], figs: dict[int, dict]) -> list[str]:
    rows = []
    for seq, checkpointing in dict.fromkeys((c.seq, c.checkpointing) for c in cases):
        ours, theirs = _find(cases, "lctrain", seq, checkpointing), _find(cases, "HF loop", seq, checkpointing)
        if not (ours and theirs):
            continue
        cells = [f"{seq:,}", checkpointing]
        if ours.error or theirs.error:
            rows.append([*cells, "—" if ours.error else "", "—" if theirs.error else "", *["—"] * 5])
            continue
        a, b = figs[id(ours)], figs[id(theirs)]
        speeds = (a["tokens_per_s"], b["tokens_per_s"])
        cells += [f"{speeds[0]:,.0f}", f"{speeds[1]:,.0f}", f"**{speeds[0] / speeds[1]:.3f}**"]
        cells += [f"{a['peak'] / b['peak']:.2f}", f"{a['step_peak'] / b['step_peak']:.2f}"]
        for key in ("loss", "grad_norm"):
            first_a, first_b = ours.result["first"][key], theirs.result["first"][key]
            cells.append(f"{first_a:.6f} / {first_b:.6f} ({abs(first_a - first_b):.1e})")
        rows.append(cells)
    header = ["S", "AC", "lctrain tokens/s", "HF loop tokens/s", "ratio lctrain / HF", "peak memory lctrain / HF"]
    header += ["step peak lctrain / HF", "step 1 loss lctrain / HF (diff)", "step 1 grad norm lctrain / HF (diff)"]
    return ["## Ratio", "", table(header, rows), ""] if rows else []


def fsdp_section(cases: list[Case]) -> list[str]:
    rows = []
    for c in cases:
        profile = c.result.get("profile") if c.fsdp_share else None
        if profile is None:
            continue
        where = [f"{c.seq:,}", c.checkpointing]
        if "error" in profile:
            rows.append([*where, f"profiler failed: {profile['error'][:80]}", "", "", "", ""])
            continue
        kernel = profile.get("kernel_ms")
        cells = ["—", "—"] if kernel is None else [f"{kernel:.1f}", f"{profile['fsdp_kernel_ms']:.1f}"]
        host = [f"{profile['fsdp_host_ms']:.1f} of {profile['wall_ms']:.1f}", percent(profile["fsdp_host_share"])]
        rows.append([*where, *cells, percent(profile.get("fsdp_kernel_share")), *host])
    header = ["S", "AC", "step kernel time (ms)", "in FSDP2's ranges (ms)", "kernel share", "FSDP2 host time (ms)"]
    note = "One profiled lctrain step: kernels launched inside FSDP2's outermost `FSDP::*` ranges; target ≤ 3 %."
    return ["## FSDP2 at world size 1", "", note, "", table([*header, "host share of the step"], rows), ""] * bool(rows)


def allocator_section(cases: list[Case], mem: Any, unit_name: str) -> list[str]:
    off = next((c for c in cases if c.allocator == ALLOCATOR_OFF), None)
    if off is None:
        return []
    rows = []
    for c in (_find(cases, "lctrain", off.seq, off.checkpointing), off):
        if c is None:
            continue
        setting = c.allocator or c.result["ready"].get("allocator") or "(unset)"
        if c.error is not None:
            rows.append([setting, f"**{c.error[:100]}**", "", ""])
            continue
        allocated, reserved = (max(r[key] for r in c.result["memory"]) for key in ("peak", "reserved"))
        rows.append([setting, mem(allocated), mem(reserved), mem(reserved - allocated)])
    header = ["PYTORCH_CUDA_ALLOC_CONF", *(f"{n} ({unit_name})" for n in ("peak allocated", "peak reserved"))]
    header.append(f"fragmentation ({unit_name})")
    where = f"lctrain at S={off.seq:,}, checkpointing {off.checkpointing}"
    return ["## The allocator setting", "", where, "", table(header, rows), ""]


def offload_section(cases: list[Case], figs: dict[int, dict], mem: Any, unit_name: str) -> list[str]:
    rows = []
    for c in cases:
        if c.label not in ("lctrain, cpu_offload", "lctrain, activation_offload"):
            continue
        base = _find(cases, "lctrain", c.seq, c.checkpointing)
        cells = [c.label, f"{c.seq:,}", c.checkpointing]
        if not (base and base.error is None and c.error is None):
            rows.append([*cells, "—", "—", "—", "—"])
            continue
        (step, peak), (base_step, base_peak) = ((figs[id(x)]["step"], figs[id(x)]["peak"]) for x in (c, base))
        rows.append([*cells, f"{step:.3f}", f"{step / base_step - 1:+.1%}", mem(peak), mem(base_peak - peak)])
    header = ["run", "S", "AC", "step (s)", "slowdown vs lctrain", f"peak memory ({unit_name})", f"saved ({unit_name})"]
    return ["## Offload", "", table(header, rows), ""] if rows else []


def profile_section(cases: list[Case], cuda: bool) -> list[str]:
    lines = ["## Top kernels" if cuda else "## Top operators (self CPU time)", ""]
    for c in (c for c in cases if "top" in (c.result.get("profile") or {})):
        top = c.result["profile"]["top"]
        rows = [[name[:100], f"{ms:.2f}", str(n), f"{100 * share:.1f}%"] for name, ms, n, share in top]
        lines += [f"{c.label}, S={c.seq:,}, checkpointing {c.checkpointing}:", ""]
        lines += [table(["kernel" if cuda else "operator", "ms", "calls", "share"], rows), ""]
    return lines


def main() -> None:
    flags = {"doc_len": (2048, "packed rows: tokens per document"), "threads": (1, "CPU: torch threads of each run")}
    flags["cpu_offload"] = (False, "also lctrain with parallel.cpu_offload")
    flags["activation_offload"] = (False, "also parallel.activation_offload (AC full)")
    flags |= {"profile": (False, "print each run's top kernels"), "top": (12, "kernels per run with --profile")}
    flags["run_timeout"] = (300.0, "seconds a run may take to start or to step")
    flags["seq"] = OnDevice([4096], [16384], "sequence lengths")
    parser = arguments(__doc__, warmup=2, steps=OnDevice(10, 5), json=None, **flags)
    add_job_args(parser)
    parser.add_argument("--checkpointing", nargs="+", choices=CHECKPOINTING, help="default: CPU none; CUDA both")
    parser.add_argument("--rows", choices=ROWS, default="one-document", help="one document per row, or packed")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--no-allocator-compare", dest="allocator_compare", action="store_false", help=ALLOCATOR_OFF)
    parser.by_device["checkpointing"] = (["none"], list(CHECKPOINTING))
    args = parser.parse_args()
    started = time.perf_counter()
    points = plan(args)
    measure(points, args)
    print(report(args, points, time.perf_counter() - started))


if __name__ == "__main__":
    main()
