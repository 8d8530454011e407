"""The linear layers' short causal convolution on pieces of a sequence, blind to other documents.

Qwen3-Next's and Qwen3.5's gated delta layers run a depthwise causal convolution of ``K`` taps
(``linear_conv_kernel_dim``) over their mixed q/k/v channels before the recurrence: token ``p`` reads tokens
``p - K + 1 .. p``. A piece therefore needs the ``K - 1`` tokens before it (its halo, from the piece before it in
global order, zeros before the first), and a token reads none of another document: each earlier tap is kept only
where ``p - d`` lies in ``p``'s document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def document_starts_of(positions: Tensor, doc_starts: Tensor) -> Tensor:
    """The start of each global position's document: ``positions`` ``[L]``, ``doc_starts`` sorted ``[N]`` (0
    first) -> ``[L]``."""
    return doc_starts[torch.searchsorted(doc_starts, positions, right=True) - 1]


def causal_conv(x: Tensor, halo: Tensor, weight: Tensor, start: int, doc_starts: Tensor) -> Tensor:
    """SiLU of the depthwise causal convolution of one piece: x ``[B, L, C]`` (global tokens ``start .. start + L``),
    halo ``[B, K - 1, C]`` (the ``K - 1`` tokens before it), weight ``[C, K]`` (transformers' ``conv1d.weight``
    squeezed: tap ``K - 1`` reads the token itself) -> ``[B, L, C]`` in x's dtype. ``doc_starts``: the global
    document starts (int, sorted, 0 first)."""
    taps, length = weight.shape[1], x.shape[1]
    extended = torch.cat([halo.to(x.dtype), x], dim=1)
    positions = torch.arange(start, start + length, device=x.device)
    first = document_starts_of(positions, doc_starts.to(x.device))
    out = x * weight[:, taps - 1]
    for back in range(1, taps):
        keep = (positions - back >= first).to(x.dtype)[None, :, None]
        out = out + extended[:, taps - 1 - back : taps - 1 - back + length] * weight[:, taps - 1 - back] * keep
    return F.silu(out).to(x.dtype)
