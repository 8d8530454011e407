"""Pack tokenized documents end to end into rows of exactly ``seq_len`` tokens.

Every row holds, with S = seq_len:

- ``input_ids``    ``[S]`` int64: the tokens.
- ``labels``       ``[S]`` int64, shifted on the global row: ``labels[i]`` is the token that follows token i in the
  same document, or -100 when token i is the last token of its document (a document never predicts the next).
- ``position_ids`` ``[S]`` int64: the index of each token within its document; 0 at every document start.
- ``cu_seqlens``   ``[k + 1]`` int32: the boundaries of the k document pieces in the row; starts at 0, ends at S.

A document longer than the room left in a row continues at the start of the next row, positions continuing; the
row's last label is then the next row's first token. With ``truncate=True`` the rest of such a document is
dropped instead, and its last kept token gets label -100. For example, documents [a b c] [d e] and S = 4:

    row 0: input_ids [a b c d]  labels [b c -100 e]     position_ids [0 1 2 0]  cu_seqlens [0 3 4]
    row 1: input_ids [e ...]    labels [-100 ...]       position_ids [1 ...]    cu_seqlens [0 1 ...]
    (truncate=True: row 0 labels [b c -100 -100]; e is dropped and row 1 starts with the next document)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedRow:
    """One packed row; shapes in the module docstring."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor


class Packer:
    """Iterator of ``PackedRow`` over an iterator of documents (1-D int64 token tensors), pulled lazily.

    ``offset`` is the number of tokens of the document in progress already placed in earlier rows, 0 when the last
    row ended at a document end (always 0 with ``truncate``). A packer built with ``offset=k`` drops the first k
    tokens of its first document and continues its positions at k: this resumes a partly emitted document. Only
    full rows are yielded: when a finite input runs out, the leftover (< seq_len tokens) is dropped.
    """

    def __init__(self, documents: Iterable[Tensor], seq_len: int, *, truncate: bool = False, offset: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if offset < 0 or (truncate and offset):
            raise ValueError(f"offset={offset} must be >= 0, and 0 with truncate=True")
        self.seq_len = seq_len
        self.truncate = truncate
        self.offset = offset
        self._documents = iter(documents)
        self._document: Tensor | None = None  # the document in progress, pulled but not fully placed

    def __iter__(self) -> Iterator[PackedRow]:
        return self

    def __next__(self) -> PackedRow:
        size = self.seq_len
        input_ids = torch.empty(size, dtype=torch.int64)
        labels = torch.empty(size, dtype=torch.int64)
        position_ids = torch.empty(size, dtype=torch.int64)
        bounds = [0]
        filled = 0
        while filled < size:
            if self._document is None:
                self._document = next(self._documents)  # StopIteration ends the packing; this row is dropped
            document = self._document
            if not len(document):  # an empty document adds nothing
                self._document = None
                continue
            start = self.offset
            if start and start >= len(document):
                raise ValueError(
                    f"offset={start} is not inside the next document ({len(document)} tokens): the resumed state "
                    f"does not match the data"
                )
            take = min(len(document) - start, size - filled)
            end = start + take
            row = slice(filled, filled + take)
            input_ids[row] = document[start:end]
            position_ids[row] = torch.arange(start, end)
            if end == len(document) or self.truncate:  # the document ends in this row (or is cut here)
                labels[filled : filled + take - 1] = document[start + 1 : end]
                labels[filled + take - 1] = IGNORE_INDEX
                self._document = None
                self.offset = 0
            else:  # continues in the next row: one token of look-ahead into the same document
                labels[row] = document[start + 1 : end + 1]
                self.offset = end
            filled += take
            bounds.append(filled)
        return PackedRow(input_ids, labels, position_ids, torch.tensor(bounds, dtype=torch.int32))
