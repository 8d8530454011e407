"""Benchmark the pipeline bubble: the measured step time of pp=2 against the ideal, per schedule and micro-batch count,
beside the textbook bubble fraction."""

from __future__ import annotations

import argparse

from benchmarks.jobs import bench_job, shape_overrides
from benchmarks.report import arguments, heading, progress, table
from benchmarks.runs import run_steps
from benchmarks.timing import median
from lctrain.config import load_config
from lctrain.data import load_tokenizer
from lctrain.models import build_empty_model, model_config

SINGLE_STAGE = ("GPipe", "1F1B")


def job_overrides(args: argparse.Namespace, microbatches: int, pipeline: list[str]) -> list[str]:
    shape = {"hidden": args.hidden, "intermediate": args.hidden * 8 // 3, "layers": args.layers, "heads": 8}
    shape["kv_heads"] = 4
    rows = (f"data.seq_len={args.seq}", f"data.batch_size={microbatches}")
    return bench_job("cpu", "parallel.ring=1", "parallel.ulysses=1", *shape_overrides(shape), *rows, *pipeline)


def balanced_split(num_layers: int, head_layers: float, stages: int) -> list[str]:
    """Split points that give each stage about the same work, the last stage's LM head and loss counting as
    ``head_layers`` decoder layers (the last stage keeps at least one layer)."""
    per_stage = (num_layers + head_layers) / stages
    last = min(num_layers - (stages - 1), max(1, round(per_stage - head_layers)))
    rest = num_layers - last
    sizes = [rest // (stages - 1) + (index < rest % (stages - 1)) for index in range(stages - 1)] + [last]
    return [f"model.layers.{sum(sizes[:index])}" for index in range(1, stages)]


def main() -> None:
    schedules = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
    shape = {"microbatches": [2, 4, 8], "hidden": 256, "layers": 8, "seq": 512}
    quick = (False, "GPipe and 1F1B at m = 2, 4; 3 timed steps")
    args = arguments(__doc__, warmup=2, steps=5, schedules=schedules, **shape, quick=quick).parse_args()
    if args.quick:
        args.schedules, args.microbatches, args.steps = ["GPipe", "1F1B"], [2, 4], 3
    pp, cfg = 2, load_config(job_overrides(args, 1, []))
    model = build_empty_model(model_config(cfg.model, len(load_tokenizer(cfg.data.tokenizer))))
    # the LM head's parameters in units of one decoder layer's (a rough measure of its forward + backward work)
    head = model.lm_head.weight.numel() / sum(p.numel() for p in model.model.layers[0].parameters())
    print(heading() + "\n")
    print(f"Llama {args.hidden} wide, {args.layers} layers, {args.seq} tokens per row, pp={pp}; the LM head counts as "
          f"{head:.1f} layers for the split.\n")  # fmt: skip
    rows = []
    for schedule in args.schedules:
        v = 1 if schedule in SINGLE_STAGE else 2
        split = balanced_split(args.layers, head, pp * v)
        pipeline = [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={v}"]
        pipeline.append(f"parallel.pp_split_points=[{','.join(split)}]")
        for m in args.microbatches:  # forward_backward over one batch of all the rows: the slower rank's wall time
            spec = {"side": "lctrain", "job": job_overrides(args, m, pipeline), "batch": m, "part": "forward_backward"}
            steps = [(args.seq, 0)] * (args.warmup + args.steps)
            result = run_steps({"pp": spec}, pp, steps[: args.warmup], steps[args.warmup :])["pp"]
            measured, busy = median(result["steps"], "step_s"), [median(rank, "cpu_s") for rank in result["per_rank"]]
            textbook = (pp - 1) / (v * m + pp - 1)
            cells = [schedule, " ".join(point.rsplit(".", 1)[1] for point in split), str(m), f"{measured * 1e3:.0f}"]
            cells += [" / ".join(f"{cpu * 1e3:.0f}" for cpu in busy), f"{1 - max(busy) / measured:.2f}"]
            rows.append([*cells, f"{textbook:.2f}"])
            progress(f"{schedule} m={m}: {measured * 1e3:.0f} ms, busy {busy}")
    header = ["schedule", "split at layer", "m", "measured (ms)", "busy rank 0 / 1 (ms)", "bubble", "textbook"]
    print(table(header, rows))


if __name__ == "__main__":
    main()
