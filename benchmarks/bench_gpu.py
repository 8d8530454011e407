"""lctrain's training step against a plain Hugging Face loop on one GPU, in one run: tokens/s, MFU, peak memory and
their ratio; FSDP2's cost at world size 1; the fragmentation that expandable segments save; each side's top kernels.

    python benchmarks/bench_gpu.py               # defaults: S=16384, checkpointing none and full, one-document rows
    python benchmarks/bench_gpu.py --seq 16384 32768 --rows packed --doc-len 2048 --profile
    python benchmarks/bench_gpu.py --sides lctrain --seq 65536 --checkpointing full --cpu-offload --activation-offload
    python benchmarks/bench_gpu.py --device cpu --hidden 64 --intermediate 128 --layers 2 --heads 4 --kv-heads 2 \\
        --vocab 8192 --seq 128 --warmup 1 --steps 2       # a smoke run on CPU (tests/unit/test_gpu_benchmarks.py)

The sides (``gpu_sides.py``): lctrain's ``Trainer.train_step`` at world size 1 in bf16, and the plain loop
(``LlamaForCausalLM``, sdpa, fp32 weights under ``torch.autocast(bfloat16)``, ``model(input_ids=x, labels=x).loss``,
``clip_grad_norm_``, ``AdamW(fused=True)``; Hugging Face's gradient checkpointing for ``--checkpointing full``), same
shape, same initial weights, same random rows. For each ``--seq`` and each ``--checkpointing`` mode, each side in
``--sides`` runs in a fresh process: ``--warmup`` steps, then ``--steps`` measured ones. Reported per run: the median
step time (a step ends reading back its loss, so the GPU's work is in it), tokens/s = S / step time, MFU = tokens/s ×
``lctrain.flops.flops_per_token`` / the GPU's dense bf16 peak (989 TFLOP/s on H100/H200; ``--peak-tflops``
otherwise), for packed rows also the MFU on the attention the rows really have
(``lctrain.flops.document_flops_per_token``), the peak allocated and reserved memory over the measured steps and their
difference (what the caching allocator holds beyond live tensors: fragmentation); then lctrain / HF ratios.

Also, with the defaults:

- FSDP2 at world size 1: one more step of each plain lctrain run under ``torch.profiler``: the kernel time launched
  inside FSDP2's own ranges (``FSDP::*``: all-gather and reduce-scatter with their copies and casts, at world size 1
  all overhead) over all kernel time of the step, and their host time over the step's wall time (target ≤ 3 %).
- the allocator: lctrain at the longest ``--seq`` and the last ``--checkpointing`` mode once more with
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False``: the fragmentation that lctrain's default
  (``expandable_segments:True``) saves (``--no-allocator-compare`` skips it; CUDA only).

On request: ``--cpu-offload`` and ``--activation-offload`` (with ``--checkpointing full``) add an lctrain run with
``parallel.cpu_offload`` / ``parallel.activation_offload`` at each point (their memory saving and slowdown);
``--profile`` prints each run's ``--top`` kernels (operators on CPU). ``--json PATH`` writes every result.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_sides import CHECKPOINTING, REPO, ROWS, SIDES, add_shape_args, num_params, run, shape_of
from report import document_lengths, table

from lctrain.flops import document_flops_per_token, flops_per_token

GIB = 2**30
LABELS = {"lctrain": "lctrain", "hf": "HF loop"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(parser)
    parser.add_argument("--seq", type=int, nargs="+", default=[16384], help="sequence lengths (tokens per row)")
    parser.add_argument(
        "--checkpointing",
        nargs="+",
        choices=CHECKPOINTING,
        default=list(CHECKPOINTING),
        help="activation checkpointing",
    )
    parser.add_argument("--rows", choices=ROWS, default="one-document", help="one document per row, or packed")
    parser.add_argument("--doc-len", type=int, default=2048, help="packed rows: tokens per document")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run")
    parser.add_argument("--cpu-offload", action="store_true", help="also lctrain with parallel.cpu_offload")
    parser.add_argument(
        "--activation-offload", action="store_true", help="also lctrain with parallel.activation_offload (AC full)"
    )
    parser.add_argument(
        "--no-allocator-compare", dest="allocator_compare", action="store_false", help="skip expandable_segments:False"
    )
    parser.add_argument("--profile", action="store_true", help="print each run's top kernels")
    parser.add_argument("--top", type=int, default=12, help="kernels per run with --profile")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    return parser.parse_args(argv)


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs: (label, spec, allocator) in order."""
    runs = []
    base = {
        "device": args.device,
        "shape": shape_of(args),
        "rows": args.rows,
        "doc_len": args.doc_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "cpu_offload": False,
        "activation_offload": False,
        "profile_top": args.top if args.profile else 0,
    }
    for seq in args.seq:
        for checkpointing in args.checkpointing:
            point = {**base, "seq": seq, "checkpointing": checkpointing}
            for side in args.sides:
                spec = {**point, "side": side, "fsdp_share": side == "lctrain"}
                runs.append({"label": LABELS[side], "spec": spec, "allocator": None})
            if "lctrain" not in args.sides:
                continue
            variant = {**point, "side": "lctrain", "fsdp_share": False}
            if args.cpu_offload:
                runs.append(
                    {"label": "lctrain, cpu_offload", "spec": {**variant, "cpu_offload": True}, "allocator": None}
                )
            if args.activation_offload and checkpointing == "full":
                spec = {**variant, "activation_offload": True}
                runs.append({"label": "lctrain, activation_offload", "spec": spec, "allocator": None})
    if args.allocator_compare and args.device == "cuda" and "lctrain" in args.sides:
        point = {**base, "seq": max(args.seq), "checkpointing": args.checkpointing[-1], "side": "lctrain"}
        spec = {**point, "fsdp_share": False}
        runs.append(
            {"label": "lctrain, expandable_segments:False", "spec": spec, "allocator": "expandable_segments:False"}
        )
    return runs


def gib(value: float | None) -> str:
    return "—" if value is None else f"{value / GIB:.2f}"


def figures(run_: dict[str, Any], shape: dict[str, int], peak_tflops: float | None) -> dict[str, Any]:
    """Step time, tokens/s, MFU (and the document MFU for packed rows) of one finished run."""
    result, spec = run_["result"], run_["spec"]
    step = statistics.median(result["step_s"])
    tokens_per_s = spec["seq"] / step
    peak = peak_tflops * 1e12 if peak_tflops else result["peak_flops"]
    params = num_params(shape)
    causal = flops_per_token(params, shape["layers"], shape["hidden"], spec["seq"])
    mfu = None if peak is None else tokens_per_s * causal / peak
    document_mfu = None
    if spec["rows"] == "packed" and peak is not None:
        lengths = document_lengths(spec["seq"], spec["doc_len"])
        document_mfu = tokens_per_s * document_flops_per_token(params, shape["layers"], shape["hidden"], lengths) / peak
    return {"step": step, "tokens_per_s": tokens_per_s, "mfu": mfu, "document_mfu": document_mfu}


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def report(args: argparse.Namespace, runs: list[dict[str, Any]], seconds: float, command: str) -> str:
    shape = shape_of(args)
    done = [r for r in runs if r["result"]["ok"]]
    device = next((r["result"]["device_name"] for r in done), args.device)
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("torch", "transformers"))
    lines = [
        "# GPU benchmark: lctrain vs a plain Hugging Face loop",
        "",
        f"- command: `{command}`",
        f"- device: {device}; {versions}; lctrain at {commit()}",
        f"- model: hidden {shape['hidden']}, intermediate {shape['intermediate']}, {shape['layers']} layers, "
        f"{shape['heads']}/{shape['kv_heads']} heads, vocab {shape['vocab']} (untied), "
        f"{num_params(shape):,} parameters",
        f"- rows: {args.rows}"
        + (f" (documents of {args.doc_len} tokens)" if args.rows == "packed" else "")
        + f"; {args.warmup} warm-up + {args.steps} measured steps per run, each run a fresh process",
        f"- total wall time {seconds:.0f} s",
        "",
    ]
    figs = {id(r): figures(r, shape, args.peak_tflops) for r in done}
    memory = "peak allocated" if args.device == "cuda" else "step peak RSS"
    header = ["run", "S", "AC", "step (s)", "tokens/s", "MFU", "MFU (document)", f"{memory} (GiB)"]
    header += ["peak reserved (GiB)", "reserved − allocated (GiB)", "loss first → last"]
    rows = []
    for r in runs:
        result, spec = r["result"], r["spec"]
        where = [r["label"], f"{spec['seq']:,}", spec["checkpointing"]]
        if not result["ok"]:
            rows.append([*where, f"**{result['error'][:100]}**", *[""] * (len(header) - 4)])
            continue
        f = figs[id(r)]
        reserved = result["peak_reserved"]
        fragmentation = None if reserved is None else reserved - result["peak_allocated"]
        loss = f"{result['loss'][0]:.4f} → {result['loss'][-1]:.4f}"
        rows.append(
            [
                *where,
                f"{f['step']:.3f}",
                f"{f['tokens_per_s']:,.0f}",
                percent(f["mfu"]),
                percent(f["document_mfu"]) if spec["rows"] == "packed" else "—",
                gib(result["peak_allocated"]),
                gib(reserved),
                gib(fragmentation),
                loss,
            ]
        )
    lines += [table(header, rows), ""]
    lines += ratio_section(runs, figs)
    lines += fsdp_section(runs)
    lines += allocator_section(runs)
    lines += offload_section(runs, figs)
    if args.profile:
        lines += profile_section(runs)
    return "\n".join(lines)


def _find(runs: list[dict[str, Any]], label: str, seq: int, checkpointing: str) -> dict[str, Any] | None:
    return next(
        (
            r
            for r in runs
            if r["label"] == label and r["spec"]["seq"] == seq and r["spec"]["checkpointing"] == checkpointing
        ),
        None,
    )


def _points(runs: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return list(dict.fromkeys((r["spec"]["seq"], r["spec"]["checkpointing"]) for r in runs))


def ratio_section(runs: list[dict[str, Any]], figs: dict[int, dict]) -> list[str]:
    rows = []
    for seq, checkpointing in _points(runs):
        ours, theirs = _find(runs, "lctrain", seq, checkpointing), _find(runs, "HF loop", seq, checkpointing)
        if not (ours and theirs):
            continue
        cells = [f"{seq:,}", checkpointing]
        if ours["result"]["ok"] and theirs["result"]["ok"]:
            a, b = figs[id(ours)], figs[id(theirs)]
            memory = ours["result"]["peak_allocated"] / theirs["result"]["peak_allocated"]
            cells += [f"{a['tokens_per_s']:,.0f}", f"{b['tokens_per_s']:,.0f}"]
            cells += [f"**{a['tokens_per_s'] / b['tokens_per_s']:.2f}**", f"{memory:.2f}"]
        else:
            cells += ["—" if not ours["result"]["ok"] else "", "—" if not theirs["result"]["ok"] else "", "—", "—"]
        rows.append(cells)
    if not rows:
        return []
    header = ["S", "AC", "lctrain tokens/s", "HF loop tokens/s", "ratio lctrain / HF", "peak memory lctrain / HF"]
    return ["## Ratio", "", table(header, rows), ""]


def fsdp_section(runs: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in runs:
        profile = r["result"].get("profile") if r["spec"].get("fsdp_share") else None
        if profile is None:
            continue
        where = [f"{r['spec']['seq']:,}", r["spec"]["checkpointing"]]
        if "error" in profile:
            rows.append([*where, f"profiler failed: {profile['error'][:80]}", "", "", "", ""])
            continue
        kernel = profile.get("kernel_ms")
        rows.append(
            [
                *where,
                "—" if kernel is None else f"{kernel:.1f}",
                "—" if kernel is None else f"{profile['fsdp_kernel_ms']:.1f}",
                percent(profile.get("fsdp_kernel_share")),
                f"{profile['fsdp_host_ms']:.1f} of {profile['wall_ms']:.1f}",
                percent(profile["fsdp_host_share"]),
            ]
        )
    if not rows:
        return []
    header = ["S", "AC", "step kernel time (ms)", "in FSDP2's ranges (ms)", "kernel share", "FSDP2 host time (ms)"]
    header.append("host share of the step")
    note = (
        "FSDP2 at world size 1, one profiled lctrain step: kernels launched inside FSDP2's outermost `FSDP::*` ranges "
        "(all-gather, reduce-scatter, their copies and casts) over all kernels of the step; target ≤ 3 %."
    )
    return ["## FSDP2 at world size 1", "", note, "", table(header, rows), ""]


def allocator_section(runs: list[dict[str, Any]]) -> list[str]:
    off = next((r for r in runs if r["allocator"] == "expandable_segments:False"), None)
    if off is None:
        return []
    on = _find(runs, "lctrain", off["spec"]["seq"], off["spec"]["checkpointing"])
    rows = []
    for r in (on, off):
        if r is None:
            continue
        result = r["result"]
        setting = r["allocator"] or result.get("allocator") or "(unset)"
        if not result["ok"]:
            rows.append([setting, f"**{result['error'][:100]}**", "", ""])
            continue
        reserved, allocated = result["peak_reserved"], result["peak_allocated"]
        rows.append([setting, gib(allocated), gib(reserved), gib(reserved - allocated)])
    header = ["PYTORCH_CUDA_ALLOC_CONF", "peak allocated (GiB)", "peak reserved (GiB)", "fragmentation (GiB)"]
    where = f"lctrain at S={off['spec']['seq']:,}, checkpointing {off['spec']['checkpointing']}"
    return ["## The allocator setting", "", where, "", table(header, rows), ""]


def offload_section(runs: list[dict[str, Any]], figs: dict[int, dict]) -> list[str]:
    rows = []
    for r in runs:
        if r["label"] not in ("lctrain, cpu_offload", "lctrain, activation_offload"):
            continue
        base = _find(runs, "lctrain", r["spec"]["seq"], r["spec"]["checkpointing"])
        cells = [r["label"], f"{r['spec']['seq']:,}", r["spec"]["checkpointing"]]
        if not (base and base["result"]["ok"] and r["result"]["ok"]):
            rows.append([*cells, "—", "—", "—", "—"])
            continue
        step, base_step = figs[id(r)]["step"], figs[id(base)]["step"]
        saved = base["result"]["peak_allocated"] - r["result"]["peak_allocated"]
        rows.append(
            [*cells, f"{step:.3f}", f"{step / base_step - 1:+.1%}", gib(r["result"]["peak_allocated"]), gib(saved)]
        )
    if not rows:
        return []
    header = ["run", "S", "AC", "step (s)", "slowdown vs lctrain", "peak memory (GiB)", "saved (GiB)"]
    return ["## Offload", "", table(header, rows), ""]


def profile_section(runs: list[dict[str, Any]]) -> list[str]:
    cuda = any(r["spec"]["device"] == "cuda" for r in runs)
    lines = ["## Top kernels" if cuda else "## Top operators (self CPU time)", ""]
    for r in runs:
        profile = r["result"].get("profile") or {}
        if "top" not in profile:
            continue
        lines.append(f"{r['label']}, S={r['spec']['seq']:,}, checkpointing {r['spec']['checkpointing']}:")
        lines.append("")
        rows = [
            [name[:100], f"{ms:.2f}", str(count), f"{100 * share:.1f}%"] for name, ms, count, share in profile["top"]
        ]
        lines += [table(["kernel" if cuda else "operator", "ms", "calls", "share"], rows), ""]
    return lines


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() or "unknown commit"
    except OSError:
        return "unknown commit"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    runs = plan(args)
    for index, r in enumerate(runs):
        spec = r["spec"]
        print(f"[{index + 1}/{len(runs)}] {r['label']}, S={spec['seq']}, AC {spec['checkpointing']}", file=sys.stderr)
        r["result"] = run(spec, timeout_s=args.run_timeout, allocator=r["allocator"])
        result = r["result"]
        outcome = result.get("stderr_tail") or result["error"]
        outcome = outcome or f"median step {statistics.median(result['step_s']):.3f} s"
        print(f"    {outcome} ({result['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        if args.json:  # after every run: a benchmark stopped by a timeout keeps what it measured
            done = [r for r in runs if "result" in r]
            Path(args.json).write_text(json.dumps({"command": command, "runs": done}, indent=1))
    print(report(args, runs, time.perf_counter() - started, command))


if __name__ == "__main__":
    main()
