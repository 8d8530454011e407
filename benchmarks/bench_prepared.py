"""Prepared data against the files: ``lctrain prepare``'s throughput and its use of the cores, then, for text and for
conversations, each read by 1 and by 4 processes (dp ranks), the loader's time to its first batch (what differs
between the two before a training step: the model's part is the same) and its tokens per second.

    python -m benchmarks.bench_prepared [--text-mb 100] [--chat-mb 10] [--seq-len 8192] [--seconds 20]

The corpus is generated: text documents of 20K to 200K characters and conversations of 2 to 8 turns of 200 to
1,500 characters, excerpts of the standard library's files, jsonl, read with the embedded tokenizer and its
template. Targets: from the prepared set, the first batch in at most 0.2 x the time and at least 10 x the tokens
per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import resource
import tempfile
import time
from itertools import islice
from pathlib import Path

from benchmarks.report import command, machine_line, table
from lctrain.data import DataConfig, PackedLoader, SourceConfig, default_tokenizer_dir
from lctrain.data.prepare import prepare
from lctrain.data.sources import read_text_files, stdlib_files


def write_corpus(root: Path, text_mb: float, chat_mb: float) -> None:
    library = "".join(example["text"] for example in read_text_files(stdlib_files()))
    rng = random.Random(0)

    def excerpt(low: int, high: int) -> str:
        start = rng.randrange(len(library) - high)
        return library[start : start + rng.randint(low, high)]

    with (root / "text.jsonl").open("w") as f:
        while f.tell() < text_mb * 1e6:
            f.write(json.dumps({"text": excerpt(20_000, 200_000)}) + "\n")
    with (root / "chat.jsonl").open("w") as f:
        while f.tell() < chat_mb * 1e6:
            turns = 2 * rng.randint(1, 4)
            roles = ["user", "assistant"] * turns
            f.write(
                json.dumps({"messages": [{"role": r, "content": excerpt(200, 1500)} for r in roles[:turns]]}) + "\n"
            )


def read(config: DataConfig, dp_rank: int, dp_size: int, seconds: float, barrier=None, out=None) -> tuple:  # noqa: ANN001
    """(seconds to the first batch, tokens read, seconds reading them) of dp rank ``dp_rank``'s loader; with several
    processes, each phase starts on all of them at once (``barrier``) and the figures go to the queue ``out``."""
    wait = barrier.wait if barrier is not None else lambda: None
    wait()
    began = time.perf_counter()
    batches = iter(PackedLoader(config, dp_rank=dp_rank, dp_size=dp_size))
    next(batches)
    first = time.perf_counter() - began
    wait()
    tokens, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        tokens += sum(batch["input_ids"].numel() for batch in islice(batches, 4))
    figures = (first, tokens, time.perf_counter() - began)
    if out is not None:
        out.put(figures)
    return figures


def measure(config: DataConfig, processes: int, seconds: float) -> tuple[float, float]:
    """(the slowest rank's seconds to its first batch, the ranks' tokens per second together)."""
    if processes == 1:
        results = [read(config, 0, 1, seconds)]
    else:
        context = multiprocessing.get_context("spawn")
        barrier, out = context.Barrier(processes), context.Queue()
        ranks = [
            context.Process(target=read, args=(config, rank, processes, seconds, barrier, out))
            for rank in range(processes)
        ]
        for rank in ranks:
            rank.start()
        results = [out.get() for _ in ranks]
        for rank in ranks:
            rank.join()
    return max(r[0] for r in results), sum(r[1] / r[2] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-mb", type=float, default=100.0)
    parser.add_argument("--chat-mb", type=float, default=10.0)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=20.0, help="each loader reads this long")
    args = parser.parse_args()
    print(f"`{command()}`\n\n{machine_line()}\n")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(root, args.text_mb, args.chat_mb)
        sources = [SourceConfig(name, [str(root / f"{name}.jsonl")]) for name in ("text", "chat")]
        tokenizer = str(default_tokenizer_dir())
        config = DataConfig(seq_len=args.seq_len, sources=sources, tokenizer=tokenizer, prepared=str(root / "set"))
        began, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        manifest = prepare(config, tokenizer, progress=False)
        wall = time.perf_counter() - began
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        cpu_s = sum(u.ru_utime + u.ru_stime for u in used) - cpu.ru_utime - cpu.ru_stime
        tokens = sum(source["counts"]["tokens"] for source in manifest["sources"].values())
        megabytes = sum(os.path.getsize(root / f"{name}.jsonl") for name in ("text", "chat")) / 1e6
        print(
            f"prepare: {megabytes:.0f} MB of jsonl, {tokens / 1e6:.1f}M tokens in {wall:.0f} s: "
            f"{tokens / wall / 1e6:.2f}M tokens/s, {megabytes / wall:.2f} MB/s, {os.cpu_count()} workers, CPU time "
            f"{cpu_s:.0f} s = {cpu_s / wall:.2f} of {os.cpu_count()} cores busy\n"
        )
        rows = []
        for index, name in enumerate(("text", "chat")):
            one = dataclasses.replace(config, sources=[sources[index]])
            for processes in (1, 4):
                raw = measure(dataclasses.replace(one, prepared=None), processes, args.seconds)
                fast = measure(one, processes, args.seconds)
                rows.append(
                    [name, str(processes), f"{raw[0]:.2f}", f"{fast[0]:.3f}", f"{fast[0] / raw[0]:.3f}"]
                    + [f"{raw[1] / 1e6:.2f}", f"{fast[1] / 1e6:.2f}", f"{fast[1] / raw[1]:.0f}"]
                )
        header = ["source", "processes", "first batch, files (s)", "prepared (s)", "ratio (target <= 0.2)"]
        header += ["loader M tokens/s, files", "prepared", "ratio (target >= 10)"]
        print(table(header, rows))


if __name__ == "__main__":
    main()
