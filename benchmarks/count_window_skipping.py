"""Work and communication of sliding-window ring attention, counted from the ring plan (no timing).

    python -m benchmarks.count_window_skipping [--seq 1048576] [--ring 8] [--windows 4096 32768 131072]

For one causal document on a ring of R ranks, zigzag and contiguous, with no window and each window W, it prints
per rank (min … max over ranks, forward pass): the query×key pairs computed (``visible_pairs`` of every block:
what a banded kernel such as flash-attn computes), that work divided by tokens × W, kernel calls, the ring steps
run, the steps at which the rank sends K/V, and the K/V elements it sends (rows × 2 × ``--kv-dim``, K and V; the
default 1024 = 8 KV heads × 128, Llama-3-8B). The backward runs the same blocks, fetches the same rows again and
returns as many dK/dV elements (fp32) to their owners. The plan is what ``ring_attention`` executes.
"""

from __future__ import annotations

import argparse

from lctrain.attention.ring_blocks import plan_ring, visible_pairs


def span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,} … {high:,}"


def span_e(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.3e}" if low == high else f"{low:.3e} … {high:.3e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1048576)
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--kv-dim", type=int, default=1024, help="KV heads × head_dim per ring rank")
    args = parser.parse_args()
    piece_len = args.seq // args.ring
    print(
        f"S={args.seq:,}, ring R={args.ring} ({piece_len:,} tokens per rank), causal, one document; per rank "
        f"(min … max), forward pass; K/V elements for KV heads × head_dim = {args.kv_dim}"
    )
    print(
        "| layout | window | query×key pairs | pairs / (tokens × W) | kernel calls | ring steps run | "
        "steps sending K/V | K/V elements sent |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layout in ("zigzag", "contiguous"):
        for window in [None, *args.windows]:
            plans = [
                plan_ring(rank, args.ring, piece_len, causal=True, layout=layout, window=window)
                for rank in range(args.ring)
            ]
            work = [sum(visible_pairs(b) for step in plan for b in step.blocks) for plan in plans]
            calls = [sum(len(step.blocks) for step in plan) for plan in plans]
            sending = [sum(step.send.stop > step.send.start for step in plan) for plan in plans]
            rows_sent = [sum(step.send.stop - step.send.start for step in plan) for plan in plans]
            per_token_window = "—" if window is None else f"{max(work) / (piece_len * window):.3f}"
            print(
                f"| {layout} | {'none' if window is None else f'{window:,}'} | {span_e(work)} | {per_token_window} | "
                f"{span(calls)} | {len(plans[0])}/{args.ring} | {span(sending)} | "
                f"{span([2 * rows * args.kv_dim for rows in rows_sent])} |"
            )


if __name__ == "__main__":
    main()
