"""Document groups (varlen): block-diagonal runs of document rectangles in one call."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from lctrain.attention.kernels.base import AttentionKernel, Segments, accumulation_dtype
from lctrain.attention.kernels.flash_window import flash_window


def segment_offsets(lengths: Sequence[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: where each segment starts (and the last one ends)."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return offsets


def looped_varlen(kernel: AttentionKernel) -> AttentionKernel:
    """``kernel`` with a varlen interface that calls it once per segment: the reference for the varlen kernels
    (and a way to test the grouping on CPU, where no kernel has a varlen mode)."""

    def varlen_forward(
        q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
    ) -> tuple[Tensor, Tensor]:
        rows, cols = segment_offsets(s[0] for s in segments), segment_offsets(s[1] for s in segments)
        outs, lses = [], []
        for i in range(len(segments)):
            out, lse = kernel.forward(
                q[:, rows[i] : rows[i + 1]],
                k[:, cols[i] : cols[i + 1]],
                v[:, cols[i] : cols[i + 1]],
                causal=causal,
                scale=scale,
                window_left=window_left,
            )
            outs.append(out.to(accumulation_dtype(q.dtype)))
            lses.append(lse)
        return torch.cat(outs, dim=1), torch.cat(lses, dim=2)

    def varlen_backward(
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
        rows, cols = segment_offsets(s[0] for s in segments), segment_offsets(s[1] for s in segments)
        grads: list[list[Tensor]] = [[], [], []]
        for i in range(len(segments)):
            r, c = slice(rows[i], rows[i + 1]), slice(cols[i], cols[i + 1])
            block_grads = kernel.backward(
                dout[:, r],
                q[:, r],
                k[:, c],
                v[:, c],
                out[:, r],
                lse[:, :, r],
                causal=causal,
                scale=scale,
                window_left=window_left,
            )
            for acc, grad in zip(grads, block_grads):
                acc.append(grad.to(accumulation_dtype(q.dtype)))
        return tuple(torch.cat(g, dim=1) for g in grads)

    return replace(kernel, name=f"{kernel.name}_looped", varlen_forward=varlen_forward, varlen_backward=varlen_backward)


@functools.lru_cache(maxsize=256)
def cu_seqlens(segments: Segments, batch: int, device: torch.device) -> tuple[Tensor, Tensor, int, int]:
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


def varlen_window(segments: Segments, *, causal: bool, window_left: int | None) -> tuple[int, int]:
    """flash-attn's bottom-right ``window_size`` of a document group; ``group_documents`` only groups segments
    for which it is the same (causal squares, or plain rectangles)."""
    windows = {flash_window(q_len, k_len, causal=causal, window_left=window_left) for q_len, k_len in segments}
    if len(windows) != 1:
        raise ValueError(f"segments {segments} need different flash windows {windows}: group them separately")
    return windows.pop()


def unpack_lse(lse: Tensor, batch: int) -> Tensor:
    """A varlen kernel's lse ``[H, B·S]`` -> ``[B, H, S]``."""
    return lse.unflatten(1, (batch, -1)).transpose(0, 1)


def pack_lse(lse: Tensor) -> Tensor:
    """``[B, H, S]`` -> the varlen layout ``[H, B·S]``, fp32, contiguous."""
    return lse.float().transpose(0, 1).reshape(lse.shape[1], -1).contiguous()
