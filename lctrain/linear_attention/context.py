"""The gated delta rule and its convolution over the ranks of a ring (context-parallel) group, exact.

A ring rank holds pieces of the sequence: one (``contiguous``: piece r of R) or two (``zigzag``: chunks r and
2R-1-r of 2R), the layout attention uses (``lctrain.attention.layout``), so zigzag's balance holds for attention
and the linear layers alike. Two exchanges per layer, both all-gathers over the group, each a size independent of
the sequence length:

1. the last ``K - 1`` pre-convolution tokens of every piece (``[pieces, B, K - 1, C]``): each piece takes its halo
   from the piece before it in global order;
2. every piece's summary ``[A | B]`` (``[pieces, B, Hv, dk, dk + dv]``, fp32, ``delta_rule.py``): every rank composes
   the chain in global order and runs its pieces from their true entering states, all ranks at once.

Gradients flow through both exchanges by autograd: the backward of the all-gather sums every rank's gradient of the
gathered tensor and keeps this rank's part (an all-reduce: gloo has no reduce-scatter), so the transposes of the
composition run in reverse order on every rank, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.transport import group_coordinates
from lctrain.linear_attention.conv import causal_conv
from lctrain.linear_attention.delta_rule import compose, finish_piece, piece_segments, summarize_piece


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, after):  # noqa: ANN001, ANN205 (autograd signature)
        ctx.group, ctx.after = group, after.shape
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None, grad.new_zeros(ctx.after)


class _Join(torch.autograd.Function):
    """``out`` itself; its backward also reaches ``used`` (with zeros), so that the collectives behind ``used`` run
    in every rank's backward, also where ``out`` does not depend on them (the first piece's zero state)."""

    @staticmethod
    def forward(ctx, out, used):  # noqa: ANN001, ANN205
        ctx.used = used.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, grad.new_zeros(ctx.used)


def gather(x: Tensor, group: dist.ProcessGroup | None, after: Tensor | None = None) -> Tensor:
    """Every rank's ``x`` stacked in rank order, ``[P, *x.shape]``, differentiable; a group of None is one rank.
    ``after``: an earlier gather's result, whose backward then comes after this one's on every rank (the backward's
    collectives meet in the same order everywhere)."""
    if group is None:
        return x[None]
    return _Gather.apply(x, group, x.new_zeros(()) if after is None else after)


def ring_pieces(rank: int, size: int, layout: str, length: int) -> list[tuple[int, int]]:
    """The global ``[start, stop)`` runs ring rank ``rank`` of ``size`` holds of a sequence of ``length`` tokens,
    in its local order."""
    if layout == "zigzag":
        chunk = length // (2 * size)
        return [(rank * chunk, (rank + 1) * chunk), ((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)]
    piece = length // size
    return [(rank * piece, (rank + 1) * piece)]


def delta_rule_context(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    conv_weight: Tensor,
    *,
    group: dist.ProcessGroup | None,
    layout: str,
    doc_starts: Sequence[int],
) -> Tensor:
    """A gated delta layer's convolution and recurrence on this ring rank's pieces.

    q, k ``[B, L, Hk, dk]``, v ``[B, L, Hv, dv]`` (before the convolution), g, beta ``[B, L, Hv]``: this rank's
    tokens in the layout's order; conv_weight ``[C, K]`` for the channels ``[q | k | v]`` flattened;
    ``doc_starts``: the global document starts (0 first) -> ``[B, L, Hv, dv]``.
    """
    rank, size = group_coordinates(group)
    batch, length = q.shape[:2]
    pieces = ring_pieces(rank, size, layout, length * size)
    halo_length = conv_weight.shape[1] - 1
    if pieces[0][1] - pieces[0][0] < halo_length:
        raise ValueError(
            f"each ring rank's pieces ({pieces[0][1] - pieces[0][0]} tokens) are shorter than the linear layers' "
            f"convolution halo (linear_conv_kernel_dim - 1 = {halo_length}): use a longer data.seq_len"
        )
    x = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)
    local = [sum(b - a for a, b in pieces[:i]) for i in range(len(pieces))]
    tails = torch.stack([x[:, at + b - a - halo_length : at + b - a] for (a, b), at in zip(pieces, local)])
    every = [ring_pieces(r, size, layout, length * size) for r in range(size)]
    before = {stop: (r, i) for r, runs in enumerate(every) for i, (_, stop) in enumerate(runs)}
    all_tails = gather(tails, group)
    starts = torch.tensor(list(doc_starts), device=x.device)
    mixed = []
    for (a, b), at in zip(pieces, local):
        halo = all_tails[before[a]] if a > 0 else x.new_zeros(batch, halo_length, x.shape[2])
        mixed.append(causal_conv(x[:, at : at + b - a], halo, conv_weight, a, starts))
    shapes = [t.shape for t in (q, k, v)]
    parts = torch.cat(mixed, dim=1).split([shape[2] * shape[3] for shape in shapes], dim=-1)
    q, k, v = (part.reshape(shape) for part, shape in zip(parts, shapes))
    segments = [piece_segments(a, b, at, doc_starts) for (a, b), at in zip(pieces, local)]
    runs = [summarize_piece(q, k, v, g, beta, s) for s in segments]
    summaries = gather(torch.stack([run.summary for run in runs]), group, after=all_tails)
    order = sorted((start, r, i) for r, runs_of in enumerate(every) for i, (start, _) in enumerate(runs_of))
    entering = dict(zip(((r, i) for _, r, i in order), compose([summaries[r, i] for _, r, i in order])))
    out = torch.cat(
        [finish_piece(q, k, v, g, beta, s, run, entering[rank, i]) for i, (s, run) in enumerate(zip(segments, runs))],
        dim=1,
    )
    return out if group is None else _Join.apply(out, summaries)
