"""Which (query rows × key rows) blocks a ring rank computes at each ring step, and which it skips.

A ring rank holds its piece of the global sequence (``layout.py``): two chunks of ``S / 2R`` tokens (zigzag) or
one chunk of ``S / R`` (contiguous). At step ``s`` it holds the K/V piece of ring rank ``(rank - s) mod R``.

Without documents one block per step suffices (or none, where the causal mask hides the whole piece). With
documents (``cu_seqlens``), queries see only keys of their own document, so the plan pairs each local chunk with
each received chunk and keeps, per document present in both, the rectangle that document occupies: a causal
square when the two chunks are the same tokens, a full rectangle when the keys come earlier (or without a causal
mask). Every pair of chunks a causal mask hides, and every document that stays inside other chunks, costs nothing.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Block:
    """One kernel call: local query rows × rows of the K/V piece held at this step; ``causal`` = top-left mask."""

    rows: slice
    cols: slice
    causal: bool


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive global positions ``[start, stop)`` stored from local index ``offset`` of a piece."""

    start: int
    stop: int
    offset: int


def piece_chunks(ring_rank: int, ring_size: int, piece_len: int, layout: str) -> list[Chunk]:
    """The chunks of ring rank ``ring_rank``'s piece (``piece_len`` tokens) in local order."""
    if layout == "contiguous":
        return [Chunk(ring_rank * piece_len, (ring_rank + 1) * piece_len, 0)]
    chunk = piece_len // 2
    tail = 2 * ring_size - 1 - ring_rank
    return [Chunk(ring_rank * chunk, (ring_rank + 1) * chunk, 0), Chunk(tail * chunk, (tail + 1) * chunk, chunk)]


def _dense_block(step: int, rank: int, size: int, piece_len: int, *, causal: bool, layout: str) -> list[Block]:
    source = (rank - step) % size
    everything = slice(0, piece_len)
    if not causal:
        return [Block(everything, everything, causal=False)]
    if source == rank:
        return [Block(everything, everything, causal=True)]
    if layout == "contiguous":
        return [Block(everything, everything, causal=False)] if source < rank else []
    half = piece_len // 2
    if source < rank:  # both local chunks come after the source's first chunk and before its second
        return [Block(everything, slice(0, half), causal=False)]
    return [Block(slice(half, piece_len), everything, causal=False)]  # only the local second chunk sees the source


def _document_blocks(queries: Chunk, keys: Chunk, bounds: Sequence[int], *, causal: bool) -> list[Block]:
    """One block per document present in both chunks (chunks are the same tokens or disjoint)."""
    same = queries.start == keys.start
    if causal and keys.start > queries.start:  # the keys all come later
        return []
    blocks = []
    first = bisect.bisect_right(bounds, queries.start) - 1
    last = bisect.bisect_right(bounds, queries.stop - 1) - 1
    for doc in range(first, last + 1):
        doc_start, doc_stop = bounds[doc], bounds[doc + 1]
        q_start, q_stop = max(doc_start, queries.start), min(doc_stop, queries.stop)
        k_start, k_stop = max(doc_start, keys.start), min(doc_stop, keys.stop)
        if k_start < k_stop:
            blocks.append(
                Block(
                    slice(queries.offset + q_start - queries.start, queries.offset + q_stop - queries.start),
                    slice(keys.offset + k_start - keys.start, keys.offset + k_stop - keys.start),
                    causal=causal and same,
                )
            )
    return blocks


@functools.lru_cache(maxsize=64)
def plan_ring(
    rank: int, size: int, piece_len: int, *, causal: bool, layout: str, cu_seqlens: tuple[int, ...] | None = None
) -> tuple[tuple[Block, ...], ...]:
    """The blocks ring rank ``rank`` computes at each ring step (an empty list = nothing to compute at that step).

    ``cu_seqlens`` are the document boundaries of the global sequence (``size * piece_len`` tokens), or None for
    one document. With documents, the steps after the last one at which *any* rank computes something are dropped
    (every rank gets the same number of steps), so K/V stop travelling once no rank needs them; a row whose
    documents never cross a rank's piece runs one step and communicates nothing. The same plan drives the forward
    and the backward pass, and every layer of a model sees the same row: plans are cached.
    """
    if cu_seqlens is None:
        return tuple(
            tuple(_dense_block(step, rank, size, piece_len, causal=causal, layout=layout)) for step in range(size)
        )
    plans = [_document_plan(r, size, piece_len, causal=causal, layout=layout, bounds=cu_seqlens) for r in range(size)]
    steps = 1 + max(step for plan in plans for step, blocks in enumerate(plan) if blocks)
    return tuple(tuple(blocks) for blocks in plans[rank][:steps])


def _document_plan(
    rank: int, size: int, piece_len: int, *, causal: bool, layout: str, bounds: Sequence[int]
) -> list[list[Block]]:
    local = piece_chunks(rank, size, piece_len, layout)
    plan = []
    for step in range(size):
        remote = piece_chunks((rank - step) % size, size, piece_len, layout)
        plan.append([b for q in local for k in remote for b in _document_blocks(q, k, bounds, causal=causal)])
    return plan
