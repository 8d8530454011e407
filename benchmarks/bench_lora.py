"""A LoRA step against a full fine-tuning step of the same model on the same mesh, on CPU ranks: per-rank peak memory
and step time, split into the forward + backward and the optimizer step (clipping, AdamW, the schedule)."""

from __future__ import annotations

import argparse

from benchmarks.jobs import bench_job, shape_overrides
from benchmarks.report import MIB, arguments, heading, table
from benchmarks.runs import malloc_env, run_steps
from benchmarks.timing import median

MESHES = {1: (1, 1), 2: (2, 1), 4: (2, 2)}  # ranks -> (ring, ulysses)
SIDES = ("full", "lora")


def jobs(args: argparse.Namespace) -> dict[str, list[str]]:
    """The full fine-tuning job and the LoRA job: the same model, mesh, seed and schedule."""
    ring, ulysses = MESHES[args.ranks]
    shape = {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers, "heads": 8, "kv_heads": 4}
    mesh = (f"parallel.ring={ring}", f"parallel.ulysses={ulysses}")
    base = bench_job("cpu", *shape_overrides(shape), *mesh, f"train.steps={args.warmup + 2 * args.steps}")
    trainable = [f"model.lora.trainable=[{args.trainable}]"] if args.trainable else []
    lora = [f"model.lora.rank={args.lora_rank}", f"model.lora.alpha={2 * args.lora_rank}", *trainable]
    return {"full": base, "lora": [*base, *lora]}


def main() -> None:
    shape = {"seq": (2048, "tokens per row"), "hidden": 512, "intermediate": 1376, "layers": 4, "lora_rank": 16}
    trainable = ("", "model.lora.trainable, comma-separated (default: none)")
    parser = arguments(__doc__, warmup=1, steps=5, **shape, trainable=trainable)
    parser.add_argument("--ranks", type=int, choices=sorted(MESHES), default=2)
    args = parser.parse_args()
    print(heading(), flush=True)
    specs, steps = jobs(args), [(args.seq, index) for index in range(args.warmup + args.steps)]
    with malloc_env(for_memory=False):  # both jobs in one group, their steps in turn, each in two parts
        sides = {side: {"side": "lctrain", "job": job, "part": "parts"} for side, job in specs.items()}
        timed = run_steps(sides, args.ranks, steps[: args.warmup], steps[args.warmup :])
    rows, times = [], {}
    for side in SIDES:
        with malloc_env(for_memory=True):  # each job in a group of its own: a step after a warm-up one
            one = {side: {"side": "lctrain", "job": specs[side]}}
            peak = run_steps(one, args.ranks, [(args.seq, 1)], [(args.seq, 0)])[side]["steps"][0]["peak"]
        times[side] = fwd_bwd, opt = [
            median(timed[side]["steps"], key) for key in ("forward_backward_s", "optimizer_s")
        ]
        label, count = "full fine-tuning" if side == "full" else "LoRA", timed[side]["ready"]["model"]["trained"]
        rows.append([label, f"{count:,}", f"{peak / MIB:,.0f} MiB", f"{fwd_bwd:.3f} s", f"{opt * 1e3:.1f} ms"])
        rows[-1].append(f"{fwd_bwd + opt:.3f} s")
    ring, ulysses = MESHES[args.ranks]
    trained = f" + {args.trainable}" if args.trainable else ""
    print(f"\n{args.ranks} rank(s) (ring {ring} × Ulysses {ulysses}), width {args.hidden}, MLP {args.intermediate}, "
          f"{args.layers} layers, S={args.seq}, fp32; LoRA rank {args.lora_rank}{trained}; medians of {args.steps} "
          "steps\n")  # fmt: skip
    header = ["", "trained parameters", "peak memory per rank", "forward + backward", "optimizer step", "step"]
    print(table(header, rows))
    extra, saved = times["lora"][0] - times["full"][0], times["full"][1] - times["lora"][1]
    verdict = "within" if extra <= saved else "NOT within"
    print(f"\nthe adapters' forward + backward cost {extra * 1e3:+.1f} ms against full fine-tuning's; the optimizer "
          f"step saves {saved * 1e3:.1f} ms: {verdict} the bar")  # fmt: skip


if __name__ == "__main__":
    main()
