"""Is the data loader ever the bottleneck? Loader throughput beside what one training step consumes, per rank, for text
and for conversations."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import tempfile
from itertools import islice
from pathlib import Path

import torch

from benchmarks.report import arguments, command, machine_line
from benchmarks.runs import run_steps
from benchmarks.timing import clock, median
from lctrain.attention import SequencePlace
from lctrain.data import ChatEncoder, DataConfig, DocumentSource, PackedLoader, default_tokenizer_dir, load_tokenizer
from lctrain.data.chat import parse_conversation
from lctrain.data.packing import Document, Packer
from lctrain.data.tokenizer import CHAT_TEMPLATE
from testbed.jobs import tiny_job

LONG_TURNS = 200
LONG_SEQ_LEN = 131072


def write_long_conversations(path: Path, count: int, seed: int = 0) -> None:
    """``count`` jsonl conversations of ``LONG_TURNS`` turns (user and assistant in turn), each 125,743 tokens of the
    embedded tokenizer: excerpts of 2,750 characters of the standard library's ``inspect.py``."""
    import inspect

    text = Path(inspect.__file__).read_text()
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(count):
            messages = []
            for turn in range(LONG_TURNS):
                start = rng.randrange(len(text) - 2750)
                role = "user" if turn % 2 == 0 else "assistant"
                messages.append({"role": role, "content": text[start : start + 2750]})
            f.write(json.dumps({"messages": messages}) + "\n")


def loader_rates(config: DataConfig, place: SequencePlace, rows: int) -> tuple[float, float]:
    """Global rows/s and tokens/s of a loader over ``rows`` rows after the first (which opens the stream)."""
    batches = iter(PackedLoader(config, place=place))
    next(batches)
    with clock() as seconds:
        sum(1 for _ in islice(batches, rows))
    return rows / seconds["wall"], rows * config.seq_len / seconds["wall"]


def expanded_rates(path: Path, template: str, tokenizer_dir: Path) -> tuple[float, float, int]:
    """Global rows/s and tokens/s of rendering (once per turn), tokenizing and packing every conversation of ``path``
    into ``LONG_SEQ_LEN`` rows, and the number of documents they became."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    with clock() as seconds:
        lines = path.read_text().splitlines()
        conversations = [parse_conversation(line, f"{path}:{number}") for number, line in enumerate(lines, start=1)]
        encoded = ChatEncoder(tokenizer, template=template).encode(conversations)
        documents = [part for item in encoded for part in item if isinstance(part, Document)]
        rows = sum(1 for _ in Packer(iter(documents), LONG_SEQ_LEN, pad_id=tokenizer.pad_token_id)) + 1  # + the last
    return rows / seconds["wall"], rows * LONG_SEQ_LEN / seconds["wall"], len(documents)


def chat_section(args: argparse.Namespace, place: SequencePlace, tokenizer_dir: Path) -> list[str]:
    """The conversation figures, each against the default job's consumption."""
    job = {"side": "lctrain", "job": tiny_job("checkpoint.resume=none"), "rows": "loader"}
    every = [(1024, index) for index in range(max(3, args.default_job_steps))]
    steps = run_steps({"job": job}, 4, every[:2], every[2:])["job"]["steps"]  # the first steps warm up
    step = median(steps, "step_s")
    job_tokens = 1024 / step
    lines = [f"default job (recipe=tiny_cpu, 4 processes): median step {step:.3f} s over {len(steps)} steps = "
             f"{1 / step:.2f} rows/s, {job_tokens:,.0f} tokens/s", "",
             f"{'conversations':58} {'rows/s':>9} {'tokens/s':>11} {'x the job':>10}"]  # fmt: skip
    short = DataConfig(seq_len=1024, format="chat", tokenizer=str(tokenizer_dir))
    with tempfile.TemporaryDirectory() as scratch:
        plain = Path(scratch) / "chatml_without_marks.jinja"
        plain.write_text(CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
        long_file = Path(scratch) / "long.jsonl"
        write_long_conversations(long_file, args.long_conversations + 1)
        long = DataConfig(seq_len=LONG_SEQ_LEN, paths=[str(long_file)], format="chat", tokenizer=str(tokenizer_dir))
        marks_off = {"chat_template": str(plain)}
        long_name = f"{LONG_TURNS} turns, ~126K tokens"
        cases = [
            ("short (embedded chat corpus), generation marks", short, args.chat_rows),
            ("short (embedded chat corpus), prefixes", dataclasses.replace(short, **marks_off), args.chat_rows),
            (f"{long_name}, generation marks", long, args.long_conversations),
            (f"{long_name}, prefixes", dataclasses.replace(long, **marks_off), args.long_conversations),
        ]
        for name, config, rows in cases:
            rows_per_s, tokens_per_s = loader_rates(config, place, rows)
            lines.append(f"{name:58} {rows_per_s:9.2f} {tokens_per_s:11,.0f} {tokens_per_s / job_tokens:9.1f}x")
        expanded_file = Path(scratch) / "expanded.jsonl"
        write_long_conversations(expanded_file, args.expanded_conversations, seed=1)
        prompt = "{{- '<|im_start|>assistant\\n' -}}"
        eos_after_last = plain.read_text().replace(prompt, prompt + "{%- else -%}{{- eos_token -}}")
        assert eos_after_last.count("eos_token") == 1
        rows_per_s, tokens_per_s, documents = expanded_rates(expanded_file, eos_after_last, tokenizer_dir)
        name = f"{long_name}, expanded ({documents} documents)"
        lines.append(f"{name:58} {rows_per_s:9.2f} {tokens_per_s:11,.0f} {tokens_per_s / job_tokens:9.1f}x")
    return lines


def main() -> None:
    flags = {"tokens": (4_000_000, "global tokens the loader is timed on"), "train_steps": 3}
    flags["device"] = ("cpu", "where the training step runs (the loader runs on CPU)")
    flags["chat_rows"] = (300, "1024-token rows of short conversations timed")
    flags["long_conversations"] = (4, "~126K-token conversations timed")
    flags["expanded_conversations"] = (1, "~126K-token ones rendered per turn")
    flags["default_job_steps"] = (12, "training steps of the default job")
    args = arguments(__doc__, seq_len=4096, ring=2, ulysses=2, **flags).parse_args()
    start_line, local = machine_line(), args.seq_len // (args.ring * args.ulysses)

    with clock() as tokenizer:
        default_tokenizer_dir()  # trains it on first use
    with clock() as skip:
        skipped = sum(1 for _ in DocumentSource().texts(0))  # what a resume at the end of an epoch re-reads

    place = SequencePlace(ring_size=args.ring, ulysses_size=args.ulysses)
    loader_seconds = 1 / loader_rates(DataConfig(seq_len=args.seq_len), place, -(-args.tokens // args.seq_len))[0]
    # one step of the plain Hugging Face loop (sides.HFSide, fp32) of a tiny Llama on one rank's tokens
    model = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_layers=4", "model.num_heads=4"]
    job = tiny_job(*model, "model.num_kv_heads=4", f"train.device={args.device}", "checkpoint.resume=none")
    every = [(local, index) for index in range(args.train_steps + 1)]
    step_seconds = median(
        run_steps({"hf": {"side": "hf", "job": job}}, 1, every[:1], every[1:])["hf"]["steps"], "step_s"
    )
    loader_rate, step_rate = local / loader_seconds, local / step_seconds
    print(f"command: {command()}")
    gpu = f", train step on {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""
    print(f"machine: {platform.platform()}, {start_line}, {torch.get_num_threads()} torch threads{gpu}")
    print(f"seq_len {args.seq_len}, ring {args.ring} x ulysses {args.ulysses}: {local} tokens per rank per row")
    print(f"default tokenizer ready in {tokenizer['wall']:.2f} s (0 when cached)\n")
    print(f"{'':44} {'s / row':>10} {'local tok/s':>12} {'global tok/s':>13}")
    loader = f"{loader_seconds:10.4f} {loader_rate:12,.0f} {args.seq_len / loader_seconds:13,.0f}"
    print(f"{'loader (tokenize + pack + CP shard)':44} {loader}")
    print(f"{'tiny Llama fwd+bwd+AdamW on ' + str(local) + ' tokens':44} {step_seconds:10.4f} {step_rate:12,.0f}")
    print(f"ratio loader / train step: {loader_rate / step_rate:.1f}x (target >= 10x)")
    print(f"resume skip: re-reading a whole epoch ({skipped} documents, no tokenization) takes {skip['wall']:.2f} s\n")
    print("\n".join(chat_section(args, place, default_tokenizer_dir())) + "\n")
    print(f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
