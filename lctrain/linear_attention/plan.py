"""The plan of a row's gated delta layers over the ranks of a ring group: where each rank's pieces are cut, the state
each cut starts from, what each piece exports to the composition, and which tokens the convolution reads from other
ranks. A function of the row's documents, the layout and the kernel's taps only, made once per row (cached) and
shared by every layer, forward and backward.

Documents come as ``bounds`` (``cu_seqlens``) and ``prefixes`` (``doc_prefix``: for each document an earlier one it
continues as if that one came directly before it, or -1). A document ``d`` with prefix ``p`` runs as the sequence
``[p | d]``: its entering state is the state leaving ``p`` and its convolution reads ``p``'s last tokens. Where ``p``
ends where ``d`` starts (a preference pair's chosen answer) that is the row's own order, and ``d`` simply continues
``p``; elsewhere (the rejected answer, after the chosen one) ``d`` jumps back to the end of ``p``.

A piece is cut into segments at the starts of the documents that do not continue the row, and at the ends of the
prefixes that some document jumps back to (their leaving states are needed). A segment starts from zero, from the
state entering its piece, from the state leaving an earlier segment of its piece, or from the state leaving a prefix
that ends in another piece. The last two are the composition's nodes: ``("enter", g)`` (the state entering piece g of
the global order) and ``("prefix", p)``. Every segment's entering state is affine in at most one node (its
``symbol``); a piece exports the affine maps that define nodes: its leaving state (the next piece's entering one) and
the states leaving the prefixes that end in it and are jumped to from another piece.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Node = tuple[str, int]  # ("enter", g) or ("prefix", p): a state the composition gives
Source = tuple[str, int]  # a Node, ("zero", 0), or ("segment", i): the state leaving segment i of the same piece


@dataclass(frozen=True)
class Documents:
    """A row's documents: ``bounds`` (0 first, the row's length last) and ``prefixes`` (one per document, -1: none)."""

    bounds: tuple[int, ...]
    prefixes: tuple[int, ...]

    @classmethod
    def of(cls, bounds: Sequence[int], prefixes: Sequence[int] | None = None) -> Documents:
        return cls(tuple(bounds), tuple(prefixes) if prefixes is not None else (-1,) * (len(bounds) - 1))

    def continues(self, doc: int) -> bool:
        """Whether ``doc`` continues the row: its prefix ends where it starts."""
        prefix = self.prefixes[doc]
        return prefix >= 0 and self.bounds[prefix + 1] == self.bounds[doc]

    def jumps(self, doc: int) -> bool:
        """Whether ``doc`` starts from the state leaving a prefix that does not end where it starts."""
        return self.prefixes[doc] >= 0 and not self.continues(doc)


@dataclass(frozen=True)
class Segment:
    """Local tokens ``[start, stop)`` run as one: from ``source``; ``symbol``: the node its entering state is affine
    in (None: known without the composition); ``deferred``: run once the composition is done (its leaving state is
    needed by nothing exported)."""

    start: int
    stop: int
    source: Source
    symbol: Node | None
    deferred: bool


@dataclass(frozen=True)
class PiecePlan:
    """A piece: global tokens ``[start, stop)`` at local offset ``at``, ``index`` in the global order; its segments;
    ``exports``: (node, segment whose leaving state defines it)."""

    index: int
    start: int
    stop: int
    at: int
    segments: tuple[Segment, ...]
    exports: tuple[tuple[Node, int], ...]


@dataclass(frozen=True)
class ConvPlan:
    """The convolution's reads on one rank, as indices into its bank ``[local tokens | gathered tokens | zero]``:
    ``send`` ``[M]`` the local tokens other ranks read (-1: padding); ``keep`` ``[K - 1, L]`` whether tap ``back``
    (row ``back - 1``) of each local token reads the token ``back`` before it in the row; ``halo`` ``[pieces, K - 1]``
    the ``K - 1`` tokens before each piece; ``extra_at``, ``extra_tap``, ``extra_from`` ``[n]``: the reads of a
    document's first tokens across a jump back to its prefix (local token, weight column, bank index)."""

    send: Tensor
    keep: Tensor
    halo: Tensor
    extra_at: Tensor
    extra_tap: Tensor
    extra_from: Tensor


@dataclass(frozen=True)
class RowPlan:
    """One rank's plan: its ``pieces`` in local order; ``slots`` exported maps per rank (padded: the exchange's
    width); ``links``: every exported map as (rank, slot, node, symbol), in the nodes' global order; ``conv``."""

    pieces: tuple[PiecePlan, ...]
    slots: int
    links: tuple[tuple[int, int, Node, Node | None], ...]
    conv: ConvPlan


def _segments(
    docs: Documents, restarts: dict[int, int], ends: set[int], start: int, stop: int, index: int
) -> list[tuple[int, int, Source]]:
    """Piece ``index``'s cuts, at ``restarts`` (the starts of the documents that do not continue the row, to the
    document) and ``ends`` (of the prefixes jumped back to): (global start, global stop, source) of each segment."""
    cuts = sorted({start, *(c for c in (*restarts, *ends) if start < c < stop)})
    segments: list[tuple[int, int, Source]] = []
    ending = {b: i for i, b in enumerate([*cuts[1:], stop])}  # the segment ending at each cut
    for i, (a, b) in enumerate(zip(cuts, [*cuts[1:], stop])):
        if a in restarts:
            prefix = docs.prefixes[restarts[a]]
            end = docs.bounds[prefix + 1]
            if prefix < 0:
                source: Source = ("zero", 0)
            elif start < end <= a:  # the prefix ends in this piece: the segment that ends it
                source = ("segment", ending[end])
            else:
                source = ("prefix", prefix)
        else:
            source = ("enter", index) if a == start else ("segment", i - 1)
        segments.append((a, b, source))
    return segments


def _pieces(docs: Documents, every: Sequence[Sequence[tuple[int, int]]]) -> list[list[PiecePlan]]:
    """Every rank's pieces, planned."""
    order = sorted((start, rank, i) for rank, runs in enumerate(every) for i, (start, _) in enumerate(runs))
    index = {(rank, i): g for g, (_, rank, i) in enumerate(order)}
    spans = [(a, b) for _, rank, i in order for a, b in [every[rank][i]]]
    home = {}  # each jumped-to prefix: the piece holding its last token, and whether a jump comes from elsewhere
    for d in range(len(docs.prefixes)):
        if docs.jumps(d):
            p, start = docs.prefixes[d], docs.bounds[d]
            g = next(g for g, (a, b) in enumerate(spans) if a < docs.bounds[p + 1] <= b)
            home[p] = (g, home.get(p, (g, False))[1] or not spans[g][0] <= start < spans[g][1])
    restarts = {docs.bounds[d]: d for d in range(len(docs.prefixes)) if not docs.continues(d)}
    ends = {docs.bounds[p + 1] for p in home}
    planned = []
    for rank, runs in enumerate(every):
        planned.append([])
        at = 0
        for i, (start, stop) in enumerate(runs):
            g = index[rank, i]
            cuts = _segments(docs, restarts, ends, start, stop, g)
            exports = [(("enter", g + 1), len(cuts) - 1)]  # the last piece's too, unused: it runs like the others
            exports += [
                (("prefix", p), next(j for j, c in enumerate(cuts) if c[1] == docs.bounds[p + 1]))
                for p, (h, elsewhere) in sorted(home.items())
                if h == g and elsewhere
            ]
            symbols: list[Node | None] = []
            for _, _, (kind, ref) in cuts:
                symbols.append(None if kind == "zero" else symbols[ref] if kind == "segment" else (kind, ref))
            needed = {j for _, j in exports}
            for j in reversed(range(len(cuts))):  # a needed map needs the map it continues
                if j in needed and cuts[j][2][0] == "segment":
                    needed.add(cuts[j][2][1])
            segments = tuple(
                Segment(a - start + at, b - start + at, source, symbol, symbol is not None and j not in needed)
                for j, ((a, b, source), symbol) in enumerate(zip(cuts, symbols))
            )
            planned[-1].append(PiecePlan(g, start, stop, at, segments, tuple(exports)))
            at += stop - start
    return planned


def _jump_reads(docs: Documents, taps: int) -> Tensor:
    """``[n, 3]``: the reads of the documents that jump back to their prefix, across the jump: (reader's row
    position, tap ``back``, the prefix's token it reads), for each of the first ``taps - 1`` tokens and each tap
    reaching before the document's start and not before the prefix's."""
    reads = []
    for d in range(len(docs.prefixes)):
        if docs.jumps(d):
            start, p = docs.bounds[d], docs.prefixes[d]
            for offset in range(min(taps - 1, docs.bounds[d + 1] - start)):
                for back in range(offset + 1, taps):
                    if docs.bounds[p + 1] + offset - back >= docs.bounds[p]:
                        reads.append((start + offset, back, docs.bounds[p + 1] + offset - back))
    return torch.tensor(reads, dtype=torch.long).reshape(-1, 3)


def _conv(docs: Documents, every: Sequence[Sequence[tuple[int, int]]], rank: int, taps: int) -> ConvPlan:
    """This rank's ``ConvPlan``: every rank's reads are found, so that each sends what the others read."""
    size, spans = len(every), []  # (start, stop, rank, local offset) of every piece
    for r, runs in enumerate(every):
        offsets = [sum(b - a for a, b in runs[:i]) for i in range(len(runs))]
        spans += [(a, b, r, at) for (a, b), at in zip(runs, offsets)]

    def locate(positions: Tensor) -> tuple[Tensor, Tensor]:  # the rank holding each row position, and where
        owner, local = torch.zeros_like(positions), torch.zeros_like(positions)
        for a, b, r, at in spans:
            inside = (positions >= a) & (positions < b)
            owner[inside], local[inside] = r, at + positions[inside] - a
        return owner, local

    jumps = _jump_reads(docs, taps)
    halos = [torch.stack([torch.arange(a - taps + 1, a) for a, _ in runs]) for runs in every]
    readers = locate(jumps[:, 0])[0]
    wanted = [torch.cat([halo[halo >= 0], jumps[readers == r, 2]]) for r, halo in enumerate(halos)]
    remote = torch.unique(torch.cat([w[locate(w)[0] != r] for r, w in enumerate(wanted)]))
    sends = [remote[locate(remote)[0] == r] for r in range(size)]
    slots, count = max([1, *(len(s) for s in sends)]), sum(b - a for a, b in every[rank])

    def bank(positions: Tensor) -> Tensor:
        safe = positions.clamp(min=0)
        owner, local = locate(safe)
        slot = torch.zeros_like(safe)
        for r, sent in enumerate(sends):
            slot[owner == r] = torch.searchsorted(sent, safe[owner == r])
        index = torch.where(owner == rank, local, count + owner * slots + slot)
        return torch.where(positions >= 0, index, count + size * slots)

    # tap ``back`` of a token reads the row's token ``back`` before it where that lies in its document, or in the
    # prefix it continues directly (the row's order): from ``reach``, the first row position its document reads
    bounds = torch.tensor(docs.bounds)
    reach = torch.tensor([docs.bounds[p if docs.continues(d) else d] for d, p in enumerate(docs.prefixes)])
    positions = torch.cat([torch.arange(a, b) for a, b in every[rank]])
    first = reach[torch.searchsorted(bounds[:-1], positions, right=True) - 1]
    keep = positions - torch.arange(1, taps)[:, None] >= first
    send = torch.cat([locate(sends[rank])[1], torch.full((slots - len(sends[rank]),), -1)])
    mine = jumps[readers == rank]
    return ConvPlan(send, keep, bank(halos[rank]), locate(mine[:, 0])[1], taps - 1 - mine[:, 1], bank(mine[:, 2]))


@functools.lru_cache(maxsize=16)
def row_plan(
    docs: Documents, every: tuple[tuple[tuple[int, int], ...], ...], rank: int, taps: int, device: torch.device
) -> RowPlan:
    """Rank ``rank``'s plan of a row of ``docs`` whose ranks hold the global runs ``every`` (per rank, in local
    order), for a convolution of ``taps`` taps; its index tensors on ``device``."""
    planned = _pieces(docs, every)
    slots = max([1, *(sum(len(p.exports) for p in pieces) for pieces in planned)])
    links = []
    for r, pieces in enumerate(planned):
        maps = [(node, p.segments[j].symbol) for p in pieces for node, j in p.exports]
        links += [(r, slot, node, symbol) for slot, (node, symbol) in enumerate(maps)]
    starts = {("enter", p.index): p.start for pieces in planned for p in pieces}
    links.sort(
        key=lambda link: starts.get(link[2], docs.bounds[-1]) if link[2][0] == "enter" else docs.bounds[link[2][1] + 1]
    )
    conv = _conv(docs, every, rank, taps)
    conv = ConvPlan(*(t.to(device) for t in vars(conv).values()))
    return RowPlan(tuple(planned[rank]), slots, tuple(links), conv)
