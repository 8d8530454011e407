"""Preference pairs with the prompt once against the prompt repeated for each answer, and what each reference option
costs, on 4 CPU ranks (ring 2 x Ulysses 2) or one GPU: step time and per-rank peak memory growth of a DPO step."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.jobs import bench_job
from benchmarks.report import MIB, OnDevice, arguments, heading, save_json, table
from benchmarks.runs import Probe, Search, malloc_env, run_steps
from benchmarks.timing import median

RANKS = {"cpu": 4, "cuda": 1}
MESH = {"cpu": ("parallel.ring=2", "parallel.ulysses=2"), "cuda": ()}


def pair_length(prompt: int, completion: int, shared: bool) -> int:
    """The row length of one pair, rounded up to 8 (2 x ring x Ulysses)."""
    tokens = prompt + 2 * completion + 1 if shared else 2 * (prompt + completion)
    return -(-tokens // 8) * 8


def job(device: str, seq: int, *changes: str) -> list[str]:
    return bench_job(device, *MESH[device], f"data.seq_len={seq}", "objective.name=dpo", *changes)


def pair_spec(args: argparse.Namespace, prompt: int, shared: bool, *changes: str) -> dict[str, Any]:
    """A side of ``run``: one pair a row, of ``prompt`` and ``--completion`` tokens."""
    seq = pair_length(prompt, args.completion, shared)
    return {"job": job(args.device, seq, *changes), "prompt": prompt, "completion": args.completion, "shared": shared}


def run(specs: dict[str, dict[str, Any]], warmup: int, steps: int, ranks: int) -> dict[str, dict[str, float]]:
    """Each side's median step time and CPU time, largest step growth, activations and peak over the ranks
    (``runs.run_steps``); ``specs``: per side ``pair_spec`` and ``precompute`` (the reference's log-probs)."""
    every = [(0, index) for index in range(warmup + steps)]  # a pair's row is as long as its job's data.seq_len
    sides = {}
    for name, spec in specs.items():
        pair = {key: spec[key] for key in ("prompt", "completion", "shared")}
        sides[name] = {"side": "lctrain", "job": spec["job"], "rows": "pairs", "pair": pair, "part": "forward_backward",
                       "precompute": every if spec.get("precompute") else None}  # fmt: skip
    with malloc_env(for_memory=True):
        result = run_steps(sides, ranks, every[:warmup], every[warmup:])
    figures = {}
    for name, side in result.items():
        if not side["ready"]["ok"] or not all(step["ok"] for step in side["steps"]):
            raise RuntimeError(f"{name}: {next(r for r in [side['ready'], *side['steps']] if not r['ok'])['error']}")
        figures[name] = {"time": median(side["steps"], "step_s"), "cpu": median(side["steps"], "cpu_s")}
        figures[name] |= {key: max(step[key] for step in side["steps"]) for key in ("kept", "peak")}
        figures[name]["growth"] = max(step["step_peak"] for step in side["steps"])
    return figures


def sharing(args: argparse.Namespace) -> None:
    rows, cases = [], []
    for ratio in args.ratios:
        prompt = ratio * args.completion
        specs = {side: pair_spec(args, prompt, side == "shared") for side in ("shared", "unshared")}
        result = run(specs, args.warmup, args.steps, RANKS[args.device])
        shared, unshared = result["shared"], result["unshared"]
        cells = [f"{ratio}:1", f"{prompt:,} + 2 x {args.completion}"]
        forms = {"time": "{:.3f} s", "cpu": "{:.3f} s", "kept": "{:,.1f}", "growth": "{:,.0f}", "peak": "{:,.0f}"}
        for key, form in forms.items():
            unit, scale = ("", 1) if form.endswith(" s") else (" MiB", MIB)
            both = f"{form.format(shared[key] / scale)} / {form.format(unshared[key] / scale)}{unit}"
            cells += [both, f"{shared[key] / unshared[key]:.2f}"]
        rows.append(cells)
        print(f"  {rows[-1]}", flush=True)
        cases.append({"ratio": ratio, "prompt": prompt, "completion": args.completion, **result})
        save_json(args.json, cases=cases)
    header = ["prompt:completion", "pair tokens", "step shared / unshared", "time ratio", "step CPU", "ratio"]
    header += ["activations", "ratio", "step peak growth", "ratio", "step peak", "ratio"]
    print("\n" + table(header, rows))


def references(args: argparse.Namespace) -> None:
    prompt, simpo = args.reference_ratio * args.completion, "objective.loss_type=[simpo]"
    lora = ["model.lora.rank=16", "model.lora.alpha=32"]
    options = {"full: none (simpo)": [simpo], "full: frozen copy": [], "full: precomputed": []}
    options |= {"LoRA: none (simpo)": [*lora, simpo], "LoRA: base, adapters off": lora}
    specs = {name: pair_spec(args, prompt, True, *changes) for name, changes in options.items()}
    specs["full: precomputed"]["precompute"] = True
    result = run(specs, args.warmup, args.steps, RANKS[args.device])
    rows = [[name, f"{r['time']:.3f} s", f"{r['kept'] / MIB:,.1f} MiB", f"{r['growth'] / MIB:,.0f} MiB"]
            for name, r in result.items()]  # fmt: skip
    print(f"\nreference options, prompt {prompt:,} + 2 x {args.completion} (shared; sigmoid unless said)\n")
    print(table(["reference", "step", "activations", "step peak growth"], rows))


def longest(args: argparse.Namespace) -> None:
    """Prompts doubling from 4,096 tokens (``search.Search``) until a step does not finish."""

    def probe(prompt: int) -> Probe:
        try:
            result = run({"shared": pair_spec(args, prompt, True)}, 0, 1, RANKS[args.device])["shared"]
        except Exception as error:  # a rank ran out of memory or time: the previous length is the longest
            print(f"  prompt {prompt:,}: did not train ({type(error).__name__})", flush=True)
            return Probe(prompt, False, {"error": type(error).__name__})
        print(f"  prompt {prompt:,}: {result['time']:.1f} s, growth {result['growth'] / MIB:,.0f} MiB", flush=True)
        return Probe(prompt, True, result)

    search = Search(probe, 4096, args.longest)
    if (prompt := search.run(4096, bisect=0)) is not None:
        result = search.probes[prompt].result
        print(f"\nlongest pair trained: prompt {prompt:,} + 2 x {args.completion} tokens "
              f"({pair_length(prompt, args.completion, True):,}-token row), {result['time']:.1f} s a step, "
              f"step growth {result['growth'] / MIB:,.0f} MiB per rank")  # fmt: skip


def main() -> None:
    flags = {"reference_ratio": (16, "the ratio of the reference options' rows")}
    flags["longest"] = (0, "only search the longest prompt up to this")
    flags["ratios"] = OnDevice([1, 4, 16, 64], [16], "prompt:completion ratios")
    flags["completion"] = OnDevice(32, 1024, "tokens of each answer")
    args = arguments(__doc__, device="cpu", warmup=1, steps=4, json=None, **flags).parse_args()
    print(heading(), flush=True)
    if args.device == "cpu":
        print(f"\n4 ranks (ring 2 x Ulysses 2), the tiny recipe's model, fp32, DPO, medians of {args.steps} steps")
    else:
        print(f"\none GPU, Llama-3.2-1B's sizes (untied), bf16, DPO, medians of {args.steps} steps")
    if args.longest:
        longest(args)
        return
    sharing(args)
    if args.device == "cpu":
        references(args)


if __name__ == "__main__":
    main()
