"""Does the ring hide its transfers? lctrain's ring attention on rate-limited links between network hosts."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks import rings
from benchmarks.jobs import REPO
from benchmarks.report import arguments, listed, table, title
from benchmarks.timing import clock, gathered_slowest, median, rounds

SHAPES = {"mha": (2, 2), "gqa": (4, 1)}  # (query heads, key/value heads), head_dim 64
HEAD_DIM = 64
LINK = "LCTRAIN_BENCH_LINK"  # the worker's own link, which it limits (namespace hosts only)
WAITS = ("forward_kv", "backward_kv", "backward_dkv")  # what a pass waits for (ring_waits)


def no_compute(passes: rings.Passes) -> rings.Passes:
    """lctrain's ring ``passes`` with a kernel that computes nothing (zeros): only its transfers."""
    import torch

    from lctrain.attention.kernels import AttentionKernel

    def zeros_forward(q, k, v, **_):  # noqa: ANN001, ANN202
        return torch.zeros(q.shape), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def zeros_backward(dout, q, k, v, out, lse, **_):  # noqa: ANN001, ANN202
        return torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)

    kernel = AttentionKernel("no_compute", zeros_forward, zeros_backward)

    def forward() -> Any:
        with mock.patch("lctrain.attention.ring.resolve_kernel", lambda *args, **kwargs: kernel):
            return passes.forward()

    return rings.Passes(forward, passes.backward)


def time_sides(sides: dict[str, tuple[str | None, Any]], warmup: int, iters: int) -> dict[str, dict[str, float]]:
    """Each side (its link rate, its passes) in rounds: per side the median forward, backward and total seconds."""

    def timed_pass(rate: str | None, passes: Any, _round: int) -> dict[str, float]:
        set_limit(rate)  # and every rank starts together
        with clock() as forward:
            passes.forward()
        with clock() as backward:
            passes.backward()
        return {"forward": forward["wall"], "backward": backward["wall"], "total": forward["wall"] + backward["wall"]}

    steps = {name: functools.partial(timed_pass, *side) for name, side in sides.items()}
    measured = gathered_slowest(rounds(steps, warmup, iters, alternate=False, timed=False))
    return {side: {n: median(r, n) for n in ("forward", "backward", "total")} for side, r in measured.items()}


def ring_waits(passes: Any, directory: Path) -> dict[str, float]:
    """One forward + backward with the ring's timeline on: the seconds waited for each kind of transfer, per pass
    (the busiest rank's), and the pass's compute seconds."""
    import torch.distributed as dist

    from lctrain.attention import timeline

    with mock.patch.dict(os.environ, {timeline.ENVIRONMENT: str(directory)}):
        dist.barrier()
        passes.forward()
        passes.backward()
    forward, backward = (timeline.exposed(r) for r in timeline.read_timelines(directory, dist.get_rank())[-2:])
    waits = {"forward_kv": forward["kv"], "backward_kv": backward["kv"], "backward_dkv": backward["dkv"]}
    waits |= {"forward_compute": forward["compute"], "backward_compute": backward["compute"]}
    return gathered_slowest({"waits": [waits]})["waits"][0]


def set_limit(rate: str | None) -> None:
    """Every rank limits what its host sends (namespace hosts only), then all wait for each other."""
    import torch.distributed as dist

    from testbed.hosts import limit_link

    if os.environ.get(LINK):
        limit_link(os.environ[LINK], rate)
    dist.barrier()


def points(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """On each rank of the default group: every point of ``spec``; rank 0 writes the probe's hardware files."""
    import torch
    import torch.distributed as dist

    from lctrain.planner.probe import ProbeOptions, measure, write_hardware

    group, out, results = dist.group.WORLD, Path(spec["out"]), []
    for shape in spec["shapes"]:
        heads, kv_heads = SHAPES[shape]
        shapes = (heads, kv_heads, HEAD_DIM, torch.bfloat16)
        full = {t: rings.random_inputs(t * dist.get_world_size(), *shapes, seed=t) for t in spec["tokens"]}
        inputs = {t: rings.rank_shards(tensors) for t, tensors in full.items()}
        for rate in spec["rates"]:
            set_limit(rate)
            record = measure(ProbeOptions(heads, kv_heads, HEAD_DIM, iters=spec["iters"]), torch.device("cpu"))
            hardware = out / f"hardware-{shape}-{rate}.json"
            if dist.get_rank() == 0:
                write_hardware(record, hardware)
            for tokens, tensors in inputs.items():
                ours, theirs = rings.lctrain_ring(*tensors, group), rings.torch_ring(*tensors, group)
                sides = {"compute": (None, ours), "torch_free": (None, theirs), "comm": (rate, no_compute(ours))}
                sides |= {"ring": (rate, ours), "torch": (rate, theirs)}
                point = {"shape": shape, "rate": rate, "tokens": tokens, "hardware": str(hardware)}
                point |= time_sides(sides, spec["warmup"], spec["iters"])
                set_limit(None)
                point["waits_free"] = ring_waits(ours, out / f"timeline-{shape}-none-{tokens}")
                set_limit(rate)
                point["waits"] = ring_waits(ours, out / f"timeline-{shape}-{rate}-{tokens}")
                results.append(point)
        set_limit(None)
    return results


def worker(spec_path: str) -> None:
    """One rank on a namespace host (torchrun's environment): ``points``; rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    spec = json.loads(Path(spec_path).read_text())
    results = points(spec)
    if dist.get_rank() == 0:
        (Path(spec["out"]) / "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(ranks: int, spec: dict[str, Any], work: Path, *, namespaces: bool, timeout_s: float) -> list[dict]:
    """``points`` on ``ranks`` ranks, one per namespace host, rendezvous on rank 0's address (without namespace
    hosts: a spawned gloo group on loopback); their results."""
    from lctrain.testing import run_distributed
    from testbed.hosts import NetworkHosts

    if not namespaces:
        return run_distributed(points, ranks, spec)[0]
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    program = [sys.executable, "-m", "benchmarks.bench_ring_overlap", "--worker", str(spec_path)]
    names = [str(r) for r in range(ranks)]
    with NetworkHosts(work / "hosts", names) as hosts:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(ranks), "MASTER_PORT": "29571"}
        env["MASTER_ADDR"] = hosts.addresses["0"]
        procs = []
        for name in names:
            link = {"RANK": name, "GLOO_SOCKET_IFNAME": hosts.links[name], LINK: hosts.links[name]}
            procs.append(hosts.popen(name, program, work / f"rank{name}.log", {**env, **link}, REPO))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:  # None: still running at the deadline
                logs = "\n".join((work / f"rank{r}.log").read_text()[-3000:] for r in range(ranks))
                raise RuntimeError(f"a rank of P={ranks} ended with {proc.returncode}:\n{logs}")
    return json.loads((Path(spec["out"]) / "results.json").read_text())


def knees(points: list[dict], ranks: int, kv_heads: int) -> dict[str, float]:
    """Per pass, the T at which a step's transfer (b·T) equals the compute it hides behind (``overlap`` steps of
    a·T²): b / (overlap · a) (module doc)."""
    from lctrain.attention.ring_transfers import PIECES

    overlap = 2 - 1 / PIECES if ranks == 2 else 1  # a ring of two: its one transfer per pass travels in pieces
    result = {}
    for name in ("forward", "backward"):
        ts = [p["tokens"] for p in points]
        compute = [p["compute"][name] / ranks for p in points]
        row = kv_heads * HEAD_DIM * 2 * 2  # K and V in bf16, dK/dV in fp32, as ring.py schedules them
        share = [rings.busiest_steps(ranks, p["tokens"], row, 2 * row)[name] for p in points]
        transfer = [p["comm"][name] * busiest / total for p, (busiest, total) in zip(points, share)]
        a = sum(c * t**2 for c, t in zip(compute, ts)) / sum(t**4 for t in ts)  # least squares through 0
        b = sum(m * t for m, t in zip(transfer, ts)) / sum(t**2 for t in ts)
        result[name] = b / (overlap * a)
    return result


def predicted_threshold(hardware: str, ranks: int, heads: int, kv_heads: int, tokens: int) -> tuple[float, str]:
    """The planner's threshold_tokens for a ring of ``ranks`` from the probe's hardware file, and the link."""
    from lctrain.planner import Layout, ModelSpec, Workload, ring_step
    from lctrain.planner.presets import load_hardware

    hw = load_hardware(hardware)
    record = json.loads(Path(hardware).read_text())["probe"]
    model = ModelSpec("bench", heads * HEAD_DIM, 1, 1, heads, kv_heads, 1, HEAD_DIM)
    work = Workload(ranks * tokens, gpus_per_node=record["ranks_per_node"], nodes=record["nodes"], dtype_bytes=2)
    step = ring_step(model, Layout(1, 1, ranks, 1), hw, work)
    return step.threshold_tokens, step.link


def waited(point: dict) -> float:
    """Seconds the ring waited for its transfers on the limited link beyond those on the link without a limit."""
    return max(0.0, sum(point["waits"][k] for k in WAITS) - sum(point["waits_free"][k] for k in WAITS))


def report(results: dict[int, list[dict]], namespaces: bool) -> list[dict]:
    """Print the tables; returns one summary per (P, shape, rate) for the figure."""
    rows, knee_rows, baseline, summaries = [], [], [], []
    for ranks, points in results.items():
        for point in points:
            heads, kv_heads = SHAPES[point["shape"]]
            compute, comm, ring = (point[side]["total"] for side in ("compute", "comm", "ring"))
            threshold, link = predicted_threshold(point["hardware"], ranks, heads, kv_heads, point["tokens"])
            waits, free = point["waits"], sum(point["waits_free"][kind] for kind in WAITS)
            cells = [str(ranks), point["shape"], point["rate"] or "none", f"{point['tokens']:,}", f"{compute:.3f}"]
            cells += [f"{comm:.3f}", f"{compute / comm:.2f}", f"{ring:.3f}", f"**{(ring - compute) / comm:.2f}**"]
            cells += [f"{waited(point) / comm:.2f}", f"{ring / max(compute, comm):.2f}"]
            cells.append(" / ".join(f"{1e3 * waits[kind]:.0f}" for kind in WAITS) + f" ({1e3 * free:.0f})")
            busy = [w["forward_compute"] + w["backward_compute"] for w in (point["waits"], point["waits_free"])]
            cells.append(f"{busy[0] / busy[1]:.2f}")  # the blocks' compute seconds, limited / no limit
            rows.append([*cells, f"{threshold:,.0f} ({link})", f"{point['torch']['total']:.3f}"])
        for shape, rate in dict.fromkeys((point["shape"], point["rate"]) for point in points):
            group = [point for point in points if (point["shape"], point["rate"]) == (shape, rate)]
            threshold, _ = predicted_threshold(group[0]["hardware"], ranks, *SHAPES[shape], group[0]["tokens"])
            knee = knees(group, ranks, SHAPES[shape][1])
            summaries.append({"ranks": ranks, "shape": shape, "rate": rate, "threshold": threshold, "points": group})
            cells = [str(ranks), shape, rate or "none", f"{threshold:,.0f}"]
            cells += [f"{knee['forward']:,.0f} / {knee['backward']:,.0f}", f"{max(knee.values()):,.0f}"]
            knee_rows.append([*cells, f"**{threshold / max(knee.values()):.2f}**"])
        for shape, tokens in dict.fromkeys((point["shape"], point["tokens"]) for point in points):
            point = next(p for p in points if (p["shape"], p["tokens"]) == (shape, tokens))
            ours, theirs = point["compute"], point["torch_free"]
            passes = [" / ".join(f"{side[n]:.3f}" for n in ("forward", "backward", "total")) for side in (ours, theirs)]
            ratio = f"**{ours['total'] / theirs['total']:.2f}**"
            baseline.append([str(ranks), shape, f"{tokens * ranks:,}", *passes, ratio])
    header = ["P", "shape", "link", "T = S/P", "compute only s", "comm only s", "compute / comm", "ring s"]
    header += ["exposed", "waited / comm", "ring / max", "waits fwd K/V / bwd K/V / bwd dK/dV ms (no limit: all)"]
    header += ["blocks limited / no limit", "planner S/R min", "PyTorch s"]
    print("\n## Overlap on the limited link\n")
    print(table(header, rows))
    print("\n## Predicted threshold and measured knee (tokens per rank)\n")
    header = ["P", "shape", "link", "planner threshold", "knee fwd / bwd", "measured knee", "threshold / knee"]
    print(table(header, knee_rows))
    print("\n## lctrain's ring and PyTorch's on the links without a limit (forward / backward / total s)\n")
    print(table(["P", "shape", "S", "lctrain", "PyTorch", "lctrain / PyTorch"], baseline))
    if not namespaces:
        print("\nNo namespace hosts (not root): every rank on loopback, no limit; the exposure figures mean little.")
    return summaries


def draw(summaries: list[dict], path: Path) -> None:
    """Exposed seconds against tokens per rank, a panel per (P, shape): what the ring waited for its transfers
    (``waited``) and ring − compute only, per rate, with the planner's threshold of each rate as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["ranks"], s["shape"]) for s in summaries})
    figure, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8), squeeze=False)
    colors = {}
    for axis, (ranks, shape) in zip(axes[0], panels):
        for s in (s for s in summaries if (s["ranks"], s["shape"]) == (ranks, shape)):
            color = colors.setdefault(s["rate"], f"C{len(colors)}")
            rate = s["rate"] or "no limit"
            ts = [p["tokens"] for p in s["points"]]
            axis.plot(ts, [waited(p) for p in s["points"]], "o-", color=color, label=f"{rate}: waited")
            wall = [p["ring"]["total"] - p["compute"]["total"] for p in s["points"]]
            axis.plot(ts, wall, "x:", color=color, label=f"{rate}: ring − compute only")
            axis.axvline(s["threshold"], color=color, linestyle="--", label=f"{rate}: planner threshold")
        axis.axhline(0, color="grey", linewidth=0.5)
        axis.set_xscale("log", base=2)
        axis.set_title(f"P = {ranks}, {shape} (Hq/Hkv = {SHAPES[shape][0]}/{SHAPES[shape][1]}, D = {HEAD_DIM})")
        axis.set_xlabel("tokens per rank")
        axis.set_ylabel("exposed communication (s)")
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    flags = {"max_tokens_p4": (4096, "largest tokens per rank at P >= 4"), "timeout": (1800.0, "seconds per P")}
    flags["png"] = ("docs/ring_overlap.png", "the figure (default docs/ring_overlap.png)")
    parser = arguments(__doc__, warmup=1, iters=2, **flags)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank: the spec file the parent wrote
    ints = listed(int)
    parser.add_argument("--ranks", type=ints, default=[2, 4], help="values of P, one rank per host (default 2,4)")
    parser.add_argument("--shapes", type=listed(str, SHAPES), default=list(SHAPES), help="head shapes")
    parser.add_argument("--rates", type=listed(), default="300mbit,100mbit", help="link rates, tc's units")
    parser.add_argument("--tokens", type=ints, default=[512, 1024, 2048, 4096, 8192], help="tokens per rank")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from testbed.hosts import unavailable

    started = time.perf_counter()
    reason = unavailable()
    namespaces = reason is None
    rates = args.rates if namespaces else [None]
    print(title("Ring overlap benchmark"))
    if not namespaces:
        print(f"- no namespace hosts: {reason}; the ranks run on loopback without a limit")
    print(f"- problem: zigzag, causal, bf16, D={HEAD_DIM}, forward + backward, one rank per host, one thread per rank; "
          f"{args.warmup} warm-up + median of {args.iters}, time = slowest rank", flush=True)  # fmt: skip
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_ring_overlap_") as scratch:
        for ranks in args.ranks:
            tokens = [t for t in args.tokens if ranks < 4 or t <= args.max_tokens_p4]
            (work := Path(scratch) / f"p{ranks}").mkdir()
            spec = {"shapes": args.shapes, "rates": rates, "tokens": tokens, "out": str(work), "warmup": args.warmup}
            spec["iters"] = args.iters
            results[ranks] = run_ranks(ranks, spec, work, namespaces=namespaces, timeout_s=args.timeout)
            print(f"- P={ranks}: {time.perf_counter() - started:.0f} s so far", flush=True)
        summaries = report(results, namespaces)
    if args.png:
        draw(summaries, Path(args.png))
        print(f"\nFigure: `{args.png}`.")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nTotal wall time {time.perf_counter() - started:.0f} s; load average at the end {load}.")


if __name__ == "__main__":
    main()
