"""The linear layers' short causal convolution on pieces of a sequence, blind to other documents.

Qwen3-Next's and Qwen3.5's gated delta layers run a depthwise causal convolution of ``K`` taps
(``linear_conv_kernel_dim``) over their mixed q/k/v channels before the recurrence: token ``p`` reads tokens
``p - K + 1 .. p`` of its sequence. A piece therefore needs the ``K - 1`` tokens before it (its halo, from the ranks
holding them; zeros before the first), and a token reads none of another document: an earlier tap is kept only
where it reads the token's own document, or, for a document that continues a prefix, the prefix's last tokens
(``plan.py``): in the row's order where the document directly follows its prefix, and across the jump (the
``extra`` reads, fetched like the halos) where it does not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lctrain.linear_attention.plan import ConvPlan, RowPlan


def bank_rows(x: Tensor, remote: Tensor, index: Tensor) -> Tensor:
    """Rows of the bank ``[x | remote | zero]``: x ``[B, L, C]``, remote ``[B, N, C]``, index (any shape) ->
    ``[B, *index.shape, C]``."""
    length, count, flat = x.shape[1], remote.shape[1], index.reshape(-1)
    local = x[:, flat.clamp(max=length - 1)]
    far = remote[:, (flat - length).clamp(0, max(count - 1, 0))]
    rows = torch.where(
        (flat < length)[None, :, None], local, torch.where((flat < length + count)[None, :, None], far, 0)
    )
    return rows.reshape(x.shape[0], *index.shape, x.shape[2])


def sent_tokens(x: Tensor, plan: ConvPlan) -> Tensor:
    """The local tokens other ranks read: x ``[B, L, C]`` -> ``[B, M, C]`` (padding rows zero)."""
    return torch.where((plan.send >= 0)[None, :, None], x[:, plan.send.clamp(min=0)], 0)


def causal_conv_pieces(
    x: Tensor, weight: Tensor, plan: RowPlan, gather: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor]:
    """SiLU of the depthwise causal convolution of this rank's pieces of ``plan``: x ``[B, L, C]`` in local order,
    weight ``[C, K]`` (transformers' ``conv1d.weight`` squeezed: tap ``K - 1`` reads the token itself) ->
    (``[B, L, C]`` in x's dtype, the gathered tokens ``[P, B, M, C]``). ``gather`` stacks every rank's
    ``sent_tokens`` in rank order (``lambda t: t[None]`` on one rank holding every piece)."""
    conv, taps = plan.conv, weight.shape[1]
    tokens = gather(sent_tokens(x, conv))
    remote = tokens.transpose(0, 1).reshape(x.shape[0], -1, x.shape[2])
    halos = bank_rows(x, remote, conv.halo).to(x.dtype)  # [B, pieces, K - 1, C]
    outs = []
    for i, piece in enumerate(plan.pieces):
        at, length = piece.at, piece.stop - piece.start
        extended = torch.cat([halos[:, i], x[:, at : at + length]], dim=1)
        out = x[:, at : at + length] * weight[:, taps - 1]
        for back in range(1, taps):
            keep = conv.keep[back - 1, at : at + length].to(x.dtype)[None, :, None]
            out = out + extended[:, taps - 1 - back : taps - 1 - back + length] * weight[:, taps - 1 - back] * keep
        outs.append(out)
    out = torch.cat(outs, dim=1)
    if conv.extra_at.numel():
        reads = bank_rows(x, remote, conv.extra_from) * weight.t()[conv.extra_tap]
        out = out.index_add(1, conv.extra_at, reads.to(out.dtype))
    return F.silu(out).to(x.dtype), tokens
