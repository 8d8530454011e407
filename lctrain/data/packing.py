"""Pack tokenized documents end to end into rows of exactly ``seq_len`` tokens.

Every row holds, with S = seq_len:

- ``input_ids``    ``[S]`` int64: the tokens.
- ``labels``       ``[S]`` int64, shifted on the global row: ``labels[i]`` is the token that follows token i in the
  same document when that token is trained, else -100; -100 when token i is the last token of its document (a
  document never predicts the next).
- ``position_ids`` ``[S]`` int64: the index of each token within its document; 0 at every document start.
- ``cu_seqlens``   ``[k + 1]`` int32: the boundaries of the k document pieces in the row; starts at 0, ends at S.
- ``sources``      ``[S]`` int16: the index of the source each token comes from (``data.sources``; 0 for one).

A document is a ``Document``: its tokens, which of them are trained (a text document: all; a conversation: the
assistant's, ``lctrain.data.chat``), its source, and whether it may be split across rows. A text document longer
than the room left in a row continues at the start of the next row, positions continuing; the row's last label is
then the next row's first token. With ``truncate=True`` the rest of such a document is dropped instead, and its last
kept token gets label -100. For example, documents [a b c] [d e] and S = 4:

    row 0: input_ids [a b c d]  labels [b c -100 e]     position_ids [0 1 2 0]  cu_seqlens [0 3 4]
    row 1: input_ids [e ...]    labels [-100 ...]       position_ids [1 ...]    cu_seqlens [0 1 ...]
    (truncate=True: row 0 labels [b c -100 -100]; e is dropped and row 1 starts with the next document)

A conversation is never split: one that does not fit in the room left ends the row, whose rest is padding (a
document of its own of ``pad_id`` tokens, positions from 0, labels -100), and starts the next row. With documents
[a b c] (text) and the conversation [u v w] (w trained only) and S = 4:

    row 0: input_ids [a b c p]  labels [b c -100 -100]  position_ids [0 1 2 0]  cu_seqlens [0 3 4]
    row 1: input_ids [u v w ..] labels [-100 w -100 ..] position_ids [0 1 2 ..] cu_seqlens [0 3 ..]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Document:
    """One document to pack: ``tokens`` ``[n]`` int64; ``trained`` ``[n]`` bool, whether token i is a target (the
    label of token i - 1 carries loss), None = every token; the ``source`` index; ``splittable``: may continue into
    the next row (text), or must fit in one row (a conversation, at most ``seq_len`` tokens)."""

    tokens: Tensor
    trained: Tensor | None = None
    source: int = 0
    splittable: bool = True

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PackedRow:
    """One packed row; shapes in the module docstring."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    sources: Tensor


class Packer:
    """Iterator of ``PackedRow`` over an iterator of documents (``Document``, or a 1-D int64 token tensor: a text
    document of source 0), pulled lazily.

    ``offset`` is the number of tokens of the document in progress already placed in earlier rows, 0 when the last
    row ended at a document end (always 0 with ``truncate``, and after a conversation). A packer built with
    ``offset=k`` drops the first k tokens of its first document and continues its positions at k: this resumes a
    partly emitted document. Only full rows are yielded: when a finite input runs out, the leftover (< seq_len
    tokens) is dropped. A conversation waiting for the next row is held as the document in progress with offset 0.
    """

    def __init__(
        self,
        documents: Iterable[Document | Tensor],
        seq_len: int,
        *,
        truncate: bool = False,
        offset: int = 0,
        pad_id: int = 0,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if offset < 0 or (truncate and offset):
            raise ValueError(f"offset={offset} must be >= 0, and 0 with truncate=True")
        self.seq_len = seq_len
        self.truncate = truncate
        self.offset = offset
        self.pad_id = pad_id
        self._documents = iter(documents)
        self._document: Document | None = None  # the document in progress, pulled but not fully placed

    def __iter__(self) -> Iterator[PackedRow]:
        return self

    @property
    def holds_document(self) -> bool:
        """Whether a pulled document is not fully placed yet (partly emitted, or a conversation waiting for a row)."""
        return self._document is not None

    def _next_document(self) -> Document:
        document = next(self._documents)  # StopIteration ends the packing; the row in progress is dropped
        if isinstance(document, Tensor):
            return Document(document)
        if not document.splittable and len(document) > self.seq_len:
            raise ValueError(
                f"a conversation of {len(document)} tokens does not fit in a row of seq_len={self.seq_len}: the "
                f"loader drops or truncates such conversations first (data.overlong)"
            )
        return document

    def __next__(self) -> PackedRow:
        size = self.seq_len
        input_ids = torch.empty(size, dtype=torch.int64)
        labels = torch.empty(size, dtype=torch.int64)
        position_ids = torch.empty(size, dtype=torch.int64)
        sources = torch.empty(size, dtype=torch.int16)
        bounds = [0]
        filled = 0
        while filled < size:
            if self._document is None:
                self._document = self._next_document()
            document = self._document
            if not len(document):  # an empty document adds nothing
                self._document = None
                continue
            if not document.splittable and len(document) > size - filled:  # waits for the next row: pad this one
                row = slice(filled, size)
                input_ids[row] = self.pad_id
                labels[row] = IGNORE_INDEX
                position_ids[row] = torch.arange(size - filled)
                sources[row] = 0
                bounds.append(size)
                break
            start = self.offset
            if start and start >= len(document):
                raise ValueError(
                    f"offset={start} is not inside the next document ({len(document)} tokens): the resumed state "
                    f"does not match the data"
                )
            take = min(len(document) - start, size - filled)
            end = start + take
            row = slice(filled, filled + take)
            tokens = document.tokens
            input_ids[row] = tokens[start:end]
            position_ids[row] = torch.arange(start, end)
            sources[row] = document.source
            # the label of each token is the next one of its document, where that one is trained
            following = tokens[start + 1 : end + 1]
            if document.trained is not None:
                following = torch.where(document.trained[start + 1 : end + 1], following, IGNORE_INDEX)
            if end == len(document) or self.truncate:  # the document ends in this row (or is cut here)
                labels[filled : filled + take - 1] = following[: take - 1]
                labels[filled + take - 1] = IGNORE_INDEX
                self._document = None
                self.offset = 0
            else:  # continues in the next row: one token of look-ahead into the same document
                labels[row] = following
                self.offset = end
            filled += take
            bounds.append(filled)
        return PackedRow(input_ids, labels, position_ids, torch.tensor(bounds, dtype=torch.int32), sources)
