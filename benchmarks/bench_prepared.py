"""Prepared data against the files: ``lctrain prepare``'s throughput, then the loader's time to its first batch and its
tokens per second from the prepared set and from the files."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch.distributed as dist

from benchmarks.report import arguments, heading, table
from lctrain.data import DataConfig, PackedLoader, SourceConfig, default_tokenizer_dir
from lctrain.data.prepare import prepare
from lctrain.data.sources import read_text_files, stdlib_files
from lctrain.testing import run_distributed


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
            messages = [{"role": r, "content": excerpt(200, 1500)} for r in roles[:turns]]
            f.write(json.dumps({"messages": messages}) + "\n")


def read(config: DataConfig, seconds: float) -> tuple[float, int, float]:
    """On each rank of the default group, its dp rank's loader: (seconds to the first batch, tokens read, seconds
    reading them), each phase started on every rank at once."""
    dist.barrier()
    began = time.perf_counter()
    batches = iter(PackedLoader(config, dp_rank=dist.get_rank(), dp_size=dist.get_world_size()))
    next(batches)
    first = time.perf_counter() - began
    dist.barrier()
    tokens, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        tokens += sum(batch["input_ids"].numel() for batch in islice(batches, 4))
    return first, tokens, time.perf_counter() - began


def measure(config: DataConfig, processes: int, seconds: float) -> tuple[float, float]:
    """(the slowest rank's seconds to its first batch, the ranks' tokens per second together)."""
    results = run_distributed(read, processes, config, seconds)
    return max(r[0] for r in results), sum(r[1] / r[2] for r in results)


def main() -> None:
    sizes = {"text_mb": 100.0, "chat_mb": 10.0, "seq_len": 8192, "seconds": (20.0, "each loader reads this long")}
    args = arguments(__doc__, **sizes).parse_args()
    print(heading() + "\n")
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
        print(f"prepare: {megabytes:.0f} MB of jsonl, {tokens / 1e6:.1f}M tokens in {wall:.0f} s: "
              f"{tokens / wall / 1e6:.2f}M tokens/s, {megabytes / wall:.2f} MB/s, {os.cpu_count()} workers, CPU time "
              f"{cpu_s:.0f} s = {cpu_s / wall:.2f} of {os.cpu_count()} cores busy\n")  # fmt: skip
        rows = []
        for index, name in enumerate(("text", "chat")):
            one = dataclasses.replace(config, sources=[sources[index]])
            for processes in (1, 4):
                raw = measure(dataclasses.replace(one, prepared=None), processes, args.seconds)
                fast = measure(one, processes, args.seconds)
                cells = [name, str(processes), f"{raw[0]:.2f}", f"{fast[0]:.3f}", f"{fast[0] / raw[0]:.3f}"]
                rows.append([*cells, f"{raw[1] / 1e6:.2f}", f"{fast[1] / 1e6:.2f}", f"{fast[1] / raw[1]:.0f}"])
        header = ["source", "processes", "first batch, files (s)", "prepared (s)", "ratio (target <= 0.2)"]
        header += ["loader M tokens/s, files", "prepared", "ratio (target >= 10)"]
        print(table(header, rows))


if __name__ == "__main__":
    main()
