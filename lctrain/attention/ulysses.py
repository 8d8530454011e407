"""DeepSpeed-Ulysses: all-to-all between sequence-sharded and head-sharded layouts, and attention run on the
head-sharded one (``attend_head_sharded``, inside ``usp_attention``).

Ulysses rank u of a group of size U holds sequence part u of its ring piece for all heads; after
``seq_to_heads`` it holds the whole piece for head group u (heads ``[u·H/U, (u+1)·H/U)``). Both directions are
differentiable: the backward of one is the other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def _all_to_all(send: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Part j of ``send``'s dim 0 goes to rank j; part j of the result came from rank j."""
    received = torch.empty_like(send, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, send.contiguous(), group=group)
    return received


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    batch, seq, heads, dim = x.shape
    send = x.reshape(batch, seq, size, heads // size, dim).permute(2, 0, 1, 3, 4)  # [U, B, S/U, H/U, D]
    received = _all_to_all(send, group)  # [U (sequence part), B, S/U, H/U, D]
    return received.permute(1, 0, 2, 3, 4).reshape(batch, size * seq, heads // size, dim)  # [B, S, H/U, D]


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    batch, seq, heads, dim = x.shape
    send = x.reshape(batch, size, seq // size, heads, dim).permute(1, 0, 2, 3, 4)  # [U, B, S/U, H/U, D]
    received = _all_to_all(send, group)  # [U (head group), B, S/U, H/U, D]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, seq // size, size * heads, dim)  # [B, S/U, H, D]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205 (autograd signature)
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001, ANN205
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return _seq_to_heads(grad, ctx.group), None


def seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, S/U, H, D]`` (sequence part u, all heads) -> ``[B, S, H/U, D]`` (whole sequence, head group u)."""
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, S, H/U, D]`` (whole sequence, head group u) -> ``[B, S/U, H, D]`` (sequence part u, all heads)."""
    return _HeadsToSeq.apply(x, group)


def own_heads(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The part of a per-head tensor ``[H, ...]`` (the sinks) for this rank's head group after ``seq_to_heads``:
    heads ``[u·H/U, (u+1)·H/U)``; differentiable (its gradient is zero on the other heads, which the other ranks of
    the group fill)."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return x
    return x.chunk(size)[dist.get_rank(group)]


def attend_head_sharded(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, attend: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """Run ``attend`` on the head-sharded layout: sequence -> heads all-to-all, ``attend``, heads -> sequence.

    q ``[B, S/U, Hq, D]``, k/v ``[B, S/U, Hkv, D]``; ``attend`` sees ``[B, S, Hq/U, D]`` and
    ``[B, S, max(Hkv/U, 1), D]``. KV heads are replicated ``U / Hkv`` times when ``U > Hkv``, never expanded to Hq.
    The heads have been checked against the group (``checks.check_attention_inputs``).
    """
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return attend(q, k, v)
    if k.shape[2] < size:  # rank u needs KV head u // (U / Hkv)
        k = k.repeat_interleave(size // k.shape[2], dim=2)
        v = v.repeat_interleave(size // v.shape[2], dim=2)
    out = attend(seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group))
    return heads_to_seq(out, group)
