"""Banded blocks for kernels without a window: row tiles, each against the keys its rows see, masked where the
band cuts the tile (``with_row_tiles``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import Tensor

from lctrain.attention.kernels.base import AttentionKernel, accumulation_dtype, visible_keys

# queries per tile, among the fastest on CPU (docs/benchmarks.md, "Banded blocks on the CPU kernel")
BAND_TILE_ROWS = 256


def band_tiles(q_len: int, k_len: int, *, causal: bool, window_left: int) -> list[tuple[slice, slice]]:
    """(rows, cols) of each row tile of a banded block: ``BAND_TILE_ROWS`` queries and the keys they see.

    Rows ``[a0, a1)`` see columns from ``a0 - window_left`` up to ``a1 - 1`` (causal) or the last one, so a tile
    costs ``tile × (tile + window)`` pairs however wide the block: the work stays proportional to the band.
    """
    tiles = []
    for a0 in range(0, q_len, BAND_TILE_ROWS):
        a1 = min(a0 + BAND_TILE_ROWS, q_len)
        tiles.append((slice(a0, a1), slice(max(0, a0 - window_left), min(k_len, a1) if causal else k_len)))
    return tiles


TileForward = Callable[[Tensor, Tensor, Tensor, Tensor | None, float], tuple[Tensor, Tensor]]
TileBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _masked_tiles(
    q: Tensor, k: Tensor, *, causal: bool, window_left: int
) -> Iterator[tuple[slice, slice, Tensor | None]]:
    """Each row tile's (rows, cols) of a banded block of ``q`` against ``k``, and which of its keys each row sees
    (``visible_keys`` at the tile's offsets)."""
    for rows, cols in band_tiles(q.shape[1], k.shape[1], causal=causal, window_left=window_left):
        visible = visible_keys(
            rows.stop - rows.start,
            cols.stop - cols.start,
            causal=causal,
            window_left=window_left,
            device=q.device,
            row_start=rows.start,
            col_start=cols.start,
        )
        yield rows, cols, visible


def with_row_tiles(kernel: AttentionKernel, attend: TileForward, attend_backward: TileBackward) -> AttentionKernel:
    """``kernel``, whose functions take no window, with banded blocks computed in row tiles by ``attend(q, k, v,
    visible, scale) -> (out, lse)`` and ``attend_backward(dout, q, k, v, out, lse, visible, scale)``. Tiles hold
    disjoint rows (no merge); dK/dV are summed over tiles in the accumulation dtype."""

    def forward(q, k, v, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        if window_left is None:
            return kernel.forward(q, k, v, causal=causal, scale=scale)
        outs, lses = [], []
        for rows, cols, visible in _masked_tiles(q, k, causal=causal, window_left=window_left):
            out, lse = attend(q[:, rows], k[:, cols], v[:, cols], visible, scale)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, dim=1), torch.cat(lses, dim=2)

    def backward(dout, q, k, v, out, lse, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
        if window_left is None:
            return kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        acc_dtype = accumulation_dtype(q.dtype)
        dq = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        for rows, cols, visible in _masked_tiles(q, k, causal=causal, window_left=window_left):
            dq_tile, dk_tile, dv_tile = attend_backward(
                dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows], visible, scale
            )
            dq[:, rows] = dq_tile
            dk[:, cols] += dk_tile
            dv[:, cols] += dv_tile
        return dq, dk, dv

    return replace(kernel, forward=forward, backward=backward)
