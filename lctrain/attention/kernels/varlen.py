"""Document groups (varlen): block-diagonal runs of document rectangles in one call; their offsets and the
reference of the varlen kernels (one call per rectangle). The flash-style packing is in ``flash``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from lctrain.attention.kernels.base import AttentionKernel, Segments, accumulation_dtype


def segment_offsets(lengths: Sequence[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: where each segment starts (and the last one ends)."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return offsets


def _rectangles(segments: Segments) -> list[tuple[slice, slice]]:
    """The (query rows, key rows) slices of each document rectangle of a group."""
    rows, cols = segment_offsets(s[0] for s in segments), segment_offsets(s[1] for s in segments)
    return [(slice(rows[i], rows[i + 1]), slice(cols[i], cols[i + 1])) for i in range(len(segments))]


def looped_varlen(kernel: AttentionKernel) -> AttentionKernel:
    """``kernel`` with a varlen interface that calls it once per segment: the reference for the varlen kernels
    (and a way to test the grouping on CPU, where no kernel has a varlen mode)."""

    def varlen_forward(q, k, v, segments, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        outs, lses = [], []
        for r, c in _rectangles(segments):
            out, lse = kernel.forward(q[:, r], k[:, c], v[:, c], causal=causal, scale=scale, window_left=window_left)
            outs.append(out.to(accumulation_dtype(q.dtype)))
            lses.append(lse)
        return torch.cat(outs, dim=1), torch.cat(lses, dim=2)

    def varlen_backward(dout, q, k, v, out, lse, segments, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        options = dict(causal=causal, scale=scale, window_left=window_left)
        grads: list[list[Tensor]] = [[], [], []]
        for r, c in _rectangles(segments):
            block_grads = kernel.backward(dout[:, r], q[:, r], k[:, c], v[:, c], out[:, r], lse[:, :, r], **options)
            for acc, grad in zip(grads, block_grads):
                acc.append(grad.to(accumulation_dtype(q.dtype)))
        return tuple(torch.cat(g, dim=1) for g in grads)

    return replace(kernel, name=f"{kernel.name}_looped", varlen_forward=varlen_forward, varlen_backward=varlen_backward)
