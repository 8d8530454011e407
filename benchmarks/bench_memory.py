"""Memory per rank against sequence length with every memory saver on, against the plain Hugging Face baseline.
(The longest context each side trains in one step: ``bench_context.py``.) The method: ``docs/benchmarks.md``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import memory
from benchmarks.jobs import REPO, bench_job
from benchmarks.report import command, fit_line, machine_line, table
from benchmarks.runs import run_steps

MIB, GIB = 2**20, 2**30
SIDES = ("lctrain", "baseline")
MESHES = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (4, 2)}  # ranks -> (ring, ulysses)
MODEL = ("model.hidden_size=256", "model.intermediate_size=1024", "model.num_layers=4", "model.num_heads=4")
MODEL += ("model.num_kv_heads=2",)
PLOT = REPO / "docs" / "memory_per_rank.png"


def log(message: str) -> None:
    """Progress on stderr; stdout is the markdown report."""
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Point:
    """One measured step: per-rank step peaks and the memory before it."""

    side: str
    ranks: int
    seq: int
    growth: list[int]  # bytes, per rank
    pss_before: list[int]  # bytes, per rank
    rss_before: list[int]  # bytes, per rank
    seconds: float  # slowest rank
    fitted: bool = True  # False: a check run, not used by the fits (in measurements saved by earlier versions)

    @property
    def per_rank_tokens(self) -> int:
        return self.seq // self.ranks

    @property
    def peak(self) -> int:
        return max(self.growth)

    @property
    def total(self) -> int:
        """Bytes of all ranks together at the step's peak (PSS before + step peak, summed over ranks)."""
        return sum(self.pss_before) + sum(self.growth)


def job_for(side: str, ranks: int, args: argparse.Namespace) -> list[str]:
    base = ("parallel.dp=1", *MODEL, *args.override)
    if side == "baseline":
        return bench_job("cpu", "parallel.ring=1", "parallel.ulysses=1", *base)
    ring, ulysses = MESHES[ranks]
    savers = ("parallel.activation_checkpointing=full", "parallel.activation_offload=true")
    chunks = (f"parallel.mlp_chunk_tokens={args.mlp_chunk_tokens}", f"train.loss_chunk_tokens={args.loss_chunk_tokens}")
    return bench_job("cpu", f"parallel.ring={ring}", f"parallel.ulysses={ulysses}", *base, *savers, *chunks)


def run_points(side: str, ranks: int, seqs: Sequence[int], args: argparse.Namespace) -> list[Point]:
    """One step per length of ``seqs`` (shortest first) after a warm-up step, in one process group."""
    ring, ulysses = MESHES[ranks] if side == "lctrain" else (1, 1)
    log(f"  {side}, {ranks} rank(s) (ring {ring} × ulysses {ulysses}): S = {', '.join(f'{s:,}' for s in seqs)}")
    spec = {"side": "hf" if side == "baseline" else "lctrain", "job": job_for(side, ranks, args), "threads": 1}
    guard = int(args.safe_gib * GIB / ranks)
    started = time.perf_counter()
    with memory.malloc_env(for_memory=True):
        warmup = [(2 * ring * ulysses * 32, 1)]
        result = run_steps({side: spec}, ranks, warmup, [(seq, 0) for seq in seqs], budget=guard)[side]
    done = sum(step["ok"] for step in result["steps"])
    if done < len(seqs):
        log(
            f"  stopped at S={seqs[done]:,}: a rank's step passed its {guard / MIB:,.0f} MiB share of --safe-gib "
            f"({result['steps'][done]['step_peak'] / MIB:,.0f} MiB); the {done} shorter lengths are kept"
        )
    log(f"  ({time.perf_counter() - started:.0f} s)")
    steps = result["per_rank"]
    return [
        Point(
            side,
            ranks,
            seq,
            [r[i]["step_peak"] for r in steps],
            [r[i]["pss_before"] for r in steps],
            [r[i]["before"] for r in steps],
            result["steps"][i]["step_s"],
        )
        for i, seq in enumerate(seqs[:done])
    ]


def fittable(points: Sequence[Point]) -> bool:
    return len({p.per_rank_tokens for p in points}) >= 2


@dataclass(frozen=True)
class Fit:
    """Step peak per rank = intercept + slope × (tokens per rank), least squares over the fitted points."""

    slope: float  # bytes per token of this rank
    intercept: float  # bytes
    max_residual: float  # bytes

    @staticmethod
    def of(points: Sequence[Point]) -> Fit:
        xs, ys = [p.per_rank_tokens for p in points], [p.peak for p in points]
        intercept, slope = fit_line(xs, ys)
        return Fit(slope, intercept, max(abs(y - (intercept + slope * x)) for x, y in zip(xs, ys)))

    def peak(self, per_rank_tokens: float) -> float:
        return self.intercept + self.slope * per_rank_tokens


def fitted(points: Sequence[Point], side: str, min_per_rank: int, ranks: int | None = None) -> list[Point]:
    """The points a fit uses: not check runs, of every P or only ``ranks``; for lctrain at least ``min_per_rank``
    tokens per rank (below, its step peak sits on a floor that does not depend on S; the baseline has none)."""
    least = min_per_rank if side == "lctrain" else 0
    return [
        p for p in points if p.side == side and p.fitted and p.per_rank_tokens >= least and ranks in (None, p.ranks)
    ]


def pooled_points(points: Sequence[Point], min_per_rank: int) -> list[Point]:
    """The points of lctrain's one line: those of every P ≥ 2 together (their ring and Ulysses buffers grow with
    S/P too; one rank has none and sits lower)."""
    return [p for p in fitted(points, "lctrain", min_per_rank) if p.ranks >= 2]


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def gib(value: float) -> str:
    return f"{value / GIB:,.2f}"


def mesh_label(side: str, ranks: int) -> str:
    if side == "baseline":
        return "HF baseline, 1 process"
    ring, ulysses = MESHES[ranks]
    return f"lctrain, ring {ring} × ulysses {ulysses}"


def groups(points: Sequence[Point]) -> list[tuple[str, int]]:
    return sorted({(p.side, p.ranks) for p in points}, key=lambda g: (g[0] != "lctrain", g[1]))


def scaling_report(points: list[Point], min_per_rank: int) -> str:
    used = {id(p) for side in SIDES for p in fitted(points, side, min_per_rank)}
    rows = []
    for p in sorted(points, key=lambda p: (p.side != "lctrain", p.ranks, p.seq)):
        role = "fitted" if id(p) in used else ("check" if not p.fitted else "floor")
        cells = [
            mesh_label(p.side, p.ranks),
            str(p.ranks),
            f"{p.seq:,}",
            f"{p.per_rank_tokens:,}",
            f"**{mib(p.peak)}**",
        ]
        cells += [f"{mib(min(p.growth))} … {mib(p.peak)}", mib(max(p.rss_before)), gib(p.total), f"{p.seconds:.1f}"]
        rows.append([*cells, role])
    header = ["side", "P", "S", "S/P", "step peak/rank (MiB, max)", "min … max over ranks", "RSS before (MiB)"]
    out = [table([*header, "total, all ranks (GiB)", "step (s)", "use"], rows), ""]
    fit_rows = []

    def fit_row(label: str, ranks: str, own: list[Point], per_global: str) -> None:
        fit = Fit.of(own)
        lengths = ", ".join(f"{n:,}" for n in sorted({p.per_rank_tokens for p in own}))
        cells = [label, ranks, lengths, f"{fit.slope / 1024:.2f}", per_global, mib(fit.intercept)]
        fit_rows.append([*cells, f"{fit.max_residual / MIB:.1f}"])

    for side, ranks in groups(points):
        own = fitted(points, side, min_per_rank, ranks)
        if fittable(own):
            fit_row(mesh_label(side, ranks), str(ranks), own, f"{Fit.of(own).slope / ranks / 1024:.2f}")
    pooled = pooled_points(points, min_per_rank)
    if len({p.ranks for p in pooled}) > 1 and fittable(pooled):
        ranks = ", ".join(str(n) for n in sorted({p.ranks for p in pooled}))
        fit_row("**lctrain, every P ≥ 2 together**", ranks, pooled, "—")
    header = ["fit: step peak per rank = a + b·(S/P)", "P", "fitted S/P", "b: KiB per token of the rank"]
    header += ["b/P: KiB per token of the sequence", "a (MiB)", "max residual (MiB)"]
    out.append(table(header, fit_rows))
    return "\n".join(out)


def plot(points: list[Point], path: Path, min_per_rank: int) -> None:
    """Left: lctrain's step peak per rank against S/P for every P, and the line fitted to P ≥ 2 (linear axes).
    Right: the same points and the baseline against S (log axes): at fixed S, each doubling of P halves the rank's
    S-dependent memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for side, ranks in groups(points):
        own = sorted((p for p in points if p.side == side and p.ranks == ranks), key=lambda p: p.seq)
        style = {"linestyle": "--" if side == "baseline" else "-", "marker": "o", "label": f"{mesh_label(side, ranks)}"}
        if side == "lctrain":
            left.plot([p.per_rank_tokens for p in own], [p.peak / MIB for p in own], **style)
        right.plot([p.seq for p in own], [p.peak / MIB for p in own], **style)
    pooled = pooled_points(points, min_per_rank)
    if fittable(pooled):
        fit = Fit.of(pooled)
        x = [min_per_rank / 2, max(p.per_rank_tokens for p in points if p.side == "lctrain")]
        left.plot(x, [fit.peak(t) / MIB for t in x], ":", color="black", label="one line fitted to every P ≥ 2")
    left.set_xlabel("tokens per rank S/P")
    left.set_title("lctrain, all savers: step peak per rank vs S/P")
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xlabel("sequence length S")
    right.set_title("step peak per rank vs S (and the plain HF baseline)")
    for ax in (left, right):
        ax.set_ylabel("step peak per rank (MiB, max over ranks)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="job override (both sides)"
    )
    parser.add_argument("--ranks", type=ints, default=[1, 2, 4, 8], help="lctrain's process counts P")
    parser.add_argument(
        "--per-rank", type=ints, default=[512, 1024, 2048, 4096, 8192], help="S/P values (tokens per rank)"
    )
    parser.add_argument("--max-fitted-seq", type=int, default=16384, help="skip longer S·P (step time grows as S²)")
    parser.add_argument(
        "--fit-min-per-rank", type=int, default=2048, help="fit only S/P ≥ this (below: a floor independent of S)"
    )
    parser.add_argument("--baseline-seqs", type=ints, default=[1024, 2048, 4096, 8192], help="baseline lengths")
    parser.add_argument("--mlp-chunk-tokens", type=int, default=256, help="parallel.mlp_chunk_tokens of lctrain")
    parser.add_argument("--loss-chunk-tokens", type=int, default=256, help="train.loss_chunk_tokens of lctrain")
    parser.add_argument("--safe-gib", type=float, default=16.0, help="stop any run whose ranks pass this together")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    parser.add_argument(
        "--from-json", type=Path, action="append", default=[], help="report these measurements (repeatable: merged)"
    )
    parser.add_argument("--plot", type=Path, default=PLOT, help="the PNG of memory per rank vs S/P")
    args = parser.parse_args()
    if set(args.ranks) - set(MESHES):
        parser.error(f"ranks from {sorted(MESHES)}")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    if args.from_json:
        saved = [json.loads(path.read_text()) for path in args.from_json]
        points = [Point(**p) for run in saved for p in run["points"]]
        machine = " / ".join(dict.fromkeys(run["machine"] for run in saved))
        run_command = "`, then `".join(run["command"] for run in saved)
        wall = sum(run["wall_s"] for run in saved)
    else:
        machine, run_command = machine_line(), command()
        points: list[Point] = []
        # a watchdog ends any run whose ranks pass --safe-gib together (each rank: its share), or what is free now
        args.safe_gib = min(args.safe_gib, (memory.available() - 2 * GIB) / GIB)
        log(f"one step per length, all savers on; at most {args.safe_gib:.1f} GiB for all ranks")
        for n in sorted(args.ranks):
            points += run_points("lctrain", n, [n * s for s in args.per_rank if n * s <= args.max_fitted_seq], args)
        if args.baseline_seqs:
            points += run_points("baseline", 1, args.baseline_seqs, args)
        wall = time.perf_counter() - started
        if args.json:
            saved = {"machine": machine, "command": run_command, "wall_s": wall, "points": [asdict(p) for p in points]}
            args.json.write_text(json.dumps(saved))
    print("# Memory per rank vs sequence length\n")
    print(f"- command: `{run_command}`")
    print(f"- machine: {machine}")
    print(f"- model: Llama {' '.join(MODEL + tuple(args.override))}, vocab 8192, fp32; one step after a warm-up step")
    print(
        f"- lctrain: activation checkpointing full + offload (no-op on CPU) + MLP chunks of {args.mlp_chunk_tokens} "
        f"+ loss chunks of {args.loss_chunk_tokens} tokens; baseline: plain transformers, sdpa, full logits"
    )
    print(f"- total wall time {wall:.0f} s\n")
    print(scaling_report(points, args.fit_min_per_rank))
    if args.plot:
        plot(points, args.plot, args.fit_min_per_rank)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
