"""What the attention benchmarks share: random inputs and each rank's shards of them; lctrain's ring and PyTorch's
context-parallel ring (its module defaults), pass by pass, on the same zigzag shards ``[B, S/P, H, D]``; the ring's
traffic and work, read from its plan (``python -m benchmarks.rings``: counted for documents and windows)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks.report import arguments, table
from lctrain.attention import ring_attention, shard_sequence
from lctrain.attention.ring_blocks import plan_ring, visible_pairs

CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def random_inputs(
    seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, *, seed: int = 0, batch: int = 1
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Full-sequence q, k, v, dout ``[B, S, H, D]``, the same on every rank for a ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    heads_of = (heads, kv_heads, kv_heads, heads)
    q, k, v, dout = (torch.randn(batch, seq, h, head_dim, generator=generator).to(dtype) for h in heads_of)
    return q, k, v, dout


def rank_shards(full: tuple[Tensor, ...], layout: str = "zigzag") -> tuple[Tensor, ...]:
    """This rank's pieces of ``full`` (q, k, v, dout) over the default group, q, k, v leaves that require grad."""
    rank, size = dist.get_rank(), dist.get_world_size()
    pieces = [shard_sequence(t, dim=1, ring_rank=rank, ring_size=size, layout=layout).clone() for t in full]
    for piece in pieces[:3]:
        piece.requires_grad_(True)
    return tuple(pieces)


@dataclass(frozen=True)
class Traffic:
    """What one ring rank sends at each step of its plan (the forward's order), in rows: ``kv``, the rows of its own
    K/V piece another rank fetches (in the forward, and again in the backward but the last step's, whose K/V the
    forward kept); ``dkv``, the dK/dV of the rows it fetched, returned to their owner in the backward."""

    kv: tuple[int, ...]
    dkv: tuple[int, ...]

    def step_bytes(self, kv_row: int, dkv_row: int) -> tuple[list[int], list[int]]:
        """The bytes sent at each step of the forward and of the backward (its order: the last step first; while a step
        computes, the next step's K/V and the previous one's dK/dV), a K/V row (K and V) being ``kv_row`` bytes and a
        dK/dV row ``dkv_row``."""
        kv, dkv = self.kv[::-1], self.dkv[::-1]
        backward = [fetched * kv_row + returned * dkv_row for fetched, returned in zip((*kv[1:], 0), (0, *dkv[:-1]))]
        return [n * kv_row for n in self.kv], backward

    def bytes(self, kv_row: int, dkv_row: int) -> tuple[int, int]:
        """(forward, backward) bytes: the sums of ``step_bytes``."""
        forward, backward = self.step_bytes(kv_row, dkv_row)
        return sum(forward), sum(backward)


def ring_traffic(ranks: int, tokens: int, *, layout: str = "zigzag", **plan: Any) -> list[Traffic]:
    """Each ring rank's ``Traffic`` by its causal ``plan_ring`` (``plan``: ``cu_seqlens``, ``window``)."""
    traffic = []
    for rank in range(ranks):
        steps = plan_ring(rank, ranks, tokens, causal=True, layout=layout, **plan)
        kv = tuple(step.send.stop - step.send.start for step in steps)
        traffic.append(Traffic(kv, tuple(step.keys.stop - step.keys.start if step.source else 0 for step in steps)))
    return traffic


def busiest_steps(ranks: int, tokens: int, kv_row: int, dkv_row: int) -> dict[str, tuple[int, int]]:
    """Per pass, (the bytes the busiest step sends on one host, the sum over steps of each step's busiest host), from
    each rank's ``Traffic.step_bytes``."""
    per_rank = [t.step_bytes(kv_row, dkv_row) for t in ring_traffic(ranks, tokens)]
    busiest = [[max(step) for step in zip(*(sent[index] for sent in per_rank))] for index in (0, 1)]
    return {name: (max(steps), sum(steps)) for name, steps in zip(("forward", "backward"), busiest)}


@dataclass
class Passes:
    """``forward()``: the output ``[B, S/P, H, D]``; ``backward()``: dq, dk, dv of the last forward."""

    forward: Callable[[], Tensor]
    backward: Callable[[], tuple[Tensor, ...]]


def lctrain_ring(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, group: dist.ProcessGroup) -> Passes:
    """lctrain's ring on leaves ``q, k, v`` (they require grad)."""
    saved: dict[str, Tensor] = {}

    def forward() -> Tensor:
        saved["out"] = ring_attention(q, k, v, group, layout="zigzag")
        return saved["out"].detach()

    def backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(saved.pop("out"), (q, k, v), dout)

    return Passes(forward, backward)


def torch_ring(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, group: dist.ProcessGroup, *,
               forward_op: Callable = CPU_FORWARD, backward_op: Callable = CPU_BACKWARD) -> Passes:  # fmt: skip
    """PyTorch's ring, causal, on the same shards (moved to its ``[B, H, S/P, D]`` layout once, here)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    q, k, v, dout = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, dout))
    saved: dict[str, Tensor] = {}

    def forward() -> Tensor:
        out, lse = cp._templated_ring_attention(group, 2, forward_op, q, k, v, is_causal=True, dropout_p=0.0)
        saved["out"], saved["lse"] = out.to(q.dtype), lse  # the merged output comes back in the op's dtype
        return saved["out"].transpose(1, 2)

    def backward() -> tuple[Tensor, ...]:
        out, lse = saved.pop("out"), saved.pop("lse")
        grads = cp._templated_ring_attention_backward(
            group, 2, backward_op, dout, "grad_out", q, k, v, out, lse, True, dropout_p=0.0
        )
        return tuple(g.transpose(1, 2) for g in grads[:3])

    return Passes(forward, backward)


Row = tuple[list[int] | None, int | None]  # (document boundaries or None for one document, window or None)


def span(values: list[float], form: str = ",") -> str:
    low, high = min(values), max(values)
    return f"{low:{form}}" if low == high else f"{low:{form}} … {high:{form}}"


def row_kinds(seq: int, documents: list[int], cuts: int, windows: list[int]) -> dict[str, Row]:
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
    """What ring attention computes and sends for packed documents and for sliding windows, counted from the ring
    plan (no timing)."""
    cuts = (200, "random document boundaries in one row (0: none)")
    parser = arguments(main.__doc__, seq=1048576, ring=8, cuts=cuts, kv_dim=(1024, "KV heads × head_dim per ring rank"))
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
        for name, (bounds, window) in row_kinds(args.seq, args.documents, args.cuts, args.windows).items():
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
