"""Is the data loader ever the bottleneck? Loader throughput beside what one training step consumes, per rank.

    python -m benchmarks.bench_loader [--seq-len 4096] [--ring 2] [--ulysses 2] [--tokens 4000000] [--device cpu]

One process plays one context-parallel rank (ring rank 0, Ulysses rank 0) of a ring x ulysses group reading the
embedded default corpus (Python standard library, default tokenizer). Every rank of the group tokenizes and packs
whole rows and keeps S/(R·U) tokens of each, so the loader's figure is per-rank *local* tokens/s. The baseline, in
the same run: one forward + backward + AdamW step of a tiny Llama (hidden 256, 4 layers, 4 heads) on one batch of
that rank's S/(R·U) tokens, on one process (no communication), i.e. the tokens one rank consumes per step; on
the CPU by default, or on a GPU with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from itertools import islice

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.report import command
from lctrain.attention import SequencePlace
from lctrain.data import DataConfig, DocumentSource, PackedLoader, default_tokenizer_dir
from lctrain.data.packing import IGNORE_INDEX


def train_step_seconds(vocab_size: int, batch: dict, steps: int, device: torch.device) -> float:
    """Median seconds of forward + backward + AdamW (fp32) on ``batch`` for a tiny Llama on ``device``."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=vocab_size,
        max_position_embeddings=1 << 20,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    batch = {key: batch[key].to(device) for key in ("input_ids", "labels", "position_ids")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--ring", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument(
        "--tokens", type=int, default=4_000_000, help="global tokens to time the loader on (spans many tokenizer calls)"
    )
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the training step runs (the loader runs on CPU)")
    args = parser.parse_args()
    cp = args.ring * args.ulysses
    local = args.seq_len // cp

    start = time.perf_counter()
    default_tokenizer_dir()  # trains it on first use
    tokenizer_seconds = time.perf_counter() - start

    start = time.perf_counter()
    skipped = sum(1 for _ in DocumentSource().texts(0))  # what a resume at the end of an epoch re-reads
    skip_seconds = time.perf_counter() - start

    place = SequencePlace(ring_size=args.ring, ulysses_size=args.ulysses)
    loader = PackedLoader(DataConfig(seq_len=args.seq_len), place=place)
    batches = iter(loader)
    first = next(batches)  # opens the stream
    rows = -(-args.tokens // args.seq_len)
    start = time.perf_counter()
    for _ in islice(batches, rows):
        pass
    loader_seconds = (time.perf_counter() - start) / rows
    device = torch.device(args.device)
    step_seconds = train_step_seconds(len(loader.tokenizer), first, args.train_steps, device)

    loader_rate, step_rate = local / loader_seconds, local / step_seconds
    print(f"command: {command()}")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
        + (f", train step on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    print(f"seq_len {args.seq_len}, ring {args.ring} x ulysses {args.ulysses}: {local} tokens per rank per row")
    print(f"default tokenizer ready in {tokenizer_seconds:.2f} s (0 when cached)")
    print()
    print(f"{'':44} {'s / row':>10} {'local tok/s':>12} {'global tok/s':>13}")
    print(
        f"{'loader (tokenize + pack + CP shard)':44} {loader_seconds:10.4f} {loader_rate:12,.0f} "
        f"{args.seq_len / loader_seconds:13,.0f}"
    )
    print(f"{'tiny Llama fwd+bwd+AdamW on ' + str(local) + ' tokens':44} {step_seconds:10.4f} {step_rate:12,.0f}")
    print(f"ratio loader / train step: {loader_rate / step_rate:.1f}x (target >= 10x)")
    print(f"resume skip: re-reading a whole epoch ({skipped} documents, no tokenization) takes {skip_seconds:.2f} s")


if __name__ == "__main__":
    main()
