"""What ring attention computes and sends for packed documents and for sliding windows, counted from the ring plan (no
timing)."""

from __future__ import annotations

import random

from benchmarks.report import arguments, table
from benchmarks.rings import ring_traffic
from lctrain.attention.ring_blocks import plan_ring, visible_pairs

Row = tuple[list[int] | None, int | None]  # (document boundaries or None for one document, window or None)


def span(values: list[float], form: str = ",") -> str:
    low, high = min(values), max(values)
    return f"{low:{form}}" if low == high else f"{low:{form}} … {high:{form}}"


def rows(seq: int, documents: list[int], cuts: int, windows: list[int]) -> dict[str, Row]:
    """The row kinds by name, one document first."""
    found: dict[str, Row] = {"one document": (None, None)}
    for length in documents:
        found[f"documents of {length:,}"] = (list(range(0, seq + 1, length)), None)
    if cuts:
        found[f"{cuts} random cuts"] = ([0, *sorted(random.Random(0).sample(range(1, seq), cuts)), seq], None)
    for window in windows:
        found[f"window {window:,}"] = (None, window)
    return found


def main() -> None:
    cuts = (200, "random document boundaries in one row (0: none)")
    parser = arguments(__doc__, seq=1048576, ring=8, cuts=cuts, kv_dim=(1024, "KV heads × head_dim per ring rank"))
    parser.add_argument("--documents", type=int, nargs="*", default=[2048, 16384], help="document lengths")
    parser.add_argument("--windows", type=int, nargs="*", default=[4096, 32768, 131072])
    args = parser.parse_args()
    if args.seq % args.ring or any(length > args.seq or args.seq % length for length in args.documents):
        parser.error(f"--seq {args.seq} must be divisible by --ring and by every --documents length")
    piece_len = args.seq // args.ring
    print(f"S={args.seq:,}, ring R={args.ring} ({piece_len:,} tokens per rank), causal; per rank (min … max), forward "
          f"pass; K/V elements for KV heads × head_dim = {args.kv_dim}")  # fmt: skip
    table_rows = []
    for layout in ("zigzag", "contiguous"):
        dense = None
        for name, (bounds, window) in rows(args.seq, args.documents, args.cuts, args.windows).items():
            row = {"cu_seqlens": None if bounds is None else tuple(bounds), "window": window}
            plans = [plan_ring(r, args.ring, piece_len, causal=True, layout=layout, **row) for r in range(args.ring)]
            work = [sum(visible_pairs(b) for step in plan for b in step.blocks) for plan in plans]
            dense = dense or max(work)  # the first row is one document
            calls = [sum(len(step.blocks) for step in plan) for plan in plans]
            traffic = ring_traffic(args.ring, piece_len, layout=layout, **row)
            sending, sent = [sum(n > 0 for n in t.kv) for t in traffic], [2 * sum(t.kv) * args.kv_dim for t in traffic]
            cells = [layout, name, span(work, ".3e"), f"{max(work) / dense:.4f}", span(calls)]
            table_rows.append([*cells, f"{len(plans[0])}/{args.ring}", span(sending), span(sent)])
    header = ["layout", "row", "query×key pairs", "busiest / one document", "kernel calls", "ring steps run"]
    print(table([*header, "steps sending K/V", "K/V elements sent"], table_rows))


if __name__ == "__main__":
    main()
