"""How a global sequence is split over (ring, ulysses) ranks.

With ring size R and Ulysses size U, ``zigzag`` cuts the sequence into 2R chunks and gives ring rank r
``cat(chunk[r], chunk[2R-1-r])``, so every ring rank does the same causal work; ``contiguous`` gives ring rank r
chunk r of R. Each ring rank's piece is then cut into U contiguous parts, one per Ulysses rank. For S = 16,
R = 2, U = 2 (zigzag), tokens 0..15 land as:

    ring 0: chunks 0, 3 -> [0 1 2 3 | 12 13 14 15] -> ulysses 0: [0 1 2 3], ulysses 1: [12 13 14 15]
    ring 1: chunks 1, 2 -> [4 5 6 7 |  8  9 10 11] -> ulysses 0: [4 5 6 7], ulysses 1: [ 8  9 10 11]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lctrain.rules import check_layout, check_sequence_length


def _check_sizes(ring_rank: int, ring_size: int, ulysses_rank: int, ulysses_size: int) -> None:
    if ring_size < 1 or ulysses_size < 1:
        raise ValueError(f"ring_size={ring_size} and ulysses_size={ulysses_size} must both be >= 1")
    if not 0 <= ring_rank < ring_size:
        raise ValueError(f"ring_rank={ring_rank} is outside [0, ring_size={ring_size})")
    if not 0 <= ulysses_rank < ulysses_size:
        raise ValueError(f"ulysses_rank={ulysses_rank} is outside [0, ulysses_size={ulysses_size})")


def shard_sequence(
    x: Tensor,
    *,
    dim: int,
    ring_rank: int,
    ring_size: int,
    ulysses_rank: int = 0,
    ulysses_size: int = 1,
    layout: str = "zigzag",
) -> Tensor:
    """This rank's part of ``x`` along ``dim``: ``S`` -> ``S / (R·U)`` elements, in the order of the layout."""
    _check_sizes(ring_rank, ring_size, ulysses_rank, ulysses_size)
    length = x.shape[dim]
    check_sequence_length(
        length, layout=layout, ring=ring_size, ulysses=ulysses_size, setting=f"sequence length (dim {dim})"
    )
    if layout == "zigzag":
        chunk = length // (2 * ring_size)
        head = x.narrow(dim, ring_rank * chunk, chunk)
        tail = x.narrow(dim, (2 * ring_size - 1 - ring_rank) * chunk, chunk)
        piece = torch.cat([head, tail], dim=dim)
    else:
        piece_length = length // ring_size
        piece = x.narrow(dim, ring_rank * piece_length, piece_length)
    part = piece.shape[dim] // ulysses_size
    return piece.narrow(dim, ulysses_rank * part, part)


def unshard_sequence(
    shards: Sequence[Tensor], *, dim: int, ring_size: int, ulysses_size: int = 1, layout: str = "zigzag"
) -> Tensor:
    """Inverse of ``shard_sequence``: ``shards[r * U + u]`` is the part of ring rank r, Ulysses rank u."""
    check_layout(layout)
    if len(shards) != ring_size * ulysses_size:
        raise ValueError(
            f"got {len(shards)} shards for ring_size={ring_size} x ulysses_size={ulysses_size}; "
            f"pass one shard per rank, ordered ring-major"
        )
    pieces = [torch.cat(shards[r * ulysses_size : (r + 1) * ulysses_size], dim=dim) for r in range(ring_size)]
    if layout == "contiguous":
        return torch.cat(pieces, dim=dim)
    halves = [piece.chunk(2, dim=dim) for piece in pieces]
    chunks = [halves[r][0] for r in range(ring_size)] + [halves[r][1] for r in reversed(range(ring_size))]
    return torch.cat(chunks, dim=dim)
