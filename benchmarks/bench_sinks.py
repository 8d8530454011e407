"""The cost of gpt-oss's attention sinks in a ring step: attention forward+backward on one rank's piece with and
without ``sinks``, the fold (``merge.fold_sink``) and the sinks' gradient (``merge.sink_grad``) being all that
differs. The fold runs once per rank and layer, after the ring's last block, on the rank's own rows, so its share of
a step only falls as the ring grows (each step adds blocks, the fold stays one pass): one rank's piece as a ring of
one is its largest share.

    python -m benchmarks.bench_sinks [--tokens 4096] [--heads 8] [--kv-heads 2] [--head-dim 64] [--iters 5]

Median of ``--iters`` runs after a warm-up; CPU (its threads: ``--threads``) or ``--device cuda``. Target: the sinks
cost at most 3 % of the step.
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.timing import median_seconds
from lctrain.attention import usp_attention


def attention_pass(tensors: list[torch.Tensor], sinks: torch.Tensor | None, window: int | None) -> None:
    """Forward + backward of ``usp_attention`` (no groups: one rank's piece), with ``sinks`` or without."""
    q, k, v, dout = tensors
    out = usp_attention(q, k, v, causal=True, layout="contiguous", window=window, sinks=sinks)
    out.backward(dout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    tensors = [
        torch.randn(1, args.tokens, h, args.head_dim, generator=gen).to(device, dtype).requires_grad_(i < 3)
        for i, h in enumerate(heads)
    ]
    sinks = torch.randn(args.heads, generator=gen).to(device, dtype).requires_grad_()
    print(
        f"{args.device}, {args.threads} thread(s), torch {torch.__version__}, {args.dtype}, "
        f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, {args.tokens} tokens, window {args.window}, "
        f"forward+backward, median of {args.iters}"
    )
    times = {
        name: median_seconds(functools.partial(attention_pass, tensors, s, args.window), args.iters, device=device)
        for name, s in (("without sinks", None), ("with sinks", sinks))
    }
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} ms |")
    print(f"| the sinks' share | {times['with sinks'] / times['without sinks'] - 1:+.1%} |")


if __name__ == "__main__":
    main()
