"""The gated delta rule and its convolution over the ranks of a ring (context-parallel) group, exact.

A ring rank holds pieces of the sequence: one (``contiguous``: piece r of R) or two (``zigzag``: chunks r and
2R-1-r of 2R), the layout attention uses (``lctrain.attention.layout``), so zigzag's balance holds for attention
and the linear layers alike. Two exchanges per layer, both all-gathers over the group, neither growing with the
sequence length (``plan.py`` says what each rank sends):

1. the pre-convolution tokens other ranks read (``[B, M, C]`` a rank): the ``K - 1`` before each piece, and those a
   document continuing a prefix across a jump reads at its start (``conv.py``);
2. the affine maps that define the composition's nodes (``[slots, B, Hv, dk, dk + dv]``, fp32, ``delta_rule.py``):
   each piece's leaving state, and the state leaving a prefix jumped back to from another piece. Every rank composes
   them in global order and runs its pieces from their true entering states, all ranks at once.

Gradients flow through both exchanges by autograd: the backward of the all-gather sums every rank's gradient of the
gathered tensor and keeps this rank's part (an all-reduce: gloo has no reduce-scatter), so the transposes of the
composition run in reverse order on every rank, exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.transport import group_coordinates
from lctrain.linear_attention.conv import causal_conv_pieces
from lctrain.linear_attention.delta_rule import delta_rule_pieces
from lctrain.linear_attention.plan import Documents, row_plan


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


def ring_pieces(rank: int, size: int, layout: str, length: int) -> tuple[tuple[int, int], ...]:
    """The global ``[start, stop)`` runs ring rank ``rank`` of ``size`` holds of a sequence of ``length`` tokens,
    in its local order."""
    if layout == "zigzag":
        chunk = length // (2 * size)
        return ((rank * chunk, (rank + 1) * chunk), ((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk))
    piece = length // size
    return ((rank * piece, (rank + 1) * piece),)


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
    documents: Documents,
) -> Tensor:
    """A gated delta layer's convolution and recurrence on this ring rank's pieces.

    q, k ``[B, L, Hk, dk]``, v ``[B, L, Hv, dv]`` (before the convolution), g, beta ``[B, L, Hv]``: this rank's
    tokens in the layout's order; conv_weight ``[C, K]`` for the channels ``[q | k | v]`` flattened;
    ``documents``: the global row's documents and their prefixes -> ``[B, L, Hv, dv]``.
    """
    rank, size = group_coordinates(group)
    every = tuple(ring_pieces(r, size, layout, q.shape[1] * size) for r in range(size))
    plan = row_plan(documents, every, rank, conv_weight.shape[1], q.device)
    x = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)
    mixed, tokens = causal_conv_pieces(x, conv_weight, plan, lambda t: gather(t, group))
    shapes = [t.shape for t in (q, k, v)]
    parts = mixed.split([shape[2] * shape[3] for shape in shapes], dim=-1)
    q, k, v = (part.reshape(shape) for part, shape in zip(parts, shapes))
    out, maps = delta_rule_pieces(q, k, v, g, beta, plan, lambda t: gather(t, group, after=tokens))
    return out if group is None else _Join.apply(out, maps)
