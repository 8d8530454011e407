"""The online-softmax merge of partial attention results, accumulated in fp32 (fp64 for fp64 inputs)."""

from __future__ import annotations

import torch
from torch import Tensor


def merge_block(out_acc: Tensor, lse_acc: Tensor, out_block: Tensor, lse_block: Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the running accumulators, in place.

    out_acc ``[B, S, H, D]`` and lse_acc ``[B, H, S]`` are the accumulators (views of them are fine: a block may
    cover only some rows); out_block has out_acc's shape in any dtype, lse_block lse_acc's shape. A row with
    ``lse = -inf`` has seen no key and contributes nothing; two such rows stay ``-inf`` without producing NaN.
    """
    lse_new = torch.logaddexp(lse_acc, lse_block)
    finite_new = torch.where(torch.isinf(lse_new), torch.zeros_like(lse_new), lse_new)
    weight_acc = torch.exp(lse_acc - finite_new).transpose(1, 2).unsqueeze(-1)  # [B, H, S] -> [B, S, H, 1]
    weight_block = torch.exp(lse_block - finite_new).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(weight_acc).add_(out_block.to(out_acc.dtype) * weight_block)
    lse_acc.copy_(lse_new)


def fold_sink(out: Tensor, lse: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """Attention with a learned sink per head (gpt-oss) from attention without it: the sink is one more logit in
    every query's softmax denominator, with no value behind it, so it scales each row's output by
    ``exp(lse) / (exp(lse) + exp(sink))`` and adds itself to the log-sum-exp.

    out ``[B, S, H, D]`` and lse ``[B, H, S]`` are the merged results of every block (in the accumulation dtype);
    sink ``[H]`` (not scaled by the softmax scale). Returns ``(out', lse')``, lse' = logaddexp(lse, sink): the
    final results a block's backward takes, which make it exact for the sink's softmax too (the sink column's
    value is zero, so rowsum(dout * out') is the softmax's correction term as it is). A row with ``lse = -inf``
    keeps a zero output.
    """
    sink = sink.to(lse.dtype).view(1, -1, 1)
    lse_new = torch.logaddexp(lse, sink)
    kept = torch.exp(lse - lse_new).transpose(1, 2).unsqueeze(-1)  # [B, H, S] -> [B, S, H, 1]
    return out * kept, lse_new


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """The gradient of the sink ``[H]`` over this rank's queries, from ``fold_sink``'s ``(out', lse')`` and
    ``dout`` ``[B, S, H, D]``: ``-sum_{b,s} p_sink[b, h, s] · rowsum(dout · out')[b, s, h]``, p_sink =
    ``exp(sink - lse')``. A partial sum: the ranks holding the other queries (and heads) add theirs."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, S]
    p_sink = torch.exp(sink.to(acc).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2))
