"""The kernels' shared type and helpers: ``AttentionKernel`` (the interface every kernel implements), the
accumulation dtype, the default scale, the window check, the keys each query of a block sees, and the
``[B, S, H, D]`` <-> ``[B, H, S, D]`` view."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import Abilities

KernelForward = Callable[..., tuple[Tensor, Tensor]]
KernelBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]
Segments = tuple[tuple[int, int], ...]  # (query rows, key rows) of each document rectangle of a group


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype


def _no_note(dtype: torch.dtype) -> None:
    return None


@dataclass(frozen=True)
class AttentionKernel:
    """A blockwise attention kernel that returns the log-sum-exp: a name, its functions, and what it can do.

    ``forward(q, k, v, *, causal, scale, window_left=None) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, *, causal, scale, window_left=None) -> (dq, dk, dv)`` work on one (query
    block, key block) pair. q, out, dout, dq ``[B, Sq, Hq, D]``; k, v, dk, dv ``[B, Sk, Hkv, D]`` with
    ``Hq % Hkv == 0`` (GQA inside the kernel: K and V are never repeated by the caller); lse ``[B, Hq, Sq]`` in the
    accumulation dtype. ``out`` and the gradients come back in the input dtype or the accumulation dtype (callers
    accumulate in the latter and cast once). ``causal`` is top-left aligned and used on square (diagonal) blocks
    only. ``window_left`` is a sliding window's band, top-left aligned as well: query row ``a`` sees key columns
    ``b >= a - window_left`` (None: no such limit); every query row of a banded block sees at least one key (the
    ring plan clips blocks to the rows and columns the window reaches). ``backward`` takes the *final* ``out`` and
    ``lse`` of the whole row (after merging all key blocks), which makes each block's gradient exact on its own.

    ``varlen_forward(q, k, v, segments, ...)`` and ``varlen_backward(dout, q, k, v, out, lse, segments, ...)``
    (None: no varlen mode) take document groups: ``segments`` are the (query rows, key rows) of document
    rectangles laid end to end (block-diagonal), each computed as its own block with the same ``causal`` and
    ``window_left``, all in one call (``ring_blocks.group_documents`` builds such groups).

    ``backward_dtype(input dtype)`` is the dtype ``backward`` computes in (callers that keep tensors for the
    backward may keep them in it to save the kernel a conversion); ``abilities`` says which cases it can do;
    ``dtype_note(input dtype)`` says, for the job's kernel line, how blocks of that dtype are computed when not in
    their own dtype (None: nothing to say).
    """

    name: str
    forward: KernelForward
    backward: KernelBackward
    backward_dtype: Callable[[torch.dtype], torch.dtype] = _same_dtype
    varlen_forward: Callable[..., tuple[Tensor, Tensor]] | None = None
    varlen_backward: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
    abilities: Abilities = Abilities()
    dtype_note: Callable[[torch.dtype], str | None] = _no_note


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that ``out`` and ``lse`` are accumulated in across blocks: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def check_window(window: int | None, causal: bool) -> None:
    """A sliding window is a positive number of keys (the query's own included) and needs a causal mask."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window={window!r} must be a positive int, the number of keys each query sees (itself included), as "
            f"Hugging Face's sliding_window; use window=None for attention without a window"
        )
    if not causal:
        raise ValueError(
            f"window={window} needs causal=True: a sliding window is defined for causal attention only (query i "
            f"sees keys j with i - window < j <= i); drop the window or make the attention causal"
        )


def visible_keys(
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    window_left: int | None,
    device: torch.device,
    row_start: int = 0,
    col_start: int = 0,
) -> Tensor | None:
    """Which keys each query of a block sees, bool ``[q_len, k_len]``, or None when every query sees every key.

    Rows ``row_start + a`` and columns ``col_start + b`` of a block masked by ``causal`` and ``window_left``
    (top-left aligned, as in ``AttentionKernel``): a tile of a block passes its offsets into the block.
    """
    last_row, last_col = row_start + q_len - 1, col_start + k_len - 1
    causal_cuts = causal and last_col > row_start
    window_cuts = window_left is not None and last_row - window_left > col_start
    if not (causal_cuts or window_cuts):
        return None
    rows = torch.arange(row_start, last_row + 1, device=device)[:, None]
    cols = torch.arange(col_start, last_col + 1, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal_cuts:
        visible &= cols <= rows
    if window_cuts:
        visible &= cols >= rows - window_left
    return visible


def bhsd(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Views of ``[B, S, H, D]`` tensors as ``[B, H, S, D]`` (and back): the layout of PyTorch's SDPA ops."""
    return tuple(t.transpose(1, 2) for t in tensors)  # [B, S, H, D] <-> [B, H, S, D]
