"""Demo: a tiny Llama trained here on short passkey documents retrieves pass keys at lengths it never saw.

    .venv/bin/python examples/demo_passkey.py [--steps 3000] [--train-length 128] [--lengths 128 256 512 1024]

1. ``<out>/train.jsonl``: passkey documents (``lctrain.eval.passkey``) of 96 to ``--train-length`` tokens, random
   depths and 5-digit keys from a seed of their own, every key different and none of the evaluation's.
2. ``<out>/init``: the randomly initialized model (the trainer's seeded init) as a Hugging Face directory.
3. ``torchrun --nproc-per-node 2 -m lctrain train model.path=<out>/init data.paths=[<out>/train.jsonl]
   data.seq_len=256 data.batch_size=2 parallel.dp=2``: documents packed into rows of 256 tokens (attention stays
   inside each document, positions restart at 0), exported to ``<out>/train/hf``.
4. ``torchrun --nproc-per-node 4 -m lctrain eval`` of the initial and the trained model at ``--lengths`` on
   ring 2 × ulysses 2, into ``<out>/before/eval`` and ``<out>/after/eval``; the accuracy per length (mean over
   depths) is printed.

Every command is printed before it runs. About 10 minutes on 2 CPU cores (`docs/evaluation.md`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = [  # two layers: the least that can learn to copy (a previous-token head, then an induction head)
    "model.hidden_size=64",
    "model.intermediate_size=176",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
]


def run(command: list[str]) -> None:
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def torchrun(nproc: int, *args: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, "-m", "lctrain", *args]


def write_documents(path: Path, count: int, max_length: int, seed: int, exclude: set[str]) -> None:
    """``count`` passkey texts of 96 to ``max_length`` tokens, random depths, 5-digit keys all different and none in
    ``exclude``."""
    from lctrain.data import load_tokenizer
    from lctrain.eval.passkey import passkey_text

    tokenizer = load_tokenizer(None)
    rng = random.Random(seed)
    used = set(exclude)
    with path.open("w") as f:
        for _ in range(count):
            key = next(k for k in iter(lambda: str(rng.randint(10000, 99999)), None) if k not in used)
            used.add(key)
            length, depth = rng.randint(96, max_length), rng.random()
            f.write(json.dumps({"text": passkey_text(tokenizer, length, depth, key)}) + "\n")


def write_init(path: Path) -> None:
    """The randomly initialized model the trainer builds from ``MODEL`` (train.seed=0), as a Hugging Face directory."""
    import torch

    from lctrain.config import load_config
    from lctrain.data import load_tokenizer
    from lctrain.models import build_empty_model, export_hf, materialize, model_config, random_init_source

    tokenizer = load_tokenizer(None)
    cfg = load_config(MODEL)
    config = model_config(cfg.model, len(tokenizer))
    model = build_empty_model(config)
    materialize(model, random_init_source(config, cfg.train.seed), torch.device("cpu"))
    export_hf(model, config, path, tokenizer=tokenizer)


def scores_by_length(eval_dir: Path) -> dict[int, tuple[float, float, float]]:
    """Length -> (accuracy, token accuracy, log P(answer)), each the mean over the depths."""
    cells = json.loads((eval_dir / "passkey.json").read_text())["cells"]
    keys = ("accuracy", "token_accuracy", "answer_logprob")
    by_length: dict[int, list[dict]] = {}
    for cell in cells:
        by_length.setdefault(cell["length"], []).append(cell)
    return {n: tuple(sum(c[k] for c in cs) / len(cs) for k in keys) for n, cs in by_length.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo_passkey")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--train-length", type=int, default=128, help="the longest training document (tokens)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--depths", default="[0.0,0.25,0.5,0.75,1.0]")
    parser.add_argument("--samples", type=int, default=10)
    args = parser.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # 2 dp ranks × 2 rows of 256 tokens per step: about 8 documents of 96-160 tokens, none seen twice
    rows, seq_len = 4, 256
    documents = args.steps * rows * seq_len // 96 + 100
    from lctrain.eval.passkey import sample_key

    depths = [float(d) for d in args.depths.strip("[]").split(",")]
    evaluated = {sample_key(0, n, d, i, 5) for n in args.lengths for d in depths for i in range(args.samples)}
    write_documents(out / "train.jsonl", documents, args.train_length, seed=1234, exclude=evaluated)
    write_init(out / "init")
    run(
        torchrun(
            2,
            "train",
            f"model.path={args.out}/init",  # its config.json gives the sizes (MODEL)
            f"data.paths=[{args.out}/train.jsonl]",
            f"data.seq_len={seq_len}",
            "data.batch_size=2",
            "parallel.dp=2",
            f"optim.lr={args.lr}",
            "optim.warmup_steps=20",
            f"train.steps={args.steps}",
            "train.device=cpu",
            f"train.run_dir={args.out}/train",
            "checkpoint.every=0",
            "checkpoint.resume=none",
            "logging.every=100",
            "logging.progress_bar=false",
        )
    )
    trained = time.perf_counter() - start
    lengths = "[" + ",".join(map(str, args.lengths)) + "]"
    for name, model in (("before", f"{args.out}/init"), ("after", f"{args.out}/train/hf")):
        run(
            torchrun(
                4,
                "eval",
                f"model.path={model}",
                "parallel.ring=2",
                "parallel.ulysses=2",
                f"eval.lengths={lengths}",
                f"eval.depths={args.depths}",
                f"eval.samples={args.samples}",
                "eval.tasks=[passkey]",
                "train.device=cpu",
                f"train.run_dir={args.out}/{name}",
            )
        )
    before, after = scores_by_length(out / "before" / "eval"), scores_by_length(out / "after" / "eval")
    print(
        f"\npasskey, mean over depths {args.depths} ({args.samples} keys each), evaluated on ring 2 × ulysses 2; "
        f"trained {args.steps} steps on documents of <= {args.train_length} tokens ({trained:.0f} s with data and "
        f"init; {time.perf_counter() - start:.0f} s in all)"
    )
    print(f"{'length':>8} | {'accuracy':^17} | {'token accuracy':^17} | {'log P(answer)':^17}")
    print(f"{'':>8} | {'before':>8} {'after':>8} | {'before':>8} {'after':>8} | {'before':>8} {'after':>8}")
    for length in args.lengths:
        row = " | ".join(f"{before[length][i]:>8.2f} {after[length][i]:>8.2f}" for i in range(3))
        unseen = "  (longer than any training document)" if length > args.train_length else ""
        print(f"{length:>8d} | {row}{unseen}")
    print(f"heat maps: {args.out}/before/eval/passkey.png, {args.out}/after/eval/passkey.png")


if __name__ == "__main__":
    main()
