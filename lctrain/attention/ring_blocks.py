"""The ring plan: at each ring step, which keys a ring rank fetches and which (query rows × key rows) blocks it
computes with them; everything else is skipped.

A ring rank holds its piece of the global sequence (``layout.py``): two chunks of ``S / 2R`` tokens (zigzag) or
one chunk of ``S / R`` (contiguous). Step ``source = s`` computes the rank's queries against keys of ring rank
``(rank - s) mod R`` (``s = 0``: its own piece). That rank sends them directly, and only the rows the blocks need
(``Step.keys``); in exchange the rank sends rows ``Step.send`` of its own piece to ring rank ``(rank + s) mod R``.
Offsets at which no rank computes anything are not steps at all: they cost no time and send nothing.

Query ``i`` sees key ``j`` (global positions) when both are in the same document (``cu_seqlens``), ``j <= i``
(causal) and ``i - j < window`` (a sliding window of ``window`` keys, the query's own included: Hugging Face's
``sliding_window``). A document may also see a shared prefix (``doc_prefix``): every key of an earlier document,
whose positions its own continue (a preference pair ``[prompt | chosen | rejected]``: both answers see the
prompt, never each other). The window counts those positions: query ``i`` of document ``d`` sees key ``j`` of
its prefix ``p`` when ``i - j - gap < window``, ``gap`` being the tokens between the end of ``p`` and the start
of ``d`` (the chosen answer, for the rejected one).

Without documents or a window one block per step suffices (or none, where the causal mask hides the whole
piece). Otherwise the plan pairs each local chunk with each chunk of the source and keeps, per document present
in the query chunk, the rectangle it occupies against its own tokens and against its prefix's in the key chunk,
clipped to the rows and columns the window reaches: a causal square when the two chunks are the same tokens and
the keys are the document's own, a full rectangle when the keys come earlier. A block the window boundary cuts
carries ``window_left``, which the kernel applies as a band; blocks wholly inside the window stay plain, blocks
wholly outside it are skipped, and so is every (query, key) pair of two documents that do not see each other.

``merge_blocks`` then joins the blocks of a step whose union is one rectangle (a shared prompt's answers against
it; the documents of a chunk against an earlier chunk holding their prefix) or one causal square (a prompt and its
first answer, which continues it; the two chunks of a zigzag piece against themselves when the second sees all of
the first): fewer, larger kernel calls for the same pairs, the same in every pass and every layer.

``group_documents`` merges the document rectangles of a step that lie end to end (block-diagonal: the documents
of a chunk against the same chunk) into one block with ``segments``, for kernels with a varlen mode: one kernel
call per group instead of one per document.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

NOTHING = slice(0, 0)


@dataclass(frozen=True)
class Block:
    """One kernel call: local query rows × rows of the keys fetched at its step (``cols`` index ``Step.keys``).

    ``causal``: top-left causal mask (square blocks only). ``window_left``: the sliding window's edge, top-left
    aligned too: query row ``a`` sees key columns ``b >= a - window_left``; None when the window cuts nothing here.
    ``segments``: None for one rectangle; else the (query rows, key rows) of the document rectangles laid end to
    end along ``rows`` and ``cols`` (block-diagonal), each masked by ``causal`` and ``window_left`` on its own.
    """

    rows: slice
    cols: slice
    causal: bool
    window_left: int | None = None
    segments: tuple[tuple[int, int], ...] | None = None


def visible_pairs(block: Block) -> int:
    """The (query, key) pairs a block's rows see, i.e. its work (a plan's blocks give every row a key).

    Row ``a`` sees columns ``max(0, a - window_left)`` to ``min(a, cols - 1)`` (causal) or ``cols - 1``.
    """
    if block.segments is not None:
        return sum(
            visible_pairs(Block(slice(0, rows), slice(0, cols), block.causal, block.window_left))
            for rows, cols in block.segments
        )
    rows, cols = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start

    def triangle(n: int) -> int:  # 0 + 1 + ... + n
        return n * (n + 1) // 2 if n > 0 else 0

    last_cols = triangle(rows - 1) - triangle(rows - cols) if block.causal else rows * (cols - 1)
    first_cols = 0 if block.window_left is None else triangle(rows - 1 - block.window_left)
    return last_cols - first_cols + rows


@dataclass(frozen=True)
class Step:
    """One ring step of one rank: its blocks against rows ``keys`` of ring rank ``(rank - source) mod R``'s piece
    (``NOTHING``: no block), while rows ``send`` of its own piece go to ring rank ``(rank + source) mod R``.
    Step 0 (``source = 0``) uses the whole local piece and sends nothing."""

    source: int
    keys: slice
    send: slice
    blocks: tuple[Block, ...]


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


def _dense_blocks(rank: int, source: int, piece_len: int, *, causal: bool, layout: str) -> list[Block]:
    """One document, no window: at most one block (cols index the source's piece)."""
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


def _rectangle(
    queries: Chunk,
    keys: Chunk,
    rows: tuple[int, int],
    seen: Sequence[int],
    gap: int,
    *,
    causal: bool,
    window: int | None,
) -> Block | None:
    """The block of queries ``rows`` (global ``[start, stop)``, inside ``queries``) against the keys ``seen`` that
    lie in ``keys``, clipped to the window, or None when it is empty. ``gap``: how many more tokens apart a query
    and a key are in the row than in positions (0 inside a document)."""
    q_start, q_stop = rows
    k_start, k_stop = max(seen[0], keys.start), min(seen[1], keys.stop)
    window_left = None
    if window is not None:
        reach = window + gap  # the window in row order
        q_stop = min(q_stop, k_stop - 1 + reach)  # later queries are window or more past every key
        k_start = max(k_start, q_start - reach + 1)  # earlier keys are window or more before every query
        if q_stop - 1 - k_start >= reach:  # the farthest pair left is out of the window: a band
            window_left = reach - 1 - (q_start - k_start)
    if q_start >= q_stop or k_start >= k_stop:
        return None
    return Block(
        slice(queries.offset + q_start - queries.start, queries.offset + q_stop - queries.start),
        slice(keys.offset + k_start - keys.start, keys.offset + k_stop - keys.start),
        causal=causal,
        window_left=window_left,
    )


def _chunk_blocks(
    queries: Chunk,
    keys: Chunk,
    bounds: Sequence[int],
    prefixes: Sequence[int] | None,
    *,
    causal: bool,
    window: int | None,
) -> list[Block]:
    """Per document present in the query chunk, its block against its own tokens and its block against its
    prefix's (``prefixes``, None: no document has one) in the key chunk (the same tokens or disjoint), clipped to
    the window.

    Cols index the source's piece. A window comes with a causal mask (checked by the callers), so the keys are
    either the query chunk itself or all earlier; a prefix comes wholly before its document.
    """
    same = queries.start == keys.start
    if causal and keys.start > queries.start:  # the keys all come later
        return []
    blocks = []
    first = bisect.bisect_right(bounds, queries.start) - 1
    last = bisect.bisect_right(bounds, queries.stop - 1) - 1
    for doc in range(first, last + 1):
        rows = (max(bounds[doc], queries.start), min(bounds[doc + 1], queries.stop))
        found = [_rectangle(queries, keys, rows, bounds[doc : doc + 2], 0, causal=causal and same, window=window)]
        prefix = -1 if prefixes is None else prefixes[doc]
        if prefix >= 0:  # the prefix's keys, all before the document's: a rectangle
            gap = bounds[doc] - bounds[prefix + 1]
            found.append(_rectangle(queries, keys, rows, bounds[prefix : prefix + 2], gap, causal=False, window=window))
        blocks += [block for block in found if block is not None]
    return blocks


def _source_blocks(
    rank: int,
    source: int,
    size: int,
    piece_len: int,
    *,
    causal: bool,
    layout: str,
    bounds: Sequence[int] | None,
    prefixes: Sequence[int] | None,
    window: int | None,
) -> list[Block]:
    """The blocks of ``rank``'s queries against ring rank ``source``'s piece (cols index that piece)."""
    if bounds is None and window is None:
        return _dense_blocks(rank, source, piece_len, causal=causal, layout=layout)
    bounds = bounds or (0, size * piece_len)
    local = piece_chunks(rank, size, piece_len, layout)
    remote = piece_chunks(source, size, piece_len, layout)
    options = dict(causal=causal, window=window)
    return merge_blocks([b for q in local for k in remote for b in _chunk_blocks(q, k, bounds, prefixes, **options)])


def plain(block: Block) -> bool:
    """A full rectangle (no mask, one segment): it can be cut or joined at any row or column."""
    return not block.causal and block.window_left is None and block.segments is None


def _square(block: Block) -> bool:
    return block.causal and block.window_left is None and block.segments is None


def _join_rectangles(blocks: list[Block], *, along_cols: bool) -> list[Block]:
    """``blocks`` with plain rectangles of the same rows whose columns meet (``along_cols``), or of the same
    columns whose rows meet, joined into one."""
    others, runs = [], {}
    for block in blocks:
        if not plain(block):
            others.append(block)
            continue
        fixed, moving = (block.rows, block.cols) if along_cols else (block.cols, block.rows)
        runs.setdefault((fixed.start, fixed.stop), []).append((moving, fixed))
    joined = []
    for run in runs.values():
        run.sort(key=lambda part: part[0].start)
        start, stop, fixed = run[0][0].start, run[0][0].stop, run[0][1]
        for moving, _ in run[1:] + [(slice(-1, -1), fixed)]:  # a sentinel closes the last part
            if moving.start == stop:
                stop = moving.stop
                continue
            part = slice(start, stop)
            joined.append(Block(fixed, part, causal=False) if along_cols else Block(part, fixed, causal=False))
            start, stop = moving.start, moving.stop
    return others + joined


def _join_squares(blocks: list[Block]) -> list[Block]:
    """``blocks`` with each causal square ``x`` followed on the diagonal by another, ``y``, joined into one when
    the rectangle of ``y``'s rows against ``x``'s columns is a block too (a document continuing the one before, as
    a shared prompt and its first answer; the two chunks of a zigzag piece against themselves)."""
    squares = sorted((b for b in blocks if _square(b)), key=lambda b: b.rows.start)
    rectangles = {(b.rows.start, b.rows.stop, b.cols.start, b.cols.stop): b for b in blocks if plain(b)}
    others = [b for b in blocks if not _square(b) and not plain(b)]
    joined: list[Block] = []
    for square in squares:
        last = joined[-1] if joined else None
        if last is not None and (square.rows.start, square.cols.start) == (last.rows.stop, last.cols.stop):
            between = (square.rows.start, square.rows.stop, last.cols.start, last.cols.stop)
            if rectangles.pop(between, None) is not None:  # y's rows see all of x's columns: one causal square
                rows, cols = slice(last.rows.start, square.rows.stop), slice(last.cols.start, square.cols.stop)
                joined[-1] = Block(rows, cols, causal=True)
                continue
        joined.append(square)
    return others + joined + list(rectangles.values())


def merge_blocks(blocks: Sequence[Block]) -> list[Block]:
    """``blocks`` (of one step, disjoint) with those whose union is one rectangle or one causal square joined into
    one block, in order of rows then columns: fewer, larger kernel calls for the same pairs. A shared prompt's
    answers see it as one rectangle per chunk, and the prompt with its first answer is one causal square."""
    merged = list(blocks)
    while True:
        count = len(merged)
        merged = _join_rectangles(merged, along_cols=True)
        merged = _join_squares(merged)
        merged = _join_rectangles(merged, along_cols=False)
        if len(merged) == count:
            return sorted(merged, key=lambda b: (b.rows.start, b.cols.start))


def _rows_needed(blocks: Sequence[Block]) -> slice:
    """The smallest run of the source's rows that holds every block's keys (``NOTHING`` for no block)."""
    if not blocks:
        return NOTHING
    return slice(min(b.cols.start for b in blocks), max(b.cols.stop for b in blocks))


def _shifted(block: Block, start: int) -> Block:
    cols = slice(block.cols.start - start, block.cols.stop - start)
    return Block(block.rows, cols, block.causal, block.window_left, block.segments)


def _band_cuts(rows: int, window_left: int | None) -> bool:
    """Whether a band ``window_left`` hides anything in a block of ``rows`` query rows (its last row's first
    visible column is past the first column)."""
    return window_left is not None and rows - 1 > window_left


BlockKey = tuple[int, int, int, int, bool, int | None, tuple[tuple[int, int], ...] | None]


def _key(block: Block) -> BlockKey:
    rows, cols = block.rows, block.cols
    return (rows.start, rows.stop, cols.start, cols.stop, block.causal, block.window_left, block.segments)


def group_documents(blocks: Sequence[Block]) -> tuple[Block, ...]:
    """``blocks`` (of one step) with each run of document rectangles that lie end to end, in rows and in columns,
    merged into one block with ``segments`` (see ``_group_documents``); cached, as the plan repeats every layer."""
    return _group_documents(tuple(_key(b) for b in blocks))


@functools.lru_cache(maxsize=1024)
def _group_documents(keys: tuple[BlockKey, ...]) -> tuple[Block, ...]:
    """The blocks of ``keys`` with each run of document rectangles that lie end to end, in rows and in columns,
    merged into one block with ``segments``; every other block unchanged. The pairs computed stay the same.

    A run shares ``causal``. Causal squares (the documents of a chunk against themselves) may mix banded and
    unbanded documents: the run's band is that of its banded members (all the same) and cuts nothing in the
    others, which are at most ``window_left + 1`` long. Non-causal rectangles are grouped without a band only.
    Every segment then needs the same flash-attn window (``kernels.flash.varlen_window``). Runs of one stay as they are.
    A shared prefix's rectangle has the rows of its document's own block, so it never joins that one; whatever it
    joins lies end to end with it, so each segment is still exactly one block of the plan.
    """
    blocks = [Block(slice(k[0], k[1]), slice(k[2], k[3]), k[4], k[5], k[6]) for k in keys]
    groups: list[list[Block]] = []
    bands: list[int | None] = []
    for block in sorted(blocks, key=lambda b: (b.causal, b.rows.start, b.cols.start)):
        rows, cols = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
        last = groups[-1][-1] if groups else None
        joins = (
            last is not None
            and last.causal == block.causal
            and (last.rows.stop, last.cols.stop) == (block.rows.start, block.cols.start)
        )
        band = bands[-1] if groups else None
        if joins and block.causal:
            sizes = [b.rows.stop - b.rows.start for b in groups[-1]]
            if rows != cols:
                joins = False
            elif block.window_left is None:  # an unbanded document joins if the run's band cuts nothing in it
                joins = not _band_cuts(rows, band)
            elif band is None:  # the first banded document: its band must cut nothing in the run so far
                joins = not any(_band_cuts(size, block.window_left) for size in sizes)
                band = block.window_left
            else:
                joins = block.window_left == band
        elif joins:
            joins = block.window_left is None and band is None
        if joins:
            groups[-1].append(block)
            bands[-1] = band
        else:
            groups.append([block])
            bands.append(block.window_left)
    merged = []
    for group, band in zip(groups, bands):
        if len(group) == 1:
            merged.append(group[0])
            continue
        segments = tuple((b.rows.stop - b.rows.start, b.cols.stop - b.cols.start) for b in group)
        rows, cols = slice(group[0].rows.start, group[-1].rows.stop), slice(group[0].cols.start, group[-1].cols.stop)
        merged.append(Block(rows, cols, group[0].causal, band, segments))
    return tuple(merged)


@functools.lru_cache(maxsize=64)
def _ring_plans(
    size: int,
    piece_len: int,
    *,
    causal: bool,
    layout: str,
    cu_seqlens: tuple[int, ...] | None,
    doc_prefix: tuple[int, ...] | None,
    window: int | None,
) -> tuple[tuple[Step, ...], ...]:
    options = dict(causal=causal, layout=layout, bounds=cu_seqlens, prefixes=doc_prefix, window=window)
    blocks = [[_source_blocks(r, (r - s) % size, size, piece_len, **options) for s in range(size)] for r in range(size)]
    offsets = [s for s in range(size) if any(blocks[r][s] for r in range(size))]

    def keys(rank: int, offset: int) -> slice:
        return slice(0, piece_len) if offset == 0 else _rows_needed(blocks[rank][offset])

    return tuple(
        tuple(
            Step(
                source=s,
                keys=keys(r, s),
                send=keys((r + s) % size, s) if s else NOTHING,
                blocks=tuple(_shifted(b, keys(r, s).start) for b in blocks[r][s]),
            )
            for s in offsets
        )
        for r in range(size)
    )


def plan_ring(
    rank: int,
    size: int,
    piece_len: int,
    *,
    causal: bool,
    layout: str,
    cu_seqlens: tuple[int, ...] | None = None,
    doc_prefix: tuple[int, ...] | None = None,
    window: int | None = None,
) -> tuple[Step, ...]:
    """The steps of ring rank ``rank``, in ring order; the first is always step 0 (its own piece).

    ``cu_seqlens`` are the document boundaries of the global sequence (``size * piece_len`` tokens), or None for
    one document; ``doc_prefix`` (one per document, needs ``cu_seqlens``) the earlier document each one also
    sees, as a prefix whose positions its own continue, or -1 (checked: ``checks.check_doc_prefix``), or None for
    none; ``window`` the sliding window (keys per query, itself included; needs ``causal``), or None.
    Every rank gets the same steps (the same sources), so each send meets its receive; a rank may have nothing
    to compute, send or receive at some of them. The same plan drives the forward and the backward pass, and
    every layer of a model sees the same row: the plans of all ranks are computed together and cached.
    """
    options = dict(causal=causal, layout=layout, cu_seqlens=cu_seqlens, doc_prefix=doc_prefix, window=window)
    return _ring_plans(size, piece_len, **options)[rank]
