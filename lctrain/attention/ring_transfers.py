"""The ring's transfers on ``transport.Peers``: a step's K/V rows travel straight from their owner to the rank that
computes with them (``fetch``), and the dK/dV of fetched rows straight back (``Returning``). ``ring.py`` decides what
travels when.
"""

from __future__ import annotations

from torch import Tensor

from lctrain.attention.ring_blocks import Step
from lctrain.attention.transport import Arriving, Peers, Transfer, row_count, row_cuts, rows_first

# The forward's last K/V fetch and every dK/dV return travel in this many pieces of rows, each its own exchange:
# the blocks of the rows that have arrived compute while the rest travels, and a return starts as soon as its
# rows' gradients are complete (docs/parallelism.md, "What travels"). lctrain.planner.timing.RING_PIECES says the same.
PIECES = 4


def fetch(peers: Peers, step: Step, k: Tensor, v: Tensor, pieces: int = 1) -> tuple[Arriving, Tensor, Tensor]:
    """Post a step's K/V transfers, in ``pieces`` pieces of rows: rows ``step.send`` of ``k``, ``v`` out, rows
    ``step.keys`` of the source's in; returns them and the K/V the step's blocks index (local views at step 0)."""
    if step.source == 0:
        return Arriving([]), k[:, step.keys], v[:, step.keys]
    (k_store, k_in), (v_store, v_in) = (rows_first(k, row_count(step.keys), k.dtype) for _ in range(2))
    pairs = list(zip(row_cuts(row_count(step.send), pieces), row_cuts(row_count(step.keys), pieces)))
    send = [k[:, step.send], v[:, step.send]]
    transfers = peers.exchange("kv", step.source, send, step.source, [k_store, v_store], -step.source, pairs)
    return Arriving(transfers), k_in, v_in


class Returning:
    """The dK/dV this rank computed at ``step`` (``dk``, ``dv``: fp32, the rows it fetched), on their way back to
    the keys' owner piece by piece, and what comes back in exchange: the gradients of rows ``step.send`` of this
    rank's piece, from the rank that fetched them."""

    def __init__(self, peers: Peers, step: Step, dk: Tensor, dv: Tensor) -> None:
        self.peers, self.step, self.dk, self.dv = peers, step, dk, dv
        (self.dk_store, self.dk_in), (self.dv_store, self.dv_in) = (
            rows_first(dk, row_count(step.send), dk.dtype) for _ in range(2)
        )
        self.cuts = list(zip(row_cuts(row_count(step.keys), PIECES), row_cuts(row_count(step.send), PIECES)))
        self.posted = 0
        self.transfers: list[Transfer] = []

    def post(self, pieces: int) -> None:
        """Send the pieces before ``pieces`` not sent yet: their rows' gradients are complete."""
        sending, self.posted = self.cuts[self.posted : pieces], max(self.posted, pieces)
        stores, source = [self.dk_store, self.dv_store], self.step.source
        self.transfers += self.peers.exchange("dkv", source, [self.dk, self.dv], -source, stores, source, sending)

    def received(self) -> tuple[slice, Tensor, Tensor]:
        """Wait for every piece; the rows of this rank's piece that came back and their dK, dV (fp32)."""
        Arriving(self.transfers).wait()
        return self.step.send, self.dk_in, self.dv_in
