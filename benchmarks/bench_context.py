"""The longest sequence each side (``sides.py``) trains in one step, on CPU within a memory budget or on one GPU;
lctrain's memory by layer count, what activation offload saves, and the step peak per rank against S/P with every memory
saver on."""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.jobs import add_job_args, job_from_args
from benchmarks.report import GIB, MIB, OnDevice, arguments, fit_line, percent, progress, save_json, table, title
from benchmarks.runs import Probe, Search, malloc_env, run_steps
from lctrain.flops import flops_per_token, mfu

SECTIONS = ("search", "layers", "offload", "scaling")
MESHES = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (4, 2)}  # scaling: ranks -> (ring, ulysses)
# the integer flags whose defaults depend on the device
DEFAULTS = {
    "ring": OnDevice(4, 1, "lctrain's ring degree"),
    "start_seq": OnDevice(1024, 32768, "the HF loop's first probe"),
    "max_seq": OnDevice(32768, 262144, "no probe above this"),
    "seq_unit": OnDevice(256, 8192, "probed lengths are multiples of this"),
    "warmup_seq": OnDevice(512, 4096, "each probe's warm-up step"),
    "layer_counts": OnDevice([1, 2], [2, 4], "depths of the layer fit"),
    "fit_seqs": OnDevice([4096, 8192], [131072, 262144], "lengths of the layer fit"),
    "check_seq": OnDevice(4096, 131072, "the full-depth run checking the prediction"),
    "offload_seq": OnDevice(8192, 262144, "activation offload: S"),
    "offload_layers": OnDevice(2, 4, "activation offload: layers"),
}


def fits(result: dict[str, Any], budget: int | None) -> bool:
    """A probe fits when its step finished and, with a budget (CPU), its step peak stayed within it."""
    return bool(result["ok"]) and (budget is None or result["step_peak"] <= budget)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    flags = {"ulysses": (1, "lctrain's Ulysses degree"), "bisect": (1, "bisection steps after doubling")}
    flags["target_ratio"] = (4.0, "lctrain starts at this × the HF loop's S")
    flags["probe_timeout"] = (240.0, "seconds a probe may take to start or step")
    parser = arguments(__doc__, json=None, **flags, **DEFAULTS)
    add_job_args(parser)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, help="default: search (CPU), all but scaling (CUDA)")
    parser.add_argument("--loss-chunk-tokens", type=int, help="lctrain's train.loss_chunk_tokens (default: the job's)")
    parser.add_argument("--hf-checkpointing", choices=("none", "full"), help="the HF loop's (CPU none, CUDA full)")
    parser.add_argument("--budget-mib", type=int, help="CPU: the step peak a process may add (default 1024)")
    scaling = parser.add_argument_group("scaling: every memory saver on, one process group per P")
    scaling.add_argument("--scaling-ranks", type=int, nargs="+", choices=sorted(MESHES), default=[1, 2, 4, 8])
    scaling.add_argument("--per-rank", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192], help="S/P values")
    scaling.add_argument("--max-scaling-seq", type=int, default=16384, help="skip longer S (step time grows as S²)")
    scaling.add_argument("--fit-min-per-rank", type=int, default=2048, help="fit S/P ≥ this (below: a floor)")
    scaling.add_argument("--baseline-seqs", type=int, nargs="*", default=[1024, 2048, 4096, 8192], help="HF loop's S")
    scaling.add_argument("--mlp-chunk-tokens", type=int, default=256, help="lctrain's parallel.mlp_chunk_tokens")
    scaling.add_argument("--safe-gib", type=float, default=16.0, help="stop a run whose ranks pass this together")
    scaling.add_argument("--plot", default="docs/memory_per_rank.png", help="the PNG of step peak per rank vs S/P")
    parser.by_device |= {"hf_checkpointing": ("none", "full"), "sections": (["search"], list(SECTIONS[:3]))}
    parser.by_device["budget_mib"] = (1024, None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and "scaling" in (args.sections or []):
        parser.error("--sections scaling runs CPU process groups: --device cpu")
    if args.device == "cuda" and args.budget_mib is not None:
        parser.error("--budget-mib limits a CPU run's memory; on CUDA the GPU's memory is the limit")
    divisor = 2 * args.ring * args.ulysses  # zigzag sharding
    for name in ("seq_unit", "warmup_seq", "start_seq", "max_seq"):
        if getattr(args, name) % divisor:
            parser.error(f"--{name.replace('_', '-')} must be a multiple of 2·ring·ulysses = {divisor}")
    if args.start_seq % args.seq_unit or args.max_seq % args.seq_unit:
        parser.error("--start-seq and --max-seq must be multiples of --seq-unit")
    if args.check_seq not in args.fit_seqs:
        parser.error(f"--check-seq {args.check_seq} must be one of --fit-seqs {args.fit_seqs} (its prediction)")
    return args


@dataclass
class Bench:
    """Runs the probes of every section and keeps them for the report."""

    args: argparse.Namespace
    log: list[dict[str, Any]] = field(default_factory=list)
    done: dict[tuple, Probe] = field(default_factory=dict)  # every probe by what it ran: a section reuses another's
    points: list[dict[str, Any]] = field(default_factory=list)  # the scaling section's steps

    @functools.cached_property
    def depth(self) -> int:
        """The job's number of layers."""
        from lctrain.config import load_config

        return load_config(self.job("lctrain", self.args.check_seq, None, False)).model.num_layers

    @property
    def budget(self) -> int | None:
        return None if self.args.budget_mib is None else self.args.budget_mib * MIB

    def job(self, side: str, seq: int, layers: int | None, offload: bool, mesh: tuple | None = None) -> list[str]:
        args = self.args
        ring, ulysses = mesh or ((args.ring, args.ulysses) if side == "lctrain" else (1, 1))
        lctrain = side == "lctrain"
        changes = [f"parallel.ring={ring}", f"parallel.ulysses={ulysses}", "parallel.dp=1", f"data.seq_len={seq}"]
        changes.append(f"parallel.activation_checkpointing={'full' if lctrain else args.hf_checkpointing}")
        chunk = args.loss_chunk_tokens
        changes += [f"train.loss_chunk_tokens={chunk}"] * (lctrain and chunk is not None)
        changes += [f"model.num_layers={layers}"] * (layers is not None)
        changes += ["parallel.activation_offload=true"] * offload
        changes += [f"parallel.mlp_chunk_tokens={args.mlp_chunk_tokens}"] * (lctrain and mesh is not None)  # scaling
        return job_from_args(args, *changes)

    def probe(self, side: str, seq: int, *, layers: int | None = None, offload: bool = False, steps: int = 1) -> Probe:
        """One probe (``layers``: the job's depth by default), or the same one run before: its steps' times, largest
        peak and step peak and the run's description, or the first failure."""
        args, layers = self.args, None if layers is not None and layers == self.depth else layers
        key = (side, seq, layers, offload, steps)
        if key in self.done:
            return self.done[key]
        spec = {"side": side, "job": self.job(side, seq, layers, offload)}
        ranks = args.ring * args.ulysses if side == "lctrain" else 1
        what = f"{side}, {ranks} rank(s), S={seq}" + (f", {layers} layers" if layers else "")
        what += ", activation offload" if offload else ""
        progress(f"probe: {what} ...")
        started, warmup = time.perf_counter(), [(min(args.warmup_seq, seq), 1)]
        with malloc_env(for_memory=args.device == "cpu"):
            run = run_steps({"p": spec}, ranks, warmup, [(seq, 0)] * steps, budget=self.budget,
                            timeout_s=args.probe_timeout)["p"]  # fmt: skip
        failed = next((r for r in [run["ready"], *run["steps"]] if not r["ok"]), None)
        result = failed or {**run["ready"], "step_s": [r["step_s"] for r in run["steps"]]}
        result |= {} if failed else {key: max(r[key] for r in run["steps"]) for key in ("peak", "step_peak")}
        result["wall_s"] = time.perf_counter() - started
        probe = Probe(seq, fits(result, self.budget), result)
        if result["ok"] and not probe.fits:
            result["error"] = f"over --budget-mib={args.budget_mib}"
        verdict = "fits" if probe.fits else f"does not fit ({probe.reason})"
        if "step_peak" in result:
            verdict += f"; step peak {result['step_peak'] / MIB:,.0f} MiB"
        progress(f"    {verdict} ({result['wall_s']:.0f} s)")
        self.log.append({"probe": what, "spec": spec, "fits": probe.fits, "result": result})
        self.done[key] = probe
        return probe


def step_figures(args: argparse.Namespace, probe: Probe) -> list[str]:
    """Step time, MFU and peak memory of a fitting probe."""
    result = probe.result
    step, model = result["step_s"][-1], result["model"]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else result["peak_flops"]
    per_token = flops_per_token(model["params"], model["layers"], model["hidden"], probe.seq)
    return [f"{step:.2f}", percent(mfu(probe.seq / step, per_token, peak)), f"{result['peak'] / GIB:.2f}"]


def probe_cell(probe: Probe, budget: bool) -> str:
    """``S ✓`` or ``S ✗``, on CPU with the step peak (``>``: the watchdog stopped the step as it passed it)."""
    cell = f"{probe.seq:,} {'✓' if probe.fits else '✗'}"
    if budget and "step_peak" in probe.result:
        cell += f" {'>' if probe.result.get('aborted') else ''}{probe.result['step_peak'] / MIB:,.0f} MiB"
    return cell


def search_section(bench: Bench) -> list[str]:
    args = bench.args
    unit = args.seq_unit
    searches = {side: Search(functools.partial(bench.probe, side), unit, args.max_seq) for side in ("hf", "lctrain")}
    hf = searches["hf"].run(args.start_seq, bisect=args.bisect)
    start = min(args.max_seq, max(unit, int(args.target_ratio * (hf or unit)) // unit * unit))
    lctrain = searches["lctrain"].run(start, bisect=args.bisect, jump=True)  # a fit at --max-seq ends it
    labels = {"lctrain": f"lctrain ({args.ring * args.ulysses} ranks)" if args.ring * args.ulysses > 1 else "lctrain"}
    labels["hf"] = "HF loop (gradient checkpointing)" if args.hf_checkpointing == "full" else "HF loop"
    rows = []
    for side, longest in (("lctrain", lctrain), ("hf", hf)):
        search = searches[side]
        failure = search.shortest_failure()
        label = "none fits" if longest is None else f"{'≥ ' if longest >= args.max_seq else ''}{longest:,}"
        cells = [labels[side], label, "—" if failure is None else f"{failure:,} ({search.probes[failure].reason[:60]})"]
        cells += ["—"] * 3 if longest is None else step_figures(args, search.probes[longest])
        tried = sorted(search.probes.values(), key=lambda p: p.seq)
        rows.append([*cells, "; ".join(probe_cell(p, bench.budget is not None) for p in tried)])
    ratio = f"**{'≥ ' if lctrain and lctrain >= args.max_seq else ''}{lctrain / hf:.1f}×**" if lctrain and hf else "—"
    header = ["side", "longest S", "shortest failure", "step (s)", "MFU", "peak memory (GiB)", "probes"]
    measured = "peak allocated" if bench.budget is None else "resident set"
    measured += "" if bench.budget is None else f"; fits: step peak ≤ {args.budget_mib:,} MiB per process"
    note = (
        f"One training step; lctrain on ring {args.ring} × ulysses {args.ulysses} with activation checkpointing full, "
        f"the HF loop in one process with checkpointing {args.hf_checkpointing}; each probe a fresh process (group): a "
        f"warm-up step at {args.warmup_seq:,} tokens, then one at S; memory = {measured}. lctrain / HF loop: {ratio}."
    )
    return ["## Longest sequence", "", note, "", table(header, rows), ""]


def layers_section(bench: Bench) -> list[str]:
    args, depth = bench.args, bench.depth
    rows, check_rows = [], []
    for seq in args.fit_seqs:
        points = {}
        for layers in args.layer_counts:
            probe = bench.probe("lctrain", seq, layers=layers)
            cell = f"{probe.result['peak'] / GIB:.2f}" if probe.fits else probe.reason[:40]
            rows.append([f"{seq:,}", str(layers), cell])
            if probe.fits:
                points[layers] = probe.result["peak"]
        if len(points) < 2:
            rows.append([f"{seq:,}", f"{depth} (predicted)", "— (fewer than two depths fit)"])
            continue
        fixed, per_layer = fit_line(list(points), list(points.values()))
        predicted = fixed + per_layer * depth
        line = f"**{predicted / GIB:.2f}** = {fixed / GIB:.2f} + {depth} × {per_layer / GIB:.3f}"
        rows.append([f"{seq:,}", f"{depth} (predicted)", line])
        if seq == args.check_seq:
            real = bench.probe("lctrain", seq)  # the search's probe, when it ran this length
            cells = [f"{seq:,}", str(depth), f"{predicted / GIB:.2f}"]
            if not real.fits:
                check_rows.append([*cells, real.reason[:60], "—"])
                continue
            measured = real.result["peak"]
            check_rows.append([*cells, f"{measured / GIB:.2f}", f"{(predicted - measured) / measured:+.1%}"])
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
        rows.append([label, f"{probe.result['step_s'][-1]:.2f}", f"{probe.result['peak'] / GIB:.2f}", ""])
    if results[False].fits and results[True].fits:
        slower = results[True].result["step_s"][-1] / results[False].result["step_s"][-1] - 1
        saved = results[False].result["peak"] - results[True].result["peak"]
        rows[-1][-1] = f"saves {saved / GIB:.2f} GiB, {slower:+.1%} step time"
    where = f"lctrain, {args.offload_layers} layers, S={args.offload_seq:,}, full checkpointing, second step timed"
    header = ["activation offload", "step (s)", "peak memory (GiB)", "effect"]
    return ["## Activation offload", "", where, "", table(header, rows), ""]


def scaling_points(bench: Bench, side: str, ranks: int, seqs: list[int]) -> list[dict[str, Any]]:
    """One step per length of ``seqs`` (shortest first) after a warm-up step, in one process group: each rank's
    step peak, PSS and resident set before the step, and the slowest rank's step time."""
    args, mesh = bench.args, MESHES[ranks]
    progress(f"scaling: {side}, ring {mesh[0]} × ulysses {mesh[1]}: S = {seqs}")
    spec = {"side": side, "job": bench.job(side, max(seqs), None, side == "lctrain", mesh), "threads": 1}
    steps, budget = [(seq, 0) for seq in seqs], int(args.safe_gib * GIB / ranks)
    with malloc_env(for_memory=True):
        result = run_steps({side: spec}, ranks, [(64 * ranks, 1)], steps, budget=budget)
    done = sum(step["ok"] for step in result[side]["steps"])
    if done < len(seqs):
        progress(f"    stopped at S={seqs[done]:,}: past its share of --safe-gib")
    per_rank, slowest = result[side]["per_rank"], result[side]["steps"]
    keys = {"peaks": "step_peak", "pss_before": "pss_before", "rss_before": "before"}
    return [
        {"side": side, "ranks": ranks, "seq": seq, "step_s": slowest[i]["step_s"]}
        | {name: [rank[i][key] for rank in per_rank] for name, key in keys.items()}
        for i, seq in enumerate(seqs[:done])
    ]


def per_rank_tokens(point: dict[str, Any]) -> int:
    return point["seq"] // point["ranks"]


def line(points: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """Step peak per rank = a + b·(S/P), least squares, and the largest residual; None without two S/P."""
    xs, ys = [per_rank_tokens(p) for p in points], [max(p["peaks"]) for p in points]
    if len(set(xs)) < 2:
        return None
    a, b = fit_line(xs, ys)
    return a, b, max(abs(y - a - b * x) for x, y in zip(xs, ys, strict=True))


def mesh_label(side: str, ranks: int) -> str:
    return "HF baseline, 1 process" if side == "hf" else "lctrain, ring {} × ulysses {}".format(*MESHES[ranks])


def scaling_section(bench: Bench) -> list[str]:
    args = bench.args
    from lctrain.train.meter import proc_bytes

    free = proc_bytes("MemAvailable", "/proc/meminfo") - 2 * GIB  # what is free now
    args.safe_gib = min(args.safe_gib, free / GIB)
    for ranks in sorted(args.scaling_ranks):
        seqs = [ranks * n for n in args.per_rank if ranks * n <= args.max_scaling_seq]
        bench.points += scaling_points(bench, "lctrain", ranks, seqs)
    if args.baseline_seqs:
        bench.points += scaling_points(bench, "hf", 1, args.baseline_seqs)
    points = sorted(bench.points, key=lambda p: (p["side"] != "lctrain", p["ranks"], p["seq"]))
    fitted = [p for p in points if p["side"] == "hf" or per_rank_tokens(p) >= args.fit_min_per_rank]
    rows, fits = [], []
    for p in points:
        cells = [mesh_label(p["side"], p["ranks"]), str(p["ranks"]), f"{p['seq']:,}", f"{per_rank_tokens(p):,}"]
        total = (sum(p["pss_before"]) + sum(p["peaks"])) / GIB  # every rank at its peak: an upper bound
        cells += [f"**{max(p['peaks']) / MIB:,.0f}**", f"{min(p['peaks']) / MIB:,.0f} … {max(p['peaks']) / MIB:,.0f}"]
        cells += [f"{max(p['rss_before']) / MIB:,.0f}", f"{total:,.2f}", f"{p['step_s']:.1f}"]
        rows.append([*cells, "fitted" if p in fitted else "floor"])
    groups = {(p["side"], p["ranks"]): [q for q in fitted if (q["side"], q["ranks"]) == (p["side"], p["ranks"])]
              for p in points}  # fmt: skip
    pooled = [p for p in fitted if p["side"] == "lctrain" and p["ranks"] >= 2]  # every P ≥ 2: one line
    if len({p["ranks"] for p in pooled}) > 1:
        groups[("pooled", 0)] = pooled
    for (side, ranks), own in groups.items():
        found = line(own)
        if found is None:
            continue
        a, b, residual = found
        cells = [mesh_label(side, ranks), str(ranks)] if ranks else ["**lctrain, every P ≥ 2 together**"]
        cells += [] if ranks else [", ".join(str(n) for n in sorted({p["ranks"] for p in own}))]
        cells += [", ".join(f"{n:,}" for n in sorted({per_rank_tokens(p) for p in own})), f"{b / 1024:.2f}"]
        cells += [f"{b / ranks / 1024:.2f}" if ranks else "—", f"{a / MIB:,.0f}", f"{residual / MIB:.1f}"]
        fits.append(cells)
    if args.plot:
        plot(points, pooled, Path(args.plot), args.fit_min_per_rank)
    header = ["side", "P", "S", "S/P", "step peak/rank (MiB, max)", "min … max over ranks", "RSS before (MiB)"]
    header += ["total, all ranks (GiB)", "step (s)", "use"]
    fit_header = ["fit: step peak per rank = a + b·(S/P)", "P", "fitted S/P", "b: KiB per token of the rank"]
    fit_header += ["b/P: KiB per token of the sequence", "a (MiB)", "max residual (MiB)"]
    note = (
        f"One step per length after a warm-up step, one thread per rank; lctrain with activation checkpointing full, "
        f"activation offload (a no-op on CPU), MLP chunks of {args.mlp_chunk_tokens} tokens and the chunked loss; "
        f"the HF loop without checkpointing, full logits. Step peak = VmHWM − VmRSS before the step; total = Σ PSS "
        f"before + Σ step peaks."
    )
    lines = ["## Memory per rank vs sequence length", "", note, "", table(header, rows), "", table(fit_header, fits)]
    return [*lines, "", f"plot: {args.plot}" if args.plot else ""]


def plot(points: list[dict[str, Any]], pooled: list[dict[str, Any]], path: Path, min_per_rank: int) -> None:
    """Left: lctrain's step peak per rank against S/P for every P and the line fitted to P ≥ 2; right: the same and
    the HF loop against S (log axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for side, ranks in dict.fromkeys((p["side"], p["ranks"]) for p in points):
        own = [p for p in points if (p["side"], p["ranks"]) == (side, ranks)]
        style = {"linestyle": "--" if side == "hf" else "-", "marker": "o", "label": mesh_label(side, ranks)}
        peaks = [max(p["peaks"]) / MIB for p in own]
        if side == "lctrain":
            left.plot([per_rank_tokens(p) for p in own], peaks, **style)
        right.plot([p["seq"] for p in own], peaks, **style)
    found = line(pooled)
    if found is not None:
        x = [min_per_rank / 2, max(per_rank_tokens(p) for p in pooled)]
        left.plot(x, [(found[0] + found[1] * t) / MIB for t in x], ":", color="black", label="fit to every P ≥ 2")
    left.set(xlabel="tokens per rank S/P", title="lctrain, all savers: step peak per rank vs S/P")
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set(xlabel="sequence length S", title="step peak per rank vs S (and the plain HF baseline)")
    for ax in (left, right):
        ax.set_ylabel("step peak per rank (MiB, max over ranks)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    bench = Bench(args)
    print(title("Longest context: lctrain vs a plain Hugging Face loop"))
    job = " ".join(bench.job("lctrain", args.max_seq, None, False))
    print(f"- job (Hydra overrides of lctrain's probes): `{job}`\n", flush=True)
    sections = dict(search=search_section, layers=layers_section, offload=offload_section, scaling=scaling_section)
    for name in args.sections:
        print("\n".join(sections[name](bench)), flush=True)
        save_json(args.json, probes=bench.log, scaling=bench.points)
    device = next((p["result"]["device_name"] for p in bench.log if p["result"].get("device_name")), args.device)
    print(f"device: {device}; {len(bench.log)} probes, total wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
