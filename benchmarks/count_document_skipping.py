"""Kernel calls and attention work with and without document masking, counted from the ring plan (no timing).

    python -m benchmarks.count_document_skipping [--seq 131072] [--ring 8]

For a packed causal row on a zigzag ring, it prints, per document length, the kernel calls and the query×key
pairs the busiest rank computes over all ring steps, and how many ring steps run (steps that no rank needs are
dropped, with their K/V transfers), against the same row treated as one document. Skipped blocks are never
computed; the counts are what ``ring_attention`` executes (it runs exactly these blocks).
"""

from __future__ import annotations

import argparse
import random

from lctrain.attention.ring_blocks import plan_ring, visible_pairs


def busiest_rank(ring: int, piece_len: int, bounds: list[int] | None) -> tuple[int, int, int, int]:
    """(kernel calls, query×key pairs, steps with work, steps run) of the rank with the most pairs."""
    per_rank = []
    for rank in range(ring):
        plan = plan_ring(
            rank, ring, piece_len, causal=True, layout="zigzag", cu_seqlens=None if bounds is None else tuple(bounds)
        )
        blocks = [b for step in plan for b in step.blocks]
        busy = sum(1 for step in plan if step.blocks)
        per_rank.append((len(blocks), sum(visible_pairs(b) for b in blocks), busy, len(plan)))
    return max(per_rank, key=lambda counts: counts[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--ring", type=int, default=8)
    args = parser.parse_args()
    piece_len = args.seq // args.ring
    rng = random.Random(0)
    rows = {"one document": None}
    for doc_len in (256, 2048, 16384):
        rows[f"documents of {doc_len}"] = list(range(0, args.seq + 1, doc_len))
    cuts = sorted(rng.sample(range(1, args.seq), 200))
    rows["200 random cuts"] = [0, *cuts, args.seq]
    print(f"S={args.seq}, zigzag ring R={args.ring}, causal; busiest rank, forward (backward runs the same blocks)")
    print(
        "| row | kernel calls | steps with work | ring steps run (K/V fetched steps − 1 times) | query×key pairs | "
        "fraction of one-document work |"
    )
    print("|---|---|---|---|---|---|")
    dense = busiest_rank(args.ring, piece_len, None)[1]
    for name, bounds in rows.items():
        calls, work, busy, run = busiest_rank(args.ring, piece_len, bounds)
        print(f"| {name} | {calls} | {busy} | {run}/{args.ring} | {work:.3e} | {work / dense:.4f} |")


if __name__ == "__main__":
    main()
