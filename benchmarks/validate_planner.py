"""Check ``lctrain plan``'s memory estimate against measured peaks: on CPU (fp32, gloo), or on one GPU (bf16)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.jobs import LLAMA_1B_UNTIED, REPO, bench_job, process_env
from benchmarks.report import MIB, arguments, command, machine_line, table
from benchmarks.runs import MALLOC_MMAP_THRESHOLD, Measured
from testbed.corpus import write_corpus

# (world size, pp, dp, ring, ulysses, activation checkpointing, seq_len, rows per step, loss chunk tokens)
CASES = [
    (1, 1, 1, 1, 1, "none", 2048, 1, 1024),
    (1, 1, 1, 1, 1, "none", 4096, 1, 1024),
    (1, 1, 1, 1, 1, "none", 8192, 1, 1024),
    (1, 1, 1, 1, 1, "none", 8192, 1, 64),  # a small loss chunk: the peak moves into the backward
    (1, 1, 1, 1, 1, "full", 8192, 1, 1024),
    (1, 1, 1, 1, 1, "none", 4096, 1, 4096),
    (2, 1, 1, 2, 1, "none", 8192, 1, 1024),
    (2, 1, 1, 1, 2, "none", 8192, 1, 1024),
    (2, 1, 1, 2, 1, "full", 8192, 1, 256),  # the ring's K/V and dK/dV buffers in the backward
    (2, 1, 1, 1, 2, "full", 8192, 1, 256),  # the all-to-all buffers in the backward
    (2, 1, 2, 1, 1, "none", 4096, 1, 1024),
    (2, 2, 1, 1, 1, "none", 4096, 2, 1024),
    (4, 1, 1, 2, 2, "none", 8192, 1, 1024),
    (4, 1, 1, 4, 1, "none", 8192, 1, 1024),
    (4, 1, 1, 2, 2, "full", 8192, 1, 256),
]


# one GPU (the job of ``jobs.bench_job``: Llama-3.2-1B's sizes with an untied head, bf16) at world size 1
CUDA_CASES = [
    (1, 1, 1, 1, 1, "none", 16384, 1, 1024),  # the peak in the loss's forward
    (1, 1, 1, 1, 1, "full", 65536, 1, 1024),  # in the last layer's backward
    (1, 1, 1, 1, 1, "full", 32768, 1, 256),  # small loss chunks
]


def overrides(case: list, corpus: str, run_dir: str, device: str = "cpu") -> list[str]:
    _, pp, dp, ring, ulysses, ac, seq_len, rows, chunk = case
    layout = (f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.ring={ring}", f"parallel.ulysses={ulysses}")
    rows = (f"data.seq_len={seq_len}", f"data.batch_size={rows}", f"data.paths=['{corpus}']")
    memory = (f"parallel.activation_checkpointing={ac}", f"train.loss_chunk_tokens={chunk}")
    return bench_job(device, *layout, *memory, *rows, "train.steps=2", f"train.run_dir={run_dir}")


def worker(cases: list[list], corpus: str, out: str, scratch: str, device_type: str) -> None:
    """Runs under torchrun: measure every case (``runs.Measured``: its side built, one step, then the measured one,
    on the job's own rows), rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    from lctrain.runtime import init_distributed, resolve_device

    init_distributed(resolve_device(device_type), timeout_s=1800)
    results = []
    warmup = [cases[0][0], *cases[0][1:6], 256, *cases[0][7:]]
    for index, case in enumerate([warmup, *cases]):
        if device_type == "cuda":
            torch.cuda.empty_cache()
        job = overrides(case, corpus, f"{scratch}/case{index}", device_type)
        measured = Measured({"case": {"side": "lctrain", "job": job, "rows": "loader"}})
        measured.step("case", case[6], 1)
        step = measured.step("case", case[6], 0)
        del measured
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {"baseline": step["base"], "peak": step["base"] + step["peak"]})
        if dist.get_rank() == 0 and index > 0:
            results.append({"case": case, "ranks": per_rank, "step_s": step["step_s"]})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def estimate(case: list, device: str = "cpu") -> dict:
    from lctrain.planner import GIB, NAMED_MODELS, Layout, Workload, estimate_memory

    world, pp, dp, ring, ulysses, ac, seq_len, rows, chunk = case
    layout = Layout(pp, dp, ring, ulysses, ac)
    e = 4 if device == "cpu" else 2
    work = Workload(seq_len, gpus_per_node=world, batch=rows, dtype_bytes=e, loss_chunk_tokens=chunk, device=device)
    model = NAMED_MODELS["tiny"] if device == "cpu" else replace(NAMED_MODELS["llama3.2-1b"], tied=False)  # jobs.py's
    estimated = estimate_memory(model, layout, work)
    return {k: v * GIB / MIB for k, v in estimated.gib().items() if isinstance(v, float)} | {"phase": estimated.phase}


def run(world: int, cases: list[list], corpus: Path, scratch: Path, device: str = "cpu") -> list[dict]:
    out = scratch / f"world{world}.json"
    env = process_env()
    if device == "cpu":
        env |= {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": MALLOC_MMAP_THRESHOLD}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    launch += ["-m", "benchmarks.validate_planner", "--worker", json.dumps(cases), str(corpus), str(out)]
    launch += [str(scratch), device]
    log = scratch / f"world{world}.log"
    with log.open("w") as f:
        proc = subprocess.run(launch, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"world size {world} failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def report(results: list[dict], seconds: float, command_line: str, device: str = "cpu", machine: str = "") -> str:
    m, model = LLAMA_1B_UNTIED, "model: tiny (recipes/tiny_cpu.yaml: width 128, 4 layers, 4/2 heads, vocab 8192), "
    model += "fp32, gloo, one thread per rank; memory in MiB per rank (the largest rank): resident set"
    if device == "cuda":
        model = (f"model: width {m['hidden']}, MLP {m['intermediate']}, {m['layers']} layers, {m['heads']}/"
                 f"{m['kv_heads']} heads, vocab {m['vocab']} (Llama-3.2-1B untied), bf16, one GPU; memory in MiB: "
                 "torch.cuda.max_memory_allocated (baseline: allocated before the Trainer)")  # fmt: skip
    lines = [f"command: {command_line}", machine or f"machine: {machine_line()}", model, ""]
    header = ["P", "pp", "dp", "ring", "uly", "AC", "seq_len", "rows", "loss chunk"]
    header += ["estimate: states + gathered + activations + recompute + backward + loss (phase)", "estimate"]
    header += ["measured", "error", "baseline", "total error"]
    rows, errors, total_errors = [], [], []
    for result in results:
        case = result["case"]
        est = estimate(case, device)
        worst = max(result["ranks"], key=lambda r: r["peak"] - r["baseline"])
        measured, baseline = (worst["peak"] - worst["baseline"]) / MIB, worst["baseline"] / MIB
        error, total_error = (est["total"] - measured) / measured, (est["total"] - measured) / (measured + baseline)
        errors.append(abs(error))
        total_errors.append(abs(total_error))
        terms = " + ".join(f"{est[k]:.1f}" for k in ("states", "gathered", "activations", "recompute", "backward"))
        cells = [*map(str, case), f"{terms} + {est['loss']:.1f} ({est['phase']})", f"{est['total']:.1f}"]
        rows.append([*cells, f"{measured:.1f}", f"{error:+.1%}", f"{baseline:.0f}", f"{total_error:+.1%}"])
    lines += [
        table(header, rows),
        "",
        f"mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%} (of the measured step peak); with "
        f"the baseline mean {sum(total_errors) / len(total_errors):.1%}, max {max(total_errors):.1%}",
        f"total wall time {seconds:.0f} s",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        cases, corpus, out, scratch, device = sys.argv[2:7]
        worker(json.loads(cases), corpus, out, scratch, device)
        return
    flags = {"quick": (False, "only the one-process cases"), "worlds": ([1, 2, 4], "world sizes to run")}
    parser = arguments(__doc__, device="cpu", **flags)  # cuda: CUDA_CASES on one GPU
    parser.add_argument("--save", metavar="JSON", help="also write the raw measurements here")
    parser.add_argument("--load", metavar="JSON", help="report saved measurements against the current estimate")
    args = parser.parse_args()
    if args.load:
        saved = json.loads(Path(args.load).read_text())
        device = saved.get("device", "cpu")
        print(report(saved["results"], saved["seconds"], saved["command"], device, saved.get("machine", "")))
        return
    worlds = [1] if args.quick or args.device == "cuda" else args.worlds
    all_cases = CUDA_CASES if args.device == "cuda" else CASES
    start = time.perf_counter()
    machine = ""
    if args.device == "cuda":
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
        machine = f"machine: {gpu[0] if gpu else 'a GPU'}, torch {importlib.metadata.version('torch')}"
    with tempfile.TemporaryDirectory(prefix="validate_planner_") as tmp:
        scratch = Path(tmp)
        corpus = write_corpus(scratch / "corpus.jsonl", documents=2000)
        results = []
        for world in worlds:
            cases = [list(case) for case in all_cases if case[0] == world]
            if cases:
                results += run(world, cases, corpus, scratch, args.device)
                print(f"world size {world}: {len(cases)} cases done ({time.perf_counter() - start:.0f} s)", flush=True)
    seconds = time.perf_counter() - start
    if args.save:
        saved = {"results": results, "seconds": seconds, "command": command(), "device": args.device}
        Path(args.save).write_text(json.dumps(saved | {"machine": machine}))
    print(report(results, seconds, command(), args.device, machine))


if __name__ == "__main__":
    main()
