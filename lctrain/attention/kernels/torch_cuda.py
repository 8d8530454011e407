"""PyTorch's own flash kernels on CUDA (flash-attn 2 compiled into torch): aten._flash_attention_forward/backward
take [B, S, H, D] (or packed [T, H, D] with cu_seqlens: varlen), GQA natively, a window (window_size_left/right),
and return the lse [B, H, S] (varlen: [H, T]) in fp32."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import FUSED_CUDA, Platform
from lctrain.attention.kernels.flash import FlashOptions, flash_kernel


@functools.cache
def torch_flash_has_window() -> bool:
    """Whether this torch's ``aten._flash_attention_forward`` takes a window (it does since torch 2.5 or so)."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return "window_size_left" in {argument.name for argument in schema.arguments}


def _op_arguments(q: Tensor, k: Tensor, options: FlashOptions) -> tuple[tuple, dict]:
    """The ops' (cu_seq_q, cu_seq_k, max_q, max_k) and their window keywords (none without a window)."""
    lengths = options.lengths if options.lengths is not None else (None, None, q.shape[-3], k.shape[-3])
    left, right = options.window
    window = {} if options.window == (-1, -1) else {"window_size_left": left, "window_size_right": right}
    return lengths, window


def _attend(q: Tensor, k: Tensor, v: Tensor, options: FlashOptions) -> tuple[Tensor, Tensor]:
    lengths, window = _op_arguments(q, k, options)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, *lengths, 0.0, options.causal, False, scale=options.scale, **window
    )
    return out, lse


def _attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, options: FlashOptions
) -> tuple[Tensor, Tensor, Tensor]:
    lengths, window = _op_arguments(q, k, options)
    # the RNG state arguments: dropout is 0, so they are not read (as in PyTorch's own torch.nn.attention.varlen)
    rng_state, unused = torch.zeros((2,), dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, *lengths, 0.0, options.causal, rng_state, unused, scale=options.scale, **window
    )
    return dq, dk, dv


def _window(platform: Platform) -> str | None:
    return None if platform.torch_flash_window else "this torch's aten._flash_attention_forward takes no window"


TORCH_CUDA_FLASH = flash_kernel(
    "torch_cuda_flash", _attend, _attend_backward, replace(FUSED_CUDA, banded=_window, documents=_window)
)
