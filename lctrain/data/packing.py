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

A preference pair (``Pair``: prompt p[0..P-1], chosen c[0..C-1], rejected r[0..R-1]) is never split either, and
packs as several documents. Shared (the default) as three, the answers continuing the prompt's positions and each
seeing the prompt's document as its shared prefix (``doc_prefix``), never the other answer; the last prompt token is
repeated at the head of each answer, so that each answer's first token is predicted inside its own document:

    documents     [p0 .. p(P-2)]   [p(P-1) c0 .. c(C-1)]   [p(P-1) r0 .. r(R-1)]
    doc_prefix         -1                  d                       d            (d: the prompt's document)
    position_ids  0 .. P-2         P-1  P  .. P+C-1        P-1  P  .. P+R-1
    labels        -100 ..          c0 c1 .. -100           r0 r1 .. -100
    completions   -1 ..            2k 2k .. -1             2k+1 .. -1           (pair k of the row)

With a one-token prompt there is no prompt document (both answers' doc_prefix -1). Unshared: two plain documents
[p c] and [p r], positions from 0. The trained tokens are exactly the completions' tokens. Each row also holds:

- ``doc_prefix``   ``[k]`` int64: for each document of the row, the index of the document it sees whole as its
  shared prefix, -1 for none (every document but a shared pair's answers).
- ``completions``  ``[S]`` int64: for each trained token of a pair (``labels[i]`` != -100), its completion: ``2k``
  for pair k's chosen, ``2k + 1`` for its rejected (pairs numbered within the row); -1 elsewhere.
- ``pair_ids``     ``[K]`` int64: the identity of each of the row's K pairs (``Pair.pair_id``).
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
    doc_prefix: Tensor
    completions: Tensor
    pair_ids: Tensor


@dataclass(frozen=True)
class Pair:
    """One preference pair to pack, never split across rows: ``prompt`` ``[P]``, ``chosen`` ``[C]`` and ``rejected``
    ``[R]`` int64 token ids (each at least one token); its ``source`` index, its identity ``pair_id``, and whether
    the answers share the prompt (``shared``) or repeat it (the layouts in the module docstring)."""

    prompt: Tensor
    chosen: Tensor
    rejected: Tensor
    source: int = 0
    pair_id: int = 0
    shared: bool = True
    splittable = False  # not a field: a pair always fits in one row

    def __len__(self) -> int:
        # shared: (P - 1) + (1 + C) + (1 + R); unshared: (P + C) + (P + R)
        prompt = len(self.prompt) + 1 if self.shared else 2 * len(self.prompt)
        return prompt + len(self.chosen) + len(self.rejected)

    def documents(self) -> list[Piece]:
        """The pair's documents in order (the layouts in the module docstring); a ``Piece``'s ``completions`` are 0
        (chosen), 1 (rejected) or -1, its ``prefix`` an index among the pair's documents."""
        size = len(self.prompt)
        pieces = []
        if self.shared and size > 1:  # the shared prompt's document: nothing trained
            ignored, none = torch.full((size - 1,), IGNORE_INDEX), torch.full((size - 1,), -1)
            pieces.append(Piece(self.prompt[:-1], torch.arange(size - 1), ignored, none))
        prefix = 0 if pieces else -1  # the answers see the prompt's document, if there is one
        prompt = self.prompt[-1:] if self.shared else self.prompt
        start = size - len(prompt)  # the answers continue the prompt's positions
        for completion, answer in enumerate((self.chosen, self.rejected)):
            tokens = torch.cat([prompt, answer])
            # token i predicts tokens[i + 1]: the answer's tokens are trained, the last token predicts nothing
            trained = torch.cat([torch.arange(len(tokens) - 1) >= len(prompt) - 1, torch.tensor([False])])
            following = torch.cat([tokens[1:], tokens[:1]])
            labels = torch.where(trained, following, IGNORE_INDEX)
            positions = torch.arange(start, start + len(tokens))
            pieces.append(Piece(tokens, positions, labels, torch.where(trained, completion, -1), prefix))
        return pieces


@dataclass(frozen=True)
class Piece:
    """One document of a row (or its part in this row): ``tokens``, ``positions``, ``labels`` ``[n]`` int64;
    ``completions`` ``[n]`` int64 (a pair's answers: 0 or 1 at the trained tokens, -1 elsewhere; None = -1 all);
    ``prefix``: the index of the document it sees whole as its shared prefix, counted from this one's pair (-1:
    none)."""

    tokens: Tensor
    positions: Tensor
    labels: Tensor
    completions: Tensor | None = None
    prefix: int = -1


class _Row:
    """A row being filled, document after document."""

    def __init__(self, size: int):
        self.input_ids = torch.empty(size, dtype=torch.int64)
        self.labels = torch.empty(size, dtype=torch.int64)
        self.position_ids = torch.empty(size, dtype=torch.int64)
        self.sources = torch.empty(size, dtype=torch.int16)
        self.completions = torch.full((size,), -1, dtype=torch.int64)
        self.bounds, self.prefixes, self.pair_ids = [0], [], []

    @property
    def filled(self) -> int:
        return self.bounds[-1]

    def write(self, piece: Piece, source: int, first: int = 0) -> None:
        """Append ``piece`` as the next document; ``first``: the row's index of the first document of its pair."""
        row = slice(self.filled, self.filled + len(piece.tokens))
        self.input_ids[row], self.position_ids[row], self.labels[row] = piece.tokens, piece.positions, piece.labels
        self.sources[row] = source
        if piece.completions is not None:
            pair = 2 * len(self.pair_ids)
            self.completions[row] = torch.where(piece.completions >= 0, piece.completions + pair, -1)
        self.bounds.append(row.stop)
        self.prefixes.append(first + piece.prefix if piece.prefix >= 0 else -1)

    def packed(self) -> PackedRow:
        return PackedRow(
            self.input_ids,
            self.labels,
            self.position_ids,
            torch.tensor(self.bounds, dtype=torch.int32),
            self.sources,
            torch.tensor(self.prefixes, dtype=torch.int64),
            self.completions,
            torch.tensor(self.pair_ids, dtype=torch.int64),
        )


class Packer:
    """Iterator of ``PackedRow`` over an iterator of documents (``Document``, ``Pair``, or a 1-D int64 token tensor:
    a text document of source 0), pulled lazily.

    ``offset`` is the number of tokens of the document in progress already placed in earlier rows, 0 when the last
    row ended at a document end (always 0 with ``truncate``, and after a conversation). A packer built with
    ``offset=k`` drops the first k tokens of its first document and continues its positions at k: this resumes a
    partly emitted document. Only full rows are yielded: when a finite input runs out, the leftover (< seq_len
    tokens) is dropped. A conversation or pair waiting for the next row is held as the document in progress with
    offset 0.
    """

    def __init__(
        self,
        documents: Iterable[Document | Pair | Tensor],
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
        self._document: Document | Pair | None = None  # the document in progress, pulled but not fully placed

    def __iter__(self) -> Iterator[PackedRow]:
        return self

    @property
    def holds_document(self) -> bool:
        """Whether a pulled document is not fully placed yet (partly emitted, or a conversation or pair waiting for a
        row)."""
        return self._document is not None

    def _next_document(self) -> Document | Pair:
        document = next(self._documents)  # StopIteration ends the packing; the row in progress is dropped
        if isinstance(document, Tensor):
            return Document(document)
        if not document.splittable and len(document) > self.seq_len:
            what = "pair" if isinstance(document, Pair) else "conversation"
            raise ValueError(
                f"a {what} of {len(document)} tokens does not fit in a row of seq_len={self.seq_len}: the loader "
                f"drops or truncates such {what}s first (data.overlong)"
            )
        return document

    def __next__(self) -> PackedRow:
        size = self.seq_len
        row = _Row(size)
        while row.filled < size:
            if self._document is None:
                self._document = self._next_document()
            document = self._document
            if not len(document):  # an empty document adds nothing
                self._document = None
                continue
            room = size - row.filled
            if not document.splittable and len(document) > room:  # waits for the next row: pad this one
                padding = torch.full((room,), self.pad_id)
                row.write(Piece(padding, torch.arange(room), torch.full((room,), IGNORE_INDEX)), source=0)
                break
            if isinstance(document, Pair):
                first = len(row.prefixes)
                for piece in document.documents():
                    row.write(piece, document.source, first)
                row.pair_ids.append(document.pair_id)
                self._document = None
                continue
            start = self.offset
            if start and start >= len(document):
                raise ValueError(
                    f"offset={start} is not inside the next document ({len(document)} tokens): the resumed state "
                    f"does not match the data"
                )
            end = start + min(len(document) - start, room)
            tokens = document.tokens
            # the label of each token is the next one of its document, where that one is trained
            labels = tokens[start + 1 : end + 1]
            if document.trained is not None:
                labels = torch.where(document.trained[start + 1 : end + 1], labels, IGNORE_INDEX)
            if end == len(document) or self.truncate:  # the document ends in this row (or is cut here)
                labels = torch.cat([labels[: end - start - 1], torch.tensor([IGNORE_INDEX])])
                self._document = None
                self.offset = 0
            else:  # continues in the next row: one token of look-ahead into the same document
                self.offset = end
            row.write(Piece(tokens[start:end], torch.arange(start, end), labels), document.source)
        return row.packed()
