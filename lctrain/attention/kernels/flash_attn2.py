"""flash-attn 2 (optional extra `cuda`, package flash_attn): [B, S, H, D] natively, GQA natively, lse fp32.

flash_attn is imported inside the functions, when a kernel runs: importing this module needs no flash-attn."""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.attention.kernels.base import AttentionKernel, Segments
from lctrain.attention.kernels.flash_window import flash_window, window_arguments
from lctrain.attention.kernels.varlen import cu_seqlens, pack, pack_lse, unpack_lse, varlen_window

FLASH_ATTN_VARLEN_MIN = (2, 6)  # the varlen lse is [H, total_q] (unpadded) from flash-attn 2.6 on


def _flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_func

    window_size = flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    out, lse, _ = flash_attn_func(q, k, v, 0.0, scale, causal, window_size=window_size, return_attn_probs=True)
    return out, lse


def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    window_left: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_backward as backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    left, right = flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    backward(
        dout=dout.contiguous(),
        q=q,
        k=k,
        v=v,
        out=out.to(q.dtype),
        softmax_lse=lse.float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **window_arguments(backward, left, right),
    )
    return dq, dk, dv


def _flash_attn_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_varlen_func

    batch = q.shape[0]
    cu_q, cu_k, max_q, max_k = cu_seqlens(segments, batch, q.device)
    out, lse, _ = flash_attn_varlen_func(
        pack(q),
        pack(k),
        pack(v),
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        scale,
        causal,
        window_size=varlen_window(segments, causal=causal, window_left=window_left),
        return_attn_probs=True,
    )
    return out.unflatten(0, (batch, -1)), unpack_lse(lse, batch)


def _flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    segments: Segments,
    *,
    causal: bool,
    scale: float,
    window_left=None,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward as backward

    batch = q.shape[0]
    cu_q, cu_k, max_q, max_k = cu_seqlens(segments, batch, q.device)
    q, k, v = (pack(t).contiguous() for t in (q, k, v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(
        dout=pack(dout).contiguous(),
        q=q,
        k=k,
        v=v,
        out=pack(out.to(q.dtype)).contiguous(),
        softmax_lse=pack_lse(lse),
        dq=dq,
        dk=dk,
        dv=dv,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **window_arguments(backward, *varlen_window(segments, causal=causal, window_left=window_left)),
    )
    return tuple(g.unflatten(0, (batch, -1)) for g in (dq, dk, dv))


FLASH_ATTN = AttentionKernel(
    "flash_attn",
    _flash_attn_forward,
    _flash_attn_backward,
    varlen_forward=_flash_attn_varlen_forward,
    varlen_backward=_flash_attn_varlen_backward,
)
