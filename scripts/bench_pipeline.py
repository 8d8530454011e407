"""Benchmark the pipeline bubble: the measured step time of pp=2 against the ideal, per schedule and micro-batch count,
beside the textbook bubble fraction.

Run from the repository root::

    python scripts/bench_pipeline.py            # 5 schedules × m ∈ {2, 4, 8} (about 10 minutes on 2 cores)
    python scripts/bench_pipeline.py --quick    # GPipe and 1F1B, m ∈ {2, 4}
    python scripts/bench_pipeline.py --schedules GPipe Interleaved1F1B --microbatches 4 16

A step here is ``Trainer.forward_backward`` over m rows (the pipeline's m micro-batches: the whole schedule, the
stages' P2P sends and the FSDP gradient reduction; not the optimizer step, which has no bubble). Each configuration
runs in a fresh spawned gloo group with one thread per process: ``--warmup`` untimed steps, then the median of
``--steps`` timed ones. The data are synthetic rows of ``--seq`` random tokens, one document each.

- ``T1``: the same model and rows at pp=1, one process (one core): all the work, done back to back.
- ``ideal`` = T1 / p: p = 2 processes (each on its own core) splitting that work with no idle time.
- ``bubble`` = 1 − ideal / measured: the fraction of a pp rank's step spent not computing (waiting for the other
  stage, sending, imbalance between the stages).
- ``textbook`` = (p − 1) / (v·m + p − 1): idle fraction of a balanced pipeline with v stages per rank (GPipe and
  1F1B: v = 1; interleaved: v = 2); zero-bubble schedules aim below it by filling the bubble with weight gradients.

The model (Llama, ``--hidden`` wide, ``--layers`` layers, vocabulary 8192) puts the embeddings on the first stage
and the norm, LM head and loss on the last; ``--split`` names the first layer of the second stage (default: the
split that balances the two stages' work, measured below). The last stage's LM head and loss cost about as much as
``head_layers`` decoder layers, printed with the result; balance is never exact, and what is left shows up in the
bubble column. Caveats: 2 cores, gloo on loopback (a P2P send costs little next to a stage's compute here, unlike
across nodes), fp32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from bench_report import machine_line, table

from lctrain.config import load_config
from lctrain.parallel.spawn import run_distributed
from lctrain.train.trainer import Trainer

SINGLE_STAGE = ("GPipe", "1F1B")


def job_overrides(args: argparse.Namespace, microbatches: int, pipeline: list[str]) -> list[str]:
    return [
        "model.hidden_size=" + str(args.hidden),
        "model.intermediate_size=" + str(args.hidden * 8 // 3),
        f"model.num_layers={args.layers}",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        f"data.seq_len={args.seq}",
        f"data.batch_size={microbatches}",
        *pipeline,
        "train.device=cpu",
        "train.run_dir=/tmp/lctrain_bench_pipeline",
        "checkpoint.every=0",
        "checkpoint.resume=none",
        "checkpoint.export_hf=false",
        "logging.plot=false",
        "logging.progress_bar=false",
    ]


def synthetic_batch(rows: int, seq: int, vocab: int) -> dict:
    input_ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    return {
        "input_ids": input_ids,
        "position_ids": torch.arange(seq).expand(rows, seq).clone(),
        "labels": torch.cat([input_ids[:, 1:], torch.full((rows, 1), -100)], dim=1),
        "cu_seqlens": [torch.tensor([0, seq], dtype=torch.int32)] * rows,
    }


def time_steps(overrides: list[str], warmup: int, steps: int) -> float:
    """In each rank of a spawned group: the median time of ``forward_backward`` over one batch of all the rows."""
    trainer = Trainer(load_config(overrides))
    batch = synthetic_batch(trainer.cfg.data.batch_size, trainer.cfg.data.seq_len, trainer.hf_config.vocab_size)
    times = []
    for index in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.forward_backward([batch])
        dist.barrier()
        if index >= warmup:
            times.append(time.perf_counter() - start)
        trainer.optimizer.zero_grad(set_to_none=True)
    return statistics.median(times)


def balanced_split(num_layers: int, head_layers: float, stages: int) -> list[str]:
    """Split points that give each stage about the same work, the last stage's LM head and loss counting as
    ``head_layers`` decoder layers (the last stage keeps at least one layer)."""
    per_stage = (num_layers + head_layers) / stages
    last = min(num_layers - (stages - 1), max(1, round(per_stage - head_layers)))
    rest = num_layers - last
    sizes = [rest // (stages - 1) + (index < rest % (stages - 1)) for index in range(stages - 1)] + [last]
    return [f"model.layers.{sum(sizes[:index])}" for index in range(1, stages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--schedules", nargs="+", default=["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
    )
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
    print(f"`python scripts/bench_pipeline.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print()
    print(machine_line())
    print()

    single = {
        m: run_distributed(time_steps, 1, job_overrides(args, m, []), args.warmup, args.steps)[0]
        for m in args.microbatches
    }
    m0 = args.microbatches[0]
    half = args.layers // 2
    half_args = argparse.Namespace(**{**vars(args), "layers": half})
    t_half = run_distributed(time_steps, 1, job_overrides(half_args, m0, []), args.warmup, args.steps)[0]
    layer_cost = (single[m0] - t_half) / (args.layers - half)
    head_layers = max(0.0, single[m0] / layer_cost - args.layers)
    print(
        f"Llama {args.hidden} wide, {args.layers} layers, {args.seq} tokens per row; at pp=1 a decoder layer costs "
        f"{layer_cost / m0 * 1e3:.1f} ms per row (forward + backward), the embeddings, LM head and loss "
        f"{head_layers:.1f} layers' worth."
    )
    print()
    rows = []
    for schedule in args.schedules:
        stages_per_rank = 1 if schedule in SINGLE_STAGE else 2
        split = balanced_split(args.layers, head_layers, pp * stages_per_rank)
        for m in args.microbatches:
            pipeline = [
                f"parallel.pp={pp}",
                f"parallel.pp_schedule={schedule}",
                f"parallel.pp_stages_per_rank={stages_per_rank}",
                f"parallel.pp_split_points=[{','.join(split)}]",
            ]
            try:
                measured = max(
                    run_distributed(time_steps, pp, job_overrides(args, m, pipeline), args.warmup, args.steps)
                )
            except Exception as error:  # a schedule that refuses this m (check_pipeline) is reported, not fatal
                rows.append([schedule, str(m), "-", "-", "-", "-", f"refused: {str(error).splitlines()[-1][:80]}"])
                continue
            ideal = single[m] / pp
            textbook = (pp - 1) / (stages_per_rank * m + pp - 1)
            rows.append(
                [
                    schedule,
                    str(m),
                    f"{single[m] * 1e3:.0f}",
                    f"{ideal * 1e3:.0f}",
                    f"{measured * 1e3:.0f}",
                    f"{1 - ideal / measured:.2f}",
                    f"{textbook:.2f}",
                ]
            )
            print(f"{schedule} m={m}: {measured * 1e3:.0f} ms", file=sys.stderr, flush=True)
    header = ["schedule", "m", "T1 pp=1 (ms)", "ideal T1/2 (ms)", "pp=2 measured (ms)", "bubble", "textbook"]
    print(table(header, rows))
    print()
    print(
        "split points (first layer of each later stage):",
        {s: balanced_split(args.layers, head_layers, pp * (1 if s in SINGLE_STAGE else 2)) for s in args.schedules},
    )


if __name__ == "__main__":
    main()
