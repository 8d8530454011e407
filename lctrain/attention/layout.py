"""How a global sequence is split over (ring, ulysses) ranks.

With ring size R and Ulysses size U, ``zigzag`` cuts the sequence into 2R chunks and gives ring rank r
``cat(chunk[r], chunk[2R-1-r])``, so every ring rank does the same causal work; ``contiguous`` gives ring rank r
chunk r of R. Each ring rank's piece is then cut into U contiguous parts, one per Ulysses rank. For S = 16,
R = 2, U = 2 (zigzag), tokens 0..15 land as:

    ring 0: chunks 0, 3 -> [0 1 2 3 | 12 13 14 15] -> ulysses 0: [0 1 2 3], ulysses 1: [12 13 14 15]
    ring 1: chunks 1, 2 -> [4 5 6 7 |  8  9 10 11] -> ulysses 0: [4 5 6 7], ulysses 1: [ 8  9 10 11]

A rank's ``SequencePlace`` (its ring and Ulysses ranks and sizes, and the layout; ``SequencePlace.from_mesh`` on
the job's mesh) cuts its part of any sequence; ``shard_sequence`` does the same from keywords.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lctrain.rules import check_layout, check_sequence_length, sequence_divisor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class SequencePlace:
    """A rank's place in a sequence: ring rank ``ring_rank`` of ``ring_size``, Ulysses rank ``ulysses_rank`` of
    ``ulysses_size``, and the layout the sequence is cut by (the defaults: one rank, the whole sequence). Checked
    when made."""

    ring_rank: int = 0
    ring_size: int = 1
    ulysses_rank: int = 0
    ulysses_size: int = 1
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if self.ring_size < 1 or self.ulysses_size < 1:
            raise ValueError(f"ring_size={self.ring_size} and ulysses_size={self.ulysses_size} must both be >= 1")
        if not 0 <= self.ring_rank < self.ring_size:
            raise ValueError(f"ring_rank={self.ring_rank} is outside [0, ring_size={self.ring_size})")
        if not 0 <= self.ulysses_rank < self.ulysses_size:
            raise ValueError(f"ulysses_rank={self.ulysses_rank} is outside [0, ulysses_size={self.ulysses_size})")
        check_layout(self.layout)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, layout: str) -> SequencePlace:
        """This rank's place on a mesh with ``ring`` and ``ulysses`` dims (``lctrain.parallel.mesh.JobMesh``)."""
        ring, ulysses = mesh["ring"], mesh["ulysses"]
        return cls(ring.get_local_rank(), ring.size(), ulysses.get_local_rank(), ulysses.size(), layout)

    @property
    def sequence_divisor(self) -> int:
        """What every global sequence length must be a multiple of (``lctrain.rules.sequence_divisor``)."""
        return sequence_divisor(self.layout, self.ring_size, self.ulysses_size)

    def shard(self, x: Tensor, *, dim: int) -> Tensor:
        """This rank's part of ``x`` along ``dim``: ``S`` -> ``S / (R·U)`` elements, in the order of the layout."""
        length, ring = x.shape[dim], self.ring_size
        check_sequence_length(
            length, layout=self.layout, ring=ring, ulysses=self.ulysses_size, setting=f"sequence length (dim {dim})"
        )
        if self.layout == "zigzag":
            chunk = length // (2 * ring)
            head = x.narrow(dim, self.ring_rank * chunk, chunk)
            tail = x.narrow(dim, (2 * ring - 1 - self.ring_rank) * chunk, chunk)
            piece = torch.cat([head, tail], dim=dim)
        else:
            piece_length = length // ring
            piece = x.narrow(dim, self.ring_rank * piece_length, piece_length)
        part = piece.shape[dim] // self.ulysses_size
        return piece.narrow(dim, self.ulysses_rank * part, part)


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
    """This rank's part of ``x`` along ``dim``: ``S`` -> ``S / (R·U)`` elements, in the order of the layout
    (``SequencePlace(ring_rank, ring_size, ulysses_rank, ulysses_size, layout).shard(x, dim=dim)``)."""
    return SequencePlace(ring_rank, ring_size, ulysses_rank, ulysses_size, layout).shard(x, dim=dim)


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
