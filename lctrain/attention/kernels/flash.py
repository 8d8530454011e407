"""The flash-style back ends' shared part (PyTorch's own flash kernels, flash-attn 2, flash-attn 3): flash-attn's
window convention, the packed varlen layout, and ``flash_kernel``, which builds a kernel's dense and varlen
functions from the back end's two raw calls.

A back end supplies ``attend(q, k, v, options) -> (out, lse)`` and
``attend_backward(dout, q, k, v, out, lse, options) -> (dq, dk, dv)`` (``FlashOptions``). Dense blocks come as
``[B, S, H, D]`` with lse ``[B, H, S]``; document groups come packed, ``[B·S, H, D]``, with their lengths and lse
``[H, B·S]``. The backward gets ``dout`` contiguous, ``out`` in the inputs' dtype and lse fp32 contiguous, and
returns gradients in the inputs' layout.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import Abilities
from lctrain.attention.kernels.base import AttentionKernel, Segments
from lctrain.attention.kernels.varlen import segment_offsets

Lengths = tuple[Tensor, Tensor, int, int]  # cu_seqlens_q, cu_seqlens_k (int32), max_seqlen_q, max_seqlen_k


@dataclass(frozen=True)
class FlashOptions:
    """What a back end's raw call takes besides the tensors: the causal mask, the scale, flash-attn's bottom-right
    ``window=(left, right)`` (-1: no limit) and the packed lengths of document groups (None: dense blocks)."""

    causal: bool
    scale: float
    window: tuple[int, int]
    lengths: Lengths | None = None

    def length_arguments(self) -> dict:
        """flash-attn's keyword arguments for the packed lengths (none for dense blocks)."""
        if self.lengths is None:
            return {}
        return dict(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), self.lengths))


FlashForward = Callable[[Tensor, Tensor, Tensor, FlashOptions], tuple[Tensor, Tensor]]
FlashBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, FlashOptions], tuple[Tensor, Tensor, Tensor]]


def flash_window(q_len: int, k_len: int, *, causal: bool, window_left: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: query ``i`` sees keys ``i + k_len - q_len - left`` to
    ``i + k_len - q_len + right`` (bottom-right aligned; -1: no limit). Our band is top-left aligned, hence the
    shift (``>= 0``: the last query row sees a key); ``causal`` makes flash-attn's right edge 0 itself."""
    if window_left is None:
        return (-1, -1)
    return (window_left + k_len - q_len, 0 if causal else -1)


def varlen_window(segments: Segments, *, causal: bool, window_left: int | None) -> tuple[int, int]:
    """flash-attn's bottom-right ``window_size`` of a document group; ``group_documents`` only groups segments
    for which it is the same (causal squares, or plain rectangles)."""
    windows = {flash_window(q_len, k_len, causal=causal, window_left=window_left) for q_len, k_len in segments}
    if len(windows) != 1:
        raise ValueError(f"segments {segments} need different flash windows {windows}: group them separately")
    return windows.pop()


def parameter_names(fn: Callable) -> set[str]:
    """Parameter names of ``fn``, looking through ``torch.library.custom_op`` wrappers (whose own signature is
    ``(*args, **kwargs)``): flash-attn's private functions changed their argument names between versions."""
    return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def window_arguments(fn: Callable, left: int, right: int) -> dict:
    """``window_size_left=, window_size_right=`` or ``window_size=(left, right)``, as ``fn`` spells it."""
    if "window_size_left" in parameter_names(fn):
        return {"window_size_left": left, "window_size_right": right}
    return {"window_size": (left, right)}


@functools.lru_cache(maxsize=256)
def cu_seqlens(segments: Segments, batch: int, device: torch.device) -> Lengths:
    """int32 ``cu_seqlens_q``, ``cu_seqlens_k`` of ``batch`` rows of ``segments`` packed batch-major (row b's
    segments, then row b + 1's), on ``device``, and the longest query and key segment. The plan, and so the
    segments, repeat in every layer: the tensors are built (and copied to the device) once."""
    q_lens, k_lens = [s[0] for s in segments] * batch, [s[1] for s in segments] * batch
    cu_q = torch.tensor(segment_offsets(q_lens), dtype=torch.int32, device=device)
    cu_k = torch.tensor(segment_offsets(k_lens), dtype=torch.int32, device=device)
    return cu_q, cu_k, max(q_lens), max(k_lens)


def pack(t: Tensor) -> Tensor:
    """``[B, S, H, D]`` -> ``[B·S, H, D]`` (a view when the rows are contiguous, as for B = 1)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def unpack_lse(lse: Tensor, batch: int) -> Tensor:
    """A varlen kernel's lse ``[H, B·S]`` -> ``[B, H, S]``."""
    return lse.unflatten(1, (batch, -1)).transpose(0, 1)


def pack_lse(lse: Tensor) -> Tensor:
    """``[B, H, S]`` -> the varlen layout ``[H, B·S]``, fp32, contiguous."""
    return lse.float().transpose(0, 1).reshape(lse.shape[1], -1).contiguous()


def flash_kernel(
    name: str, attend: FlashForward, attend_backward: FlashBackward, abilities: Abilities
) -> AttentionKernel:
    """The ``AttentionKernel`` of a flash-style back end, dense and varlen, from its raw calls (module doc)."""

    def forward(q, k, v, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        window = flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
        return attend(q, k, v, FlashOptions(causal, scale, window))

    def backward(dout, q, k, v, out, lse, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        window = flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
        options = FlashOptions(causal, scale, window)
        return attend_backward(dout.contiguous(), q, k, v, out.to(q.dtype), lse.float().contiguous(), options)

    def options(q: Tensor, segments: Segments, causal: bool, scale: float, window_left: int | None) -> FlashOptions:
        window = varlen_window(segments, causal=causal, window_left=window_left)
        return FlashOptions(causal, scale, window, cu_seqlens(segments, q.shape[0], q.device))

    def varlen_forward(q, k, v, segments, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        out, lse = attend(pack(q), pack(k), pack(v), options(q, segments, causal, scale, window_left))
        return out.unflatten(0, (q.shape[0], -1)), unpack_lse(lse, q.shape[0])

    def varlen_backward(dout, q, k, v, out, lse, segments, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        packed = (pack(t).contiguous() for t in (dout, q, k, v, out.to(q.dtype)))
        grads = attend_backward(*packed, pack_lse(lse), options(q, segments, causal, scale, window_left))
        return tuple(g.unflatten(0, (q.shape[0], -1)) for g in grads)

    return AttentionKernel(
        name, forward, backward, varlen_forward=varlen_forward, varlen_backward=varlen_backward, abilities=abilities
    )
