"""The cost of the ruler suite: scoring an example against a validation forward of the same tokens, and the in-training
suite against the run it is part of."""

from __future__ import annotations

import argparse
import functools
import time

import torch

from benchmarks.jobs import bench_job
from benchmarks.report import arguments, heading, progress, table
from benchmarks.timing import gathered_slowest, median, rounds
from lctrain.testing import run_distributed

MESHES = {1: ["parallel.ring=1", "parallel.ulysses=1"], 4: ["parallel.ring=2", "parallel.ulysses=2"]}


def scoring_vs_validation(overrides: list[str], lengths: list[int], repeats: int) -> dict[int, dict[str, list]]:
    """On the spawned group: per length, the rounds (``timing.rounds``, the slowest rank's) of scoring one example
    and of validating its tokens."""
    from lctrain.build import build_job
    from lctrain.config import load_config
    from lctrain.models.hidden_states import FinalHiddenStates
    from lctrain.ruler.tasks import TaskMaker
    from lctrain.train.forward import ModelForward
    from lctrain.train.ruler_score import packed_row, score_examples
    from lctrain.train.validate import score_rows

    cfg = load_config([*overrides, f"data.seq_len={max(lengths)}"])
    job = build_job(cfg, training=False)  # the model as lctrain eval builds it
    prepared, place, device, group = job.prepared, job.mesh.place, job.device, job.mesh.dp_cp
    hidden_states = FinalHiddenStates(job.model.model)
    forward = ModelForward(hidden_states, device)
    maker = TaskMaker(prepared.tokenizer, seed=0)
    results = {}
    for length in lengths:
        example = maker.make("niah_single", length, 0.5, 0)
        row = packed_row([example], 1, example.length - example.answer_start, place)
        full_labels = torch.cat([example.input_ids[1:], torch.tensor([-100])])[None]
        row["labels"] = place.shard(full_labels, dim=1)  # the validation row: every token predicted

        jobs = {
            "score": functools.partial(
                score_examples, [example], forward, pack_tokens=length, rows_per_run=1, place=place,
                dp_rank=0, dp=1, device=device, tokenizer=prepared.tokenizer
            ),
            "validate": functools.partial(
                score_rows, hidden_states, [row], dp_rank=0, dp=1, group=group, device=device,
                chunk_tokens=cfg.train.loss_chunk_tokens
            )
        }  # fmt: skip
        sides = {name: lambda _, job=job: job() for name, job in jobs.items()}
        results[length] = gathered_slowest(rounds(sides, 1, repeats, barrier=True))
    return results


def training_overhead(overrides: list[str]) -> dict[str, float]:
    """On the spawned group: the run's wall time and its suite's."""
    from lctrain.config import load_config
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer

    trainer = Trainer(build_training_job(load_config(overrides)))
    suite_s = []
    run_suite = trainer.suite.run

    def timed_run(step: int) -> dict:
        start = time.perf_counter()
        figures = run_suite(step)
        suite_s.append(time.perf_counter() - start)
        return figures

    trainer.suite.run = timed_run
    start = time.perf_counter()
    trainer.train()
    return {"run_s": time.perf_counter() - start, "suite_s": sum(suite_s), "suite_runs": len(suite_s),
            "examples": len(trainer.suite.scorer.examples)}  # fmt: skip


def main() -> None:
    flags = {"steps": (100, "the training run's steps"), "every": (100, "ruler.every of the training run")}
    parser = arguments(__doc__, lengths=[16384, 65536], repeats=3, **flags)
    parser.add_argument("--parts", nargs="+", choices=("scoring", "training"), default=["scoring", "training"])
    args = parser.parse_args()
    print(heading() + "\n")
    if "scoring" in args.parts:
        scoring(args)
    if "training" in args.parts:
        training(args)


def scoring(args: argparse.Namespace) -> None:
    rows = []
    for world, mesh in MESHES.items():
        overrides = bench_job("cpu", *mesh, "parallel.activation_checkpointing=none")
        found = run_distributed(scoring_vs_validation, world, overrides, args.lengths, args.repeats)[0]
        for length, times in found.items():
            wall, cpu = ({k: median(v, key) for k, v in times.items()} for key in ("wall", "cpu"))
            ranks = f"{world}" + (" (ring 2 × Ulysses 2)" if world > 1 else "")
            ratio, cpu_ratio = wall["score"] / wall["validate"], cpu["score"] / cpu["validate"]
            rows.append([ranks, f"{length:,}", f"{wall['score']:.2f} s", f"{wall['validate']:.2f} s", f"{ratio:.2f}",
                         f"{cpu_ratio:.2f}"])  # fmt: skip
            progress(f"  ranks {world}, {length}: {times}")
    print("Scoring one example against a validation forward of the same tokens (medians of the slowest rank):\n")
    print(table(["ranks", "tokens", "scoring", "validation", "wall ratio (target ≤ 1.2)", "CPU ratio"], rows))


def training(args: argparse.Namespace) -> None:
    overrides = bench_job("cpu", f"train.steps={args.steps}", f"ruler.every={args.every}", "checkpoint.every=0",
                          "train.run_dir=/tmp/bench_ruler_run")  # fmt: skip
    found = run_distributed(training_overhead, 4, overrides)[0]
    rest = found["run_s"] - found["suite_s"]
    print(
        f"\nIn training (tiny recipe, 4 ranks, {args.steps} steps, ruler.every={args.every}, the default suite of "
        f"{found['examples']} examples): run {found['run_s']:.1f} s, suite {found['suite_s']:.1f} s in "
        f"{found['suite_runs']} runs: the suite adds {100 * found['suite_s'] / rest:.1f} % (target ≤ 5 %)"
    )


if __name__ == "__main__":
    main()
