"""flash-attn 3 (Hopper; module flash_attn_interface, built from flash-attention's hopper/ directory). Public
flash_attn_func / flash_attn_varlen_func with return_attn_probs=True give (out, lse); the backward from the
final (out, lse) is the private _flash_attn_backward, called by keyword (its names moved between versions).

flash_attn_interface is imported inside the functions, when a kernel runs: importing this module needs none."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lctrain.attention.kernels.base import AttentionKernel, Segments
from lctrain.attention.kernels.flash_window import flash_window, parameter_names, window_arguments
from lctrain.attention.kernels.varlen import cu_seqlens, pack, pack_lse, unpack_lse, varlen_window


def _fa3_outputs(result: object) -> tuple[Tensor, Tensor]:
    if not isinstance(result, tuple) or len(result) < 2:
        raise RuntimeError("flash_attn_interface returned no log-sum-exp: this flash-attn 3 version is unsupported")
    return result[0], result[1]


def _fa3_call(fn: Callable, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
    if "return_attn_probs" in parameter_names(fn):  # later versions return (out, lse) only when asked
        kwargs["return_attn_probs"] = True
    return _fa3_outputs(fn(*args, **kwargs))


def _fa3_backward_call(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int],
    varlen: dict,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn_interface import _flash_attn_backward as backward

    names = parameter_names(backward)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    arguments = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, softmax_scale=scale)
    arguments["is_causal" if "is_causal" in names else "causal"] = causal
    arguments.update(window_arguments(backward, *window), **varlen)
    missing = set(arguments) - names
    if missing:
        raise RuntimeError(f"flash_attn_interface._flash_attn_backward takes no {sorted(missing)}: unsupported version")
    backward(**arguments)
    return dq, dk, dv


def _fa3_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    from flash_attn_interface import flash_attn_func

    window = flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    return _fa3_call(flash_attn_func, q, k, v, softmax_scale=scale, causal=causal, window_size=window)


def _fa3_backward(
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
    return _fa3_backward_call(
        dout.contiguous(),
        q,
        k,
        v,
        out.to(q.dtype),
        lse.float().contiguous(),
        causal=causal,
        scale=scale,
        window=window,
        varlen={},
    )


def _fa3_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
) -> tuple[Tensor, Tensor]:
    from flash_attn_interface import flash_attn_varlen_func

    batch = q.shape[0]
    cu_q, cu_k, max_q, max_k = cu_seqlens(segments, batch, q.device)
    window = varlen_window(segments, causal=causal, window_left=window_left)
    out, lse = _fa3_call(
        flash_attn_varlen_func,
        pack(q),
        pack(k),
        pack(v),
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=scale,
        causal=causal,
        window_size=window,
    )
    return out.unflatten(0, (batch, -1)), unpack_lse(lse, batch)


def _fa3_varlen_backward(
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
    cu_q, cu_k, max_q, max_k = cu_seqlens(segments, batch, q.device)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    grads = _fa3_backward_call(
        *(pack(t).contiguous() for t in (dout, q, k, v, out.to(q.dtype))),
        pack_lse(lse),
        causal=causal,
        scale=scale,
        window=varlen_window(segments, causal=causal, window_left=window_left),
        varlen=varlen,
    )
    return tuple(g.unflatten(0, (batch, -1)) for g in grads)


FLASH_ATTN3 = AttentionKernel(
    "flash_attn3",
    _fa3_forward,
    _fa3_backward,
    varlen_forward=_fa3_varlen_forward,
    varlen_backward=_fa3_varlen_backward,
)
