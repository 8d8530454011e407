"""Point-to-point transfers between the ranks of a context-parallel group, in pieces of rows, recorded in a timeline.

``Peers`` sends to and receives from the ranks at given offsets in the group with ``batch_isend_irecv``; what arrives
is received into rows-first buffers (``rows_first``), so a run of rows is contiguous. Nothing here knows what it
carries: the ring's K/V and dK/dV transfers are built on it in ``ring_transfers.py``, and any other mixer whose
pieces pass between ranks can use the same peers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.timeline import NoTimeline, PassTimeline, pass_timeline


def group_coordinates(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in ``group``; ``None`` is a group of one."""
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def row_count(index: slice) -> int:
    return index.stop - index.start


def _bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def row_cuts(count: int, pieces: int) -> list[slice]:
    """``count`` rows cut into ``pieces`` consecutive runs as even as can be (empty ones when there are fewer rows):
    every rank cuts the same rows the same way, so each piece's send meets its receive."""
    bounds = [count * i // pieces for i in range(pieces + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def rows_first(like: Tensor, count: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """An empty buffer of ``count`` rows stored rows first, ``[rows, B, ...]`` (a run of rows is contiguous: it can
    be received into), and its ``[B, rows, ...]`` view, which the blocks index."""
    store = torch.empty((count, like.shape[0], *like.shape[2:]), dtype=dtype, device=like.device)
    return store, store.transpose(0, 1)


@dataclass
class Transfer:
    """Posted sends and receives; the tensors stay referenced until ``wait`` returns."""

    works: list[dist.Work]
    tensors: list[Tensor]
    timeline: PassTimeline | NoTimeline = field(default_factory=NoTimeline)
    event: dict | None = None  # its timeline event

    def wait(self) -> None:
        self.timeline.waiting(self.event)
        for work in self.works:
            work.wait()
        self.timeline.done(self.event)


class Arriving:
    """A step's transfers, one per piece of its rows, waited for in order as far as each block needs."""

    def __init__(self, transfers: list[Transfer]) -> None:
        self.transfers = transfers
        self.done = 0

    def wait(self, piece: int | None = None) -> None:
        """Wait for pieces up to ``piece`` (None: all)."""
        last = len(self.transfers) - 1 if piece is None else min(piece, len(self.transfers) - 1)
        while self.done <= last:
            self.transfers[self.done].wait()
            self.done += 1


class Peers:
    """Point-to-point transfers with the ranks of ``group`` at a given offset from this one, recorded in
    ``timeline``."""

    def __init__(self, group: dist.ProcessGroup | None, timeline: PassTimeline | NoTimeline) -> None:
        self.group = group
        self.timeline = timeline
        self.rank, self.size = group_coordinates(group)

    def start(
        self, what: str, source: int, send: list[Tensor], send_offset: int, receive: list[Tensor], receive_offset: int
    ) -> Transfer:
        """Send ``send`` to rank ``rank + send_offset`` and receive ``receive`` from ``rank + receive_offset``
        (``what`` of step ``source``, for the timeline).

        Every rank calls this at every step other than step 0, with tensors of zero rows when it has nothing to
        send or receive: each call then involves every rank of the group, as ``batch_isend_irecv`` requires when
        it is the group's first collective (NCCL), and an empty message costs nothing.
        """
        send = [t.contiguous() for t in send]
        ops = [dist.P2POp(dist.isend, t, self._global(send_offset), self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self._global(receive_offset), self.group) for t in receive]
        works = dist.batch_isend_irecv(ops)
        event = self.timeline.posted(what, source, _bytes(send), _bytes(receive))
        return Transfer(works, send + receive, self.timeline, event)

    def exchange(
        self,
        what: str,
        source: int,
        send: list[Tensor],
        send_offset: int,
        receive: list[Tensor],
        receive_offset: int,
        pieces: list[tuple[slice, slice]],
    ) -> list[Transfer]:
        """``start`` once per piece: rows ``a`` of the ``[B, rows, ...]`` tensors ``send`` (sent rows first) and
        rows ``b`` of the rows-first buffers ``receive``, for each ``(a, b)`` of ``pieces``."""
        return [
            self.start(
                what,
                source,
                [t[:, a].transpose(0, 1) for t in send],
                send_offset,
                [t[b] for t in receive],
                receive_offset,
            )
            for a, b in pieces
        ]

    def _global(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)


def pass_peers(group: dist.ProcessGroup | None, pass_name: str, steps: int) -> Peers:
    """A pass's transfers, recorded in its timeline when it has more than one step (``timeline.py``)."""
    if steps == 1:
        return Peers(group, NoTimeline())
    ring_rank, ring_size = group_coordinates(group)
    return Peers(group, pass_timeline(pass_name, dist.get_rank(), ring_rank, ring_size))
