"""PyTorch's own flash kernels on CUDA (flash-attn 2 compiled into torch): aten._flash_attention_forward/backward
take [B, S, H, D] (or packed [T, H, D] with cu_seqlens: varlen), GQA natively, a window (window_size_left/right),
and return the lse [B, H, S] (varlen: [H, T]) in fp32."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lctrain.attention.kernels.base import AttentionKernel, Segments
from lctrain.attention.kernels.flash_window import flash_window
from lctrain.attention.kernels.varlen import cu_seqlens, pack, pack_lse, unpack_lse, varlen_window


@functools.cache
def torch_flash_has_window() -> bool:
    """Whether this torch's ``aten._flash_attention_forward`` takes a window (it does since torch 2.5 or so)."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return "window_size_left" in {argument.name for argument in schema.arguments}


def _dropout_state(device: torch.device) -> tuple[Tensor, Tensor]:
    """The RNG state arguments of the backward ops; dropout is 0, so they are not read (as in PyTorch's own
    ``torch.nn.attention.varlen``)."""
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _torch_flash_call(
    q: Tensor, k: Tensor, v: Tensor, cu: tuple | None, *, causal: bool, scale: float, window: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    cu_q, cu_k, max_q, max_k = cu if cu is not None else (None, None, q.shape[-3], k.shape[-3])
    extra = {} if window == (-1, -1) else {"window_size_left": window[0], "window_size_right": window[1]}
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **extra
    )
    return out, lse


def _torch_flash_backward_call(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu: tuple | None,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    cu_q, cu_k, max_q, max_k = cu if cu is not None else (None, None, q.shape[-3], k.shape[-3])
    extra = {} if window == (-1, -1) else {"window_size_left": window[0], "window_size_right": window[1]}
    rng_state, unused = _dropout_state(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale, **extra
    )
    return dq, dk, dv


def _torch_cuda_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    window = flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    return _torch_flash_call(q, k, v, None, causal=causal, scale=scale, window=window)


def _torch_cuda_backward(
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
    window = flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    return _torch_flash_backward_call(
        dout, q, k, v, out.to(q.dtype), lse.float().contiguous(), None, causal=causal, scale=scale, window=window
    )


def _torch_cuda_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
) -> tuple[Tensor, Tensor]:
    batch = q.shape[0]
    window = varlen_window(segments, causal=causal, window_left=window_left)
    cu = cu_seqlens(segments, batch, q.device)
    out, lse = _torch_flash_call(pack(q), pack(k), pack(v), cu, causal=causal, scale=scale, window=window)
    return out.unflatten(0, (batch, -1)), unpack_lse(lse, batch)


def _torch_cuda_varlen_backward(
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
    batch = q.shape[0]
    window = varlen_window(segments, causal=causal, window_left=window_left)
    cu = cu_seqlens(segments, batch, q.device)
    grads = _torch_flash_backward_call(
        *(pack(t) for t in (dout, q, k, v, out.to(q.dtype))),
        pack_lse(lse),
        cu,
        causal=causal,
        scale=scale,
        window=window,
    )
    return tuple(g.unflatten(0, (batch, -1)) for g in grads)


TORCH_CUDA_FLASH = AttentionKernel(
    "torch_cuda_flash",
    _torch_cuda_forward,
    _torch_cuda_backward,
    varlen_forward=_torch_cuda_varlen_forward,
    varlen_backward=_torch_cuda_varlen_backward,
)
