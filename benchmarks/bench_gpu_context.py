"""The longest sequence one GPU trains, lctrain against the plain Hugging Face loop with gradient checkpointing, and
lctrain's memory by layer count (to predict depths and lengths too slow to run), on one GPU.

    python benchmarks/bench_gpu_context.py          # defaults: one 10-minute device call on an H200 (estimated)
    python benchmarks/bench_gpu_context.py --sections layers --fit-seqs 524288 1048576 --check-seq 524288
    python benchmarks/bench_gpu_context.py --device cpu --max-mem-gib 2 ...   # tiny shapes, tests/unit

Sections (``--sections``; the sides are those of ``gpu_sides.py``, both with activation checkpointing ``full``):

1. ``search``: the longest S of one training step, each side. Every probe is a fresh process: one warm-up step at
   ``--warmup-seq`` (AdamW's states then exist, as in every later step), then one step at S. A probe fits when it
   finishes (a CUDA out-of-memory is a clean "does not fit"; so is a probe past ``--probe-timeout``) and, on CPU,
   when its peak (the resident set, ``gpu_sides.py``) stays within ``--max-mem-gib``, the memory this CPU run
   stands in for. The HF loop doubles from ``--start-seq`` while it fits (halving while the start does not), then
   bisects (``--bisect`` steps) between its longest fit and its shortest failure; lengths are multiples of
   ``--seq-unit``, none above ``--max-seq``. lctrain starts at ``--max-seq`` (a fit there means "≥ max-seq": the
   peak grows with S), halving while it does not fit, then bisects. At each side's longest fit: step time, MFU and
   peak memory.
2. ``layers``: lctrain's peak at the same width with ``--layer-counts`` layers (default 2 and 4) at each of
   ``--fit-seqs``; a line fixed + per-layer memory through them per S predicts the full depth (``--layers``); the
   prediction is checked against a real full-depth step at ``--check-seq`` (the search's probe when it ran that
   length), with the error.
3. ``offload``: activation offload's memory saving and slowdown: lctrain with ``--offload-layers`` layers at
   ``--offload-seq``, without and with ``parallel.activation_offload``.

A full 16-layer step at 1M tokens takes many minutes on one GPU, which is why depth is predicted from shallow
models; the issue's 1M/512K plan is the second command above (longer than one device call: split it by section).
``--json PATH`` writes every probe.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_sides import add_shape_args, num_params, run, shape_of
from report import table

from lctrain.flops import flops_per_token

GIB = 2**30
SECTIONS = ("search", "layers", "offload")
LABELS = {"lctrain": "lctrain", "hf": "HF loop (gradient checkpointing)"}


@dataclass
class Probe:
    seq: int
    fits: bool
    result: dict[str, Any]

    @property
    def reason(self) -> str:
        """Why it does not fit: the error, or the simulated memory cap."""
        return self.result["error"] or "over --max-mem-gib"


def fits(result: dict[str, Any], max_mem_bytes: float | None) -> bool:
    """A probe fits when its step finished and, with a memory cap (the CPU stand-in for a GPU's memory), its peak
    stayed within it."""
    return bool(result["ok"]) and (max_mem_bytes is None or result["peak_allocated"] <= max_mem_bytes)


@dataclass
class Search:
    """The longest fitting S for one side; ``probe(seq)`` runs one probe (a fresh process) and says whether it fits."""

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


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``memory = fixed + per_layer × layers`` through ``{layers: memory}`` (two or more points)."""
    n = len(points)
    mean_x, mean_y = sum(points) / n, sum(points.values()) / n
    sxx = sum((x - mean_x) ** 2 for x in points)
    per_layer = sum((x - mean_x) * (y - mean_y) for x, y in points.items()) / sxx
    return mean_y - per_layer * mean_x, per_layer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(parser)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--start-seq", type=int, default=32768, help="the HF loop's first probe")
    parser.add_argument("--max-seq", type=int, default=262144, help="no probe above this")
    parser.add_argument("--seq-unit", type=int, default=8192, help="probed lengths are multiples of this")
    parser.add_argument("--bisect", type=int, default=1, help="bisection steps after doubling")
    parser.add_argument("--warmup-seq", type=int, default=4096, help="each probe's warm-up step")
    parser.add_argument("--layer-counts", type=int, nargs="+", default=[2, 4], help="depths of the layer fit")
    parser.add_argument("--fit-seqs", type=int, nargs="+", default=[131072, 262144], help="lengths of the layer fit")
    parser.add_argument("--check-seq", type=int, default=131072, help="the full-depth run checking the prediction")
    parser.add_argument("--offload-seq", type=int, default=262144, help="activation offload: S")
    parser.add_argument("--offload-layers", type=int, default=4, help="activation offload: layers")
    parser.add_argument("--probe-timeout", type=float, default=240, help="seconds one probe may take (then: no fit)")
    parser.add_argument("--max-mem-gib", type=float, help="CPU: the memory a probe may use (GPU: the device's)")
    parser.add_argument("--json", metavar="PATH", help="also write every probe as JSON")
    args = parser.parse_args(argv)
    if args.max_mem_gib is not None and args.device == "cuda":
        parser.error("--max-mem-gib simulates a device's memory on CPU; on CUDA the GPU's memory is the limit")
    if args.check_seq not in args.fit_seqs:
        parser.error(f"--check-seq {args.check_seq} must be one of --fit-seqs {args.fit_seqs} (its prediction)")
    return args


class Bench:
    """Runs the probes of every section and keeps them for the report."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.max_mem = None if args.max_mem_gib is None else args.max_mem_gib * GIB
        self.log: list[dict[str, Any]] = []
        self.done: dict[tuple, Probe] = {}  # every probe by what it ran: a section reuses another's

    def probe(self, side: str, seq: int, *, layers: int | None = None, offload: bool = False, steps: int = 1) -> Probe:
        """One probe (``layers``: the model's depth by default), or the same one run before."""
        args = self.args
        key = (side, seq, layers or args.layers, offload, steps)
        if key in self.done:
            return self.done[key]
        shape = shape_of(args) | {"layers": layers or args.layers}
        spec = {
            "side": side,
            "device": args.device,
            "shape": shape,
            "seq": seq,
            "checkpointing": "full",
            "rows": "one-document",
            "doc_len": seq,
            "cpu_offload": False,
            "activation_offload": offload,
            "warmup": 1,
            "warmup_seq": min(args.warmup_seq, seq),
            "steps": steps,
            "profile_top": 0,
            "fsdp_share": False,
        }
        what = f"{side}, {shape['layers']} layers, S={seq}" + (", activation offload" if offload else "")
        print(f"probe: {what} ...", file=sys.stderr, flush=True)
        result = run(spec, timeout_s=args.probe_timeout)
        probe = Probe(seq, fits(result, self.max_mem), result)
        peak = f"peak {result['peak_allocated'] / GIB:.2f} GiB" if result.get("peak_allocated") else ""
        verdict = "fits" if probe.fits else f"does not fit ({probe.reason})"
        print(f"    {verdict} {peak} ({result['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        self.log.append({"probe": what, "spec": spec, "fits": probe.fits, "result": result})
        self.done[key] = probe
        return probe


def step_figures(args: argparse.Namespace, probe: Probe, layers: int) -> list[str]:
    """Step time, MFU and peak memory of a fitting probe."""
    result = probe.result
    step = result["step_s"][-1]
    shape = shape_of(args) | {"layers": layers}
    peak = args.peak_tflops * 1e12 if args.peak_tflops else result["peak_flops"]
    per_token = flops_per_token(num_params(shape), layers, shape["hidden"], probe.seq)
    mfu = "n/a" if peak is None else f"{100 * probe.seq / step * per_token / peak:.1f}%"
    return [f"{step:.2f}", mfu, f"{result['peak_allocated'] / GIB:.2f}"]


def search_section(bench: Bench) -> list[str]:
    args = bench.args
    unit = args.seq_unit
    searches = {
        side: Search(lambda seq, side=side: bench.probe(side, seq), unit, args.max_seq) for side in ("hf", "lctrain")
    }
    hf = searches["hf"].run(args.start_seq, bisect=args.bisect)
    lctrain = searches["lctrain"].run(args.max_seq, bisect=args.bisect)  # a fit at --max-seq ends it
    rows = []
    for side, longest in (("lctrain", lctrain), ("hf", hf)):
        search = searches[side]
        failure = search.shortest_failure()
        label = "none fits" if longest is None else f"{'≥ ' if longest >= args.max_seq else ''}{longest:,}"
        cells = [LABELS[side], label, "—" if failure is None else f"{failure:,} ({search.probes[failure].reason[:60]})"]
        cells += ["—"] * 3 if longest is None else step_figures(args, search.probes[longest], args.layers)
        probes = "; ".join(
            f"{p.seq:,} {'✓' if p.fits else '✗'}" for p in sorted(search.probes.values(), key=lambda p: p.seq)
        )
        rows.append([*cells, probes])
    ratio = f"**{'≥ ' if lctrain and lctrain >= args.max_seq else ''}{lctrain / hf:.1f}×**" if lctrain and hf else "—"
    header = ["side", "longest S", "shortest failure", "step (s)", "MFU", "peak memory (GiB)", "probes"]
    memory = "peak allocated" if args.device == "cuda" else f"resident-set peak, cap {args.max_mem_gib} GiB"
    note = (
        f"One training step, activation checkpointing full on both sides, {args.layers} layers; each probe a fresh "
        f"process (a warm-up step at {args.warmup_seq:,} tokens, then one at S); memory = {memory}. lctrain / HF "
        f"loop: {ratio}."
    )
    return ["## Longest sequence", "", note, "", table(header, rows), ""]


def layers_section(bench: Bench) -> list[str]:
    args = bench.args
    rows, check_rows = [], []
    for seq in args.fit_seqs:
        points = {}
        for layers in args.layer_counts:
            probe = bench.probe("lctrain", seq, layers=layers)
            cell = f"{probe.result['peak_allocated'] / GIB:.2f}" if probe.fits else probe.reason[:40]
            rows.append([f"{seq:,}", str(layers), cell])
            if probe.fits:
                points[layers] = probe.result["peak_allocated"]
        if len(points) < 2:
            rows.append([f"{seq:,}", f"{args.layers} (predicted)", "— (fewer than two depths fit)"])
            continue
        fixed, per_layer = fit_line(points)
        predicted = fixed + per_layer * args.layers
        rows.append(
            [
                f"{seq:,}",
                f"{args.layers} (predicted)",
                f"**{predicted / GIB:.2f}** = {fixed / GIB:.2f} + {args.layers} × {per_layer / GIB:.3f}",
            ]
        )
        if seq == args.check_seq:
            real = bench.probe("lctrain", seq)  # the search's probe, when it ran this length
            if real.fits:
                measured = real.result["peak_allocated"]
                check_rows.append(
                    [f"{seq:,}", str(args.layers), f"{predicted / GIB:.2f}", f"{measured / GIB:.2f}"]
                    + [f"{(predicted - measured) / measured:+.1%}"]
                )
            else:
                check_rows.append([f"{seq:,}", str(args.layers), f"{predicted / GIB:.2f}", real.reason[:60], "—"])
    lines = ["## lctrain's memory by layer count", "", table(["S", "layers", "peak memory (GiB)"], rows), ""]
    if check_rows:
        header = ["S", "layers", "predicted (GiB)", "measured (GiB)", "error"]
        lines += ["Prediction against a real full-depth step:", "", table(header, check_rows), ""]
    return lines


def offload_section(bench: Bench) -> list[str]:
    args = bench.args
    rows, results = [], {}
    for offload in (False, True):
        probe = bench.probe("lctrain", args.offload_seq, layers=args.offload_layers, offload=offload, steps=2)
        results[offload] = probe
        label = "with activation offload" if offload else "without"
        if not probe.fits:
            rows.append([label, probe.reason[:60], "", ""])
            continue
        rows.append([label, f"{probe.result['step_s'][-1]:.2f}", f"{probe.result['peak_allocated'] / GIB:.2f}", ""])
    if results[False].fits and results[True].fits:
        slower = results[True].result["step_s"][-1] / results[False].result["step_s"][-1] - 1
        saved = results[False].result["peak_allocated"] - results[True].result["peak_allocated"]
        rows[-1][-1] = f"saves {saved / GIB:.2f} GiB, {slower:+.1%} step time"
    where = f"lctrain, {args.offload_layers} layers, S={args.offload_seq:,}, full checkpointing, second step timed"
    header = ["activation offload", "step (s)", "peak memory (GiB)", "effect"]
    return ["## Activation offload", "", where, "", table(header, rows), ""]


def main(argv: list[str] | None = None) -> None:
    """Each section is printed (and the JSON rewritten) as soon as it is done: a run stopped by a timeout keeps what
    it measured."""
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/bench_gpu_context.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    bench = Bench(args)
    shape = shape_of(args)
    print("# Longest context on one GPU: lctrain vs a plain Hugging Face loop\n")
    print(f"- command: `{command}`")
    print(
        f"- model: hidden {shape['hidden']}, intermediate {shape['intermediate']}, {shape['layers']} layers, "
        f"{shape['heads']}/{shape['kv_heads']} heads, vocab {shape['vocab']} (untied)\n",
        flush=True,
    )
    sections = {"search": search_section, "layers": layers_section, "offload": offload_section}
    for name in args.sections:
        print("\n".join(sections[name](bench)), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"command": command, "probes": bench.log}, indent=1))
    device = next((p["result"]["device_name"] for p in bench.log if p["result"].get("device_name")), args.device)
    print(f"device: {device}; {len(bench.log)} probes, total wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
