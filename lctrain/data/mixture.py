"""Documents of several sources, drawn by weight with a seeded sampler, resumable exactly.

Each source's documents come from a ``SourceStream``: its raw items (texts or chat records) for one dp rank, epoch
after epoch, encoded a batch at a time into ``Document`` s. Its position is three numbers, the ``epoch``, the
``document``: the items of that epoch consumed (documents handed out, and records skipped: a conversation longer
than a row that is dropped, or one without a trained token), and the ``part``: the parts of the next item consumed
(a conversation rendered once per turn is one item of several documents). A ``Mixture`` hands out the documents of
its streams: draw k takes the next document of source ``i`` with probability ``weights[i] / sum(weights)``, from a
uniform number that is a hash of (seed, dp rank, k) alone. So the sampler's whole state is ``draws``, the number of
draws made, and a resumed mixture draws exactly what the uninterrupted one would have. Weights are shares of
documents (as in ``datasets.interleave_datasets``), not of tokens.
A source that runs out starts its next epoch on its own.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, islice
from typing import Any

from lctrain.data.packing import Document, Pair

# One encoder call takes up to this many items or characters (whichever comes first): enough for the tokenizer's
# threads to share, few enough to bound the memory of the token lists (~40 bytes per token).
ENCODE_ITEMS = 64
# A stream's first call takes this many items, each next one twice as many up to ENCODE_ITEMS: the first row needs a
# few documents, not 64 (a loader opened for a short job or a validation pass would encode them all).
FIRST_ENCODE_ITEMS = 4
ENCODE_CHARACTERS = 4_000_000
SKIP_REASONS = ("overlong", "untrained")  # why an item gives no document: longer than a row (dropped), no target
# what a stream counts: the skipped items, conversations rendered once per turn, turns no generation prompt leads to
COUNTS = (*SKIP_REASONS, "divergent", "unreachable")
_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, dp_rank: int, draw: int) -> float:
    """A number in [0, 1) that depends on (seed, dp rank, draw) only: the sampler's randomness, with no state."""
    return (_splitmix64(_splitmix64(_splitmix64(seed) ^ dp_rank) ^ draw) >> 11) / (1 << 53)


# a text (str), or a chat or preference record and where it is: (JSON text, "file:line"); a prepared item: (its index
# in the prepared set, where it is)
Item = Any
# a document (a pair: one unit of documents), the reason (SKIP_REASONS) the item gives none, or its parts:
# documents and counts (COUNTS)
Encoded = Document | Pair | str | list[Document | str]


def _size(item: Item) -> int:
    """An item's characters (a prepared item's: 0)."""
    text = item if isinstance(item, str) else item[0]
    return len(text) if isinstance(text, str) else 0


def batches(
    items: Iterator[Item],
    most_items: int = ENCODE_ITEMS,
    most_characters: int = ENCODE_CHARACTERS,
    first_items: int | None = None,
) -> Iterator[list[Item]]:
    """``items`` in lists of up to ``most_items`` items or ``most_characters`` characters (whichever comes first);
    with ``first_items``, the first list holds at most that many items and each next one at most twice as many."""
    limit = most_items if first_items is None else min(first_items, most_items)
    batch, characters = [], 0
    for item in items:
        batch.append(item)
        characters += _size(item)
        if len(batch) == limit or characters >= most_characters:
            yield batch
            batch, characters = [], 0
            limit = min(2 * limit, most_items)
    if batch:
        yield batch


class SourceStream:
    """The documents of one source for one dp rank, epoch after epoch, starting after ``document`` items of
    ``epoch`` and ``part`` parts of the next; ``skipped`` holds the ``COUNTS``.

    ``items(epoch)`` gives the source's raw items of an epoch (the same on every call), ``encode(batch)`` one
    ``Encoded`` per item. ``epoch`` and ``document`` always locate the next item to hand out. The next epoch starts
    when a document is asked for after the last item; an epoch without any document is an error naming the source.
    """

    def __init__(
        self,
        items: Callable[[int], Iterator[Item]],
        encode: Callable[[list[Item]], list[Encoded]],
        *,
        description: str,
        dp_rank: int = 0,
        dp_size: int = 1,
        epoch: int = 0,
        document: int = 0,
        part: int = 0,
        skipped: dict[str, int] | None = None,
    ):
        self.items, self.encode, self.description = items, encode, description
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.document, self.part = epoch, document, part
        self.skipped = {reason: 0 for reason in COUNTS} | dict(skipped or {})
        self.last: tuple[int, int] = (document, part)  # (document, part) of the last document handed out
        self._batches: Iterator[list[Item]] | None = None
        self._buffer: deque[Encoded] = deque()
        self._documents = document  # documents handed out this epoch (a resumed epoch counts the ones before)

    def __iter__(self) -> Iterator[Document]:
        return self

    def _open(self) -> Iterator[list[Item]]:
        items = self.items(self.epoch)
        skipped = sum(1 for _ in islice(items, self.document))  # resume: read, not encoded
        if skipped < self.document:
            raise ValueError(
                f"the data state points at document {self.document} of epoch {self.epoch}, but dp rank "
                f"{self.dp_rank} has only {skipped} documents of {self.description} there: the data changed since "
                f"it was saved"
            )
        return batches(items, first_items=FIRST_ENCODE_ITEMS)

    def __next__(self) -> Document:
        while True:
            while not self._buffer:
                if self._batches is None:
                    self._batches = self._open()
                batch = next(self._batches, None)
                if batch is not None:
                    self._buffer.extend(self.encode(batch))
                    continue
                if self.document == 0:
                    raise ValueError(
                        f"dp rank {self.dp_rank} of {self.dp_size} received no documents from {self.description}: "
                        f"use fewer dp ranks or more documents (or more files)"
                    )
                if self._documents == 0:
                    raise ValueError(
                        f"{self.description}: none of the {self.document} records of epoch {self.epoch} gives a "
                        f"document ({self.skipped['untrained']} without a trained token, e.g. no assistant turn "
                        f"with data.train_on=assistant; {self.skipped['overlong']} longer than data.seq_len with "
                        f"data.overlong=drop): fix the data or those settings"
                    )
                self.epoch, self.document, self._documents, self._batches = self.epoch + 1, 0, 0, None
            encoded = self._buffer[0]
            position = (self.document, self.part)
            if isinstance(encoded, list):
                encoded = encoded[self.part]
                self.part += 1
            if not isinstance(self._buffer[0], list) or self.part == len(self._buffer[0]):
                self._buffer.popleft()
                self.document, self.part = self.document + 1, 0
            if isinstance(encoded, (Document, Pair)):
                self._documents += 1
                self.last = position
                return encoded
            self.skipped[encoded] += 1

    def position(self, rewind: bool) -> dict[str, int]:
        """``epoch``, ``document`` and ``part`` of the next document, or (``rewind``) of the last one handed out."""
        document, part = self.last if rewind else (self.document, self.part)
        return {"epoch": self.epoch, "document": document, "part": part}


class Mixture:
    """The documents of ``streams``, draw ``k`` from stream ``i`` with probability ``weights[i] / sum(weights)``
    (``uniform(seed, dp_rank, k)``); ``draws`` counts the draws made, ``last`` is the stream of the latest one."""

    def __init__(
        self, streams: Sequence[SourceStream], weights: Sequence[float], *, seed: int, dp_rank: int, draws: int = 0
    ):
        if len(streams) != len(weights) or not streams:
            raise ValueError(f"{len(streams)} streams and {len(weights)} weights: give one weight per source")
        if min(weights) <= 0:
            raise ValueError(f"weights {list(weights)} must all be > 0")
        self.streams, self.seed, self.dp_rank, self.draws = list(streams), seed, dp_rank, draws
        total = sum(weights)
        self._bounds = [w / total for w in accumulate(weights)][:-1]  # upper ends of all but the last interval
        self.last: int | None = None

    def __iter__(self) -> Iterator[Document]:
        return self

    def pick(self, draw: int) -> int:
        """The stream of draw ``draw``."""
        if not self._bounds:
            return 0
        return bisect.bisect_right(self._bounds, uniform(self.seed, self.dp_rank, draw))

    def __next__(self) -> Document:
        index = self.pick(self.draws)
        document = next(self.streams[index])
        self.draws += 1
        self.last = index
        return document
