"""Benchmark the pipeline bubble: the measured step time of pp=2 against the ideal, per schedule and micro-batch count,
beside the textbook bubble fraction.

Run from the repository root::

    python -m benchmarks.bench_pipeline            # 5 schedules × m ∈ {2, 4, 8} (about 10 minutes on 2 cores)
    python -m benchmarks.bench_pipeline --quick    # GPipe and 1F1B, m ∈ {2, 4}
    python -m benchmarks.bench_pipeline --schedules GPipe Interleaved1F1B --microbatches 4 16

A step here is ``Trainer.forward_backward`` over m rows, the pipeline's m micro-batches: the whole schedule, the
stages' P2P sends and the FSDP gradient reduction, not the optimizer step (which has no bubble). Each configuration
runs in a fresh spawned gloo group of 2 processes (one per core, one thread each): ``--warmup`` untimed steps, then
the medians of ``--steps`` timed ones. The rows are synthetic: ``--seq`` random tokens, one document each.

- ``measured``: the step's wall time (the ranks start and end together, at barriers).
- ``busy``: each rank's CPU time in the step (``time.process_time``: its compute, plus the little its gloo threads
  use to move data; a rank that waits for the other stage sleeps, it does not spin). ``ideal`` = the busier rank's
  busy time: the step could be no shorter, whatever the schedule. ``bubble`` = 1 − ideal / measured: the fraction
  of the step the busier rank spent waiting. The other rank's extra idle time is imbalance between the stages.
- ``textbook`` = (p − 1) / (v·m + p − 1): the idle fraction of a balanced pipeline with v stages per rank (GPipe and
  1F1B: v = 1; the others here: v = 2). The zero-bubble schedules aim below it by filling the bubble with weight
  gradients.

The model (Llama, ``--hidden`` wide, ``--layers`` layers, vocabulary 8192) has the embeddings on the first stage and
the norm, LM head and loss on the last. The split points balance the stages by parameter count, the LM head
counting as (vocabulary × hidden) / (one layer's parameters) layers; they are printed. Caveats: 2 cores, gloo on
loopback (a P2P send costs little next to a stage's compute here, unlike across nodes), fp32, a VM whose timings
vary by about ±15 % between runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.jobs import bench_job
from benchmarks.report import command, machine_line, table
from benchmarks.sides import packed_batch
from lctrain.config import load_config
from lctrain.data import load_tokenizer
from lctrain.models import build_empty_model, model_config
from lctrain.testing import run_distributed
from lctrain.train.job import build_training_job
from lctrain.train.trainer import Trainer

SINGLE_STAGE = ("GPipe", "1F1B")


def job_overrides(args: argparse.Namespace, microbatches: int, pipeline: list[str]) -> list[str]:
    return bench_job(
        "cpu",
        "parallel.ring=1",
        "parallel.ulysses=1",
        "model.hidden_size=" + str(args.hidden),
        "model.intermediate_size=" + str(args.hidden * 8 // 3),
        f"model.num_layers={args.layers}",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        f"data.seq_len={args.seq}",
        f"data.batch_size={microbatches}",
        *pipeline,
        "train.run_dir=/tmp/lctrain_bench_pipeline",
    )


def time_steps(overrides: list[str], warmup: int, steps: int) -> tuple[float, float]:
    """In each rank of a spawned group: the median wall time and CPU time of ``forward_backward`` over one batch of
    all the rows."""
    trainer = Trainer(build_training_job(load_config(overrides)))
    shape, generator = (trainer.cfg.data.batch_size, trainer.cfg.data.seq_len), torch.Generator().manual_seed(0)
    batch = packed_batch(torch.randint(0, trainer.hf_config.vocab_size, shape, generator=generator), None)
    wall, cpu = [], []
    for index in range(warmup + steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.forward_backward([batch])
        busy = time.process_time() - start_cpu
        dist.barrier()
        if index >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(busy)
        trainer.optimizer.zero_grad(set_to_none=True)
    return statistics.median(wall), statistics.median(cpu)


def balanced_split(num_layers: int, head_layers: float, stages: int) -> list[str]:
    """Split points that give each stage about the same work, the last stage's LM head and loss counting as
    ``head_layers`` decoder layers (the last stage keeps at least one layer)."""
    per_stage = (num_layers + head_layers) / stages
    last = min(num_layers - (stages - 1), max(1, round(per_stage - head_layers)))
    rest = num_layers - last
    sizes = [rest // (stages - 1) + (index < rest % (stages - 1)) for index in range(stages - 1)] + [last]
    return [f"model.layers.{sum(sizes[:index])}" for index in range(1, stages)]


def head_layers(args: argparse.Namespace) -> float:
    """The LM head's parameters in units of one decoder layer's (a rough measure of its forward + backward work)."""
    cfg = load_config(job_overrides(args, 1, []))
    model = build_empty_model(model_config(cfg.model, len(load_tokenizer(cfg.data.tokenizer))))
    return model.lm_head.weight.numel() / sum(p.numel() for p in model.model.layers[0].parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    schedules = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
    parser.add_argument("--schedules", nargs="+", default=schedules)
    parser.add_argument("--microbatches", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="GPipe and 1F1B at m = 2, 4; 3 timed steps")
    args = parser.parse_args()
    if args.quick:
        args.schedules, args.microbatches, args.steps = ["GPipe", "1F1B"], [2, 4], 3
    pp = 2
    head = head_layers(args)
    print(f"`{command()}`")
    print()
    print(machine_line())
    print()
    print(
        f"Llama {args.hidden} wide, {args.layers} layers, {args.seq} tokens per row, pp={pp}; the LM head counts "
        f"as {head:.1f} layers for the split."
    )
    print()
    rows = []
    for schedule in args.schedules:
        stages_per_rank = 1 if schedule in SINGLE_STAGE else 2
        split = balanced_split(args.layers, head, pp * stages_per_rank)
        pipeline = [
            f"parallel.pp={pp}",
            f"parallel.pp_schedule={schedule}",
            f"parallel.pp_stages_per_rank={stages_per_rank}",
            f"parallel.pp_split_points=[{','.join(split)}]",
        ]
        for m in args.microbatches:
            ranks = run_distributed(time_steps, pp, job_overrides(args, m, pipeline), args.warmup, args.steps)
            measured = max(wall for wall, _ in ranks)
            busy = [cpu for _, cpu in ranks]
            ideal = max(busy)
            textbook = (pp - 1) / (stages_per_rank * m + pp - 1)
            rows.append(
                [
                    schedule,
                    " ".join(point.rsplit(".", 1)[1] for point in split),
                    str(m),
                    f"{measured * 1e3:.0f}",
                    " / ".join(f"{cpu * 1e3:.0f}" for cpu in busy),
                    f"{1 - ideal / measured:.2f}",
                    f"{textbook:.2f}",
                ]
            )
            print(f"{schedule} m={m}: {measured * 1e3:.0f} ms, busy {busy}", file=sys.stderr, flush=True)
    header = ["schedule", "split at layer", "m", "measured (ms)", "busy rank 0 / 1 (ms)", "bubble", "textbook"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
