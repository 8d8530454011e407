"""Reference: plain math, any device and dtype. Slow and obviously correct."""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.attention.kernels.bands import with_row_tiles
from lctrain.attention.kernels.base import (
    AttentionKernel,
    accumulation_dtype,
    check_window,
    default_scale,
    visible_keys,
)


def _scores(q: Tensor, k: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    """Scaled scores ``[B, Hq, Sq, Sk]`` in the accumulation dtype, K heads repeated for GQA, ``-inf`` where a
    query does not see a key (``visible``, bool ``[Sq, Sk]``; None: it sees all)."""
    compute = accumulation_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    qf = q.to(compute).transpose(1, 2)  # [B, Sq, Hq, D] -> [B, Hq, Sq, D]
    kf = k.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, Sk, D]
    scores = qf @ kf.transpose(-1, -2) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    """``exp(scores - lse)``; rows with ``lse = -inf`` (no visible key) give zeros, not NaN."""
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse.unsqueeze(-1))


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: float | None = None, window: int | None = None
) -> Tensor:
    """Differentiable math attention in the inputs' dtype: q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``.

    ``window``: query ``i`` sees only keys ``j`` with ``i - window < j <= i`` (needs ``causal``). The ground truth
    for tests (called on float64 inputs) and the obviously-correct twin of the fast kernels.
    """
    check_window(window, causal)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    groups = q.shape[2] // k.shape[2]
    window_left = None if window is None else window - 1
    visible = visible_keys(q.shape[1], k.shape[1], causal=causal, window_left=window_left, device=q.device)
    scores = _scores(q, k, visible, scale)
    probs = torch.softmax(scores, dim=-1)
    vf = v.to(scores.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, Sk, D]
    return (probs @ vf).transpose(1, 2).to(q.dtype)  # [B, Hq, Sq, D] -> [B, Sq, Hq, D]


def _math_forward(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    groups = q.shape[2] // k.shape[2]
    scores = _scores(q, k, visible, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Sq]
    vf = v.to(scores.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)
    out = (_probs(scores, lse) @ vf).transpose(1, 2)
    return out, lse


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    batch, sk, hkv, dim = k.shape
    groups = q.shape[2] // hkv
    scores = _scores(q, k, visible, scale)
    compute = scores.dtype
    probs = _probs(scores, lse.to(compute))  # [B, Hq, Sq, Sk]
    qf, doutf, outf = (t.to(compute).transpose(1, 2) for t in (q, dout, out))  # [B, Hq, Sq, D]
    kf, vf = (t.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))  # [B, Hq, Sk, D]
    dv = probs.transpose(-1, -2) @ doutf
    delta = (doutf * outf).sum(-1, keepdim=True)  # [B, Hq, Sq, 1]
    dscores = probs * (doutf @ vf.transpose(-1, -2) - delta)
    dq = dscores @ kf * scale
    dk = dscores.transpose(-1, -2) @ qf * scale

    def fold_groups(grad: Tensor) -> Tensor:  # [B, Hq, Sk, D] -> [B, Sk, Hkv, D], summed over each GQA group
        return grad.view(batch, hkv, groups, sk, dim).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), fold_groups(dk), fold_groups(dv)


def _reference_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    visible = visible_keys(q.shape[1], k.shape[1], causal=causal, window_left=None, device=q.device)
    return _math_forward(q, k, v, visible, scale)


def _reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    visible = visible_keys(q.shape[1], k.shape[1], causal=causal, window_left=None, device=q.device)
    return _math_backward(dout, q, k, v, out, lse, visible, scale)


# row tiles keep the scores of a wide banded block small
REFERENCE = with_row_tiles(
    AttentionKernel("reference", _reference_forward, _reference_backward), _math_forward, _math_backward
)
