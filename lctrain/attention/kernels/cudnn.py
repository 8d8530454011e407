"""PyTorch's cuDNN attention (cuDNN 9, Hopper's fastest in torch: docs/benchmarks.md). [B, H, S, D] views of our
[B, S, H, D] blocks, GQA natively, lse [B, H, S, 1] fp32; no window, and no varlen here (its ``abilities`` say
why)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import FUSED_CUDA, Platform
from lctrain.attention.kernels.base import AttentionKernel, bhsd

CUDNN_MAX_HEAD_DIM = 128  # cuDNN 9's fused attention forward + backward: head_dim <= 128, a multiple of 8


def _cudnn_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    if window_left is not None:
        raise ValueError("the cudnn kernel has no window: resolve_kernel gives banded blocks to another kernel")
    batch, q_len, heads, _ = q.shape
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *bhsd(q, k, v), None, True, 0.0, causal, False, scale=scale
    )
    return result[0].transpose(1, 2), result[1].reshape(batch, heads, q_len)


def _cudnn_backward(
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
    if window_left is not None:
        raise ValueError("the cudnn kernel has no window: resolve_kernel gives banded blocks to another kernel")
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: not read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *bhsd(dout, q, k, v, out.to(q.dtype)),
        lse.float().contiguous().unsqueeze(-1),  # [B, H, S, 1] fp32, as the forward returns it
        seed,
        offset,
        None,  # attn_bias: None, not an empty tensor
        None,  # cum_seq_q/k undefined: the dense path
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        scale=scale,
    )
    return bhsd(dq, dk, dv)


def _cudnn9(platform: Platform) -> str | None:
    if (platform.cudnn_version or 0) < 90000:
        return f"it needs cuDNN 9 (torch has {platform.cudnn_version})"
    return None


def _no_window(platform: Platform) -> str:
    return "PyTorch's cuDNN op takes no sliding window"


def _no_ragged_mode(platform: Platform) -> str:
    return "its ragged (varlen) mode is not used: torch's own varlen_attn keeps it off"


CUDNN = AttentionKernel(
    "cudnn",
    _cudnn_forward,
    _cudnn_backward,
    abilities=replace(
        FUSED_CUDA, max_head_dim=CUDNN_MAX_HEAD_DIM, available=_cudnn9, banded=_no_window, documents=_no_ragged_mode
    ),
)
