"""Packer: rows of exactly seq_len tokens, globally shifted labels, per-document positions, cu_seqlens; documents
with their own trained tokens, and conversations that are never split across rows."""

import random

import pytest
import torch

from lctrain.data.packing import IGNORE_INDEX, Document, PackedRow, Packer

IGNORE = IGNORE_INDEX


def pack(docs: list[list[int]], seq_len: int, truncate: bool = False) -> list[PackedRow]:
    return list(Packer((torch.tensor(d, dtype=torch.int64) for d in docs), seq_len, truncate=truncate))


def as_lists(row: PackedRow) -> tuple[list[int], list[int], list[int], list[int]]:
    return row.input_ids.tolist(), row.labels.tolist(), row.position_ids.tolist(), row.cu_seqlens.tolist()


def reference_rows(docs: list[list[int]], seq_len: int, truncate: bool) -> list[list[tuple[int, int, int]]]:
    """(token, label, position) per slot, token by token: the obviously-correct packer."""
    rows: list[list[tuple[int, int, int]]] = []
    row: list[tuple[int, int, int]] = []
    for doc in docs:
        kept = doc[: seq_len - len(row)] if truncate else doc
        for j, token in enumerate(kept):
            row.append((token, kept[j + 1] if j + 1 < len(kept) else IGNORE, j))
            if len(row) == seq_len:
                rows.append(row)
                row = []
    return rows


def test_pack_gives_the_rows_of_its_docstring_example() -> None:
    a, b, c, d, e, f = 10, 11, 12, 13, 14, 15
    rows = pack([[a, b, c], [d, e], [f, f, f]], seq_len=4)
    assert as_lists(rows[0]) == ([a, b, c, d], [b, c, IGNORE, e], [0, 1, 2, 0], [0, 3, 4])
    assert as_lists(rows[1]) == ([e, f, f, f], [IGNORE, f, f, IGNORE], [1, 0, 1, 2], [0, 1, 4])
    assert len(rows) == 2


def test_truncate_drops_the_rest_of_a_document() -> None:
    a, b, c, d, e, f = 10, 11, 12, 13, 14, 15
    rows = pack([[a, b, c], [d, e], [f, f, f, f, f]], seq_len=4, truncate=True)
    # e is dropped; d is the last kept token of its document, so it predicts nothing.
    assert as_lists(rows[0]) == ([a, b, c, d], [b, c, IGNORE, IGNORE], [0, 1, 2, 0], [0, 3, 4])
    assert as_lists(rows[1]) == ([f, f, f, f], [f, f, f, IGNORE], [0, 1, 2, 3], [0, 4])
    assert len(rows) == 2


def test_document_spanning_several_rows() -> None:
    doc = list(range(100, 110))
    rows = pack([doc, [7, 8]], seq_len=4)
    assert [as_lists(r) for r in rows] == [
        ([100, 101, 102, 103], [101, 102, 103, 104], [0, 1, 2, 3], [0, 4]),
        ([104, 105, 106, 107], [105, 106, 107, 108], [4, 5, 6, 7], [0, 4]),
        ([108, 109, 7, 8], [109, IGNORE, 8, IGNORE], [8, 9, 0, 1], [0, 2, 4]),
    ]


def test_document_ending_exactly_at_row_end() -> None:
    rows = pack([[1, 2, 3, 4], [5, 6, 7, 8]], seq_len=4)
    assert as_lists(rows[0]) == ([1, 2, 3, 4], [2, 3, 4, IGNORE], [0, 1, 2, 3], [0, 4])
    assert as_lists(rows[1]) == ([5, 6, 7, 8], [6, 7, 8, IGNORE], [0, 1, 2, 3], [0, 4])


def test_length_one_and_empty_documents() -> None:
    rows = pack([[1], [], [2], [3, 4, 5], [6]], seq_len=3)
    assert as_lists(rows[0]) == ([1, 2, 3], [IGNORE, IGNORE, 4], [0, 0, 0], [0, 1, 2, 3])
    assert as_lists(rows[1]) == ([4, 5, 6], [5, IGNORE, IGNORE], [1, 2, 0], [0, 2, 3])


def test_rows_hold_seq_len_int64_tokens_and_int32_cu_seqlens() -> None:
    row = pack([[1, 2, 3, 4, 5]], seq_len=4)[0]
    for x in (row.input_ids, row.labels, row.position_ids):
        assert x.dtype == torch.int64 and x.shape == (4,)
    assert row.cu_seqlens.dtype == torch.int32


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_random_lengths_match_token_by_token_reference(seed: int, truncate: bool) -> None:
    rng = random.Random(seed)
    seq_len = rng.choice([1, 2, 5, 16, 64])
    docs = [[rng.randrange(50_000) for _ in range(rng.choice([1, 1, 2, 3, 17, 40, 150]))] for _ in range(60)]
    rows = pack(docs, seq_len, truncate=truncate)
    expected = reference_rows(docs, seq_len, truncate)
    assert len(rows) == len(expected) > 0
    for row, want in zip(rows, expected):
        ids, labels, positions, cu = as_lists(row)
        assert list(zip(ids, labels, positions)) == want
        starts = [i for i, (_, _, pos) in enumerate(want) if pos == 0 and i > 0]
        assert cu == [0, *starts, seq_len]
    if not truncate:  # concatenating the rows reproduces the token stream (minus the unfinished last row)
        stream = [t for d in docs for t in d]
        packed = torch.cat([r.input_ids for r in rows]).tolist()
        assert packed == stream[: len(packed)] and len(stream) - len(packed) < seq_len


@pytest.mark.parametrize("truncate", [False, True])
def test_restart_from_offset_continues_exactly(truncate: bool) -> None:
    rng = random.Random(1)
    docs = [torch.randint(0, 1000, (rng.randint(1, 40),)) for _ in range(50)]
    pulled = 0

    def counted():
        nonlocal pulled
        for d in docs:
            pulled += 1
            yield d

    packer = Packer(counted(), 16, truncate=truncate)
    full = list(packer)
    for step in range(1, len(full)):
        pulled = 0
        packer = Packer(counted(), 16, truncate=truncate)
        for _ in range(step):
            next(packer)
        done = pulled - (1 if packer.offset else 0)  # documents completely emitted
        resumed = list(Packer(iter(docs[done:]), 16, truncate=truncate, offset=packer.offset))
        assert [as_lists(r) for r in resumed] == [as_lists(r) for r in full[step:]]


def test_bad_seq_len_and_offsets_are_refused() -> None:
    with pytest.raises(ValueError, match="seq_len=0"):
        Packer(iter([]), 0)
    with pytest.raises(ValueError, match="offset=3"):
        Packer(iter([]), 4, truncate=True, offset=3)
    with pytest.raises(ValueError, match="offset=5 is not inside the next document"):
        next(Packer(iter([torch.arange(5)]), 4, offset=5))


def test_conversation_docstring_example() -> None:
    a, b, c, u, v, w, pad = 10, 11, 12, 20, 21, 22, 0
    conversation = Document(torch.tensor([u, v, w]), torch.tensor([False, False, True]), source=1, splittable=False)
    rows = list(Packer(iter([torch.tensor([a, b, c]), conversation, torch.tensor([a, a, a, a])]), 4))
    assert as_lists(rows[0]) == ([a, b, c, pad], [b, c, IGNORE, IGNORE], [0, 1, 2, 0], [0, 3, 4])
    assert as_lists(rows[1]) == ([u, v, w, a], [IGNORE, w, IGNORE, a], [0, 1, 2, 0], [0, 3, 4])
    assert rows[0].sources.tolist() == [0, 0, 0, 0] and rows[1].sources.tolist() == [1, 1, 1, 0]
    assert rows[0].sources.dtype == torch.int16


def reference_mixed_rows(docs: list[Document], seq_len: int) -> list[list[tuple[int, int, int, int]]]:
    """(token, label, position, source) per slot, token by token: text continues into the next row; a conversation
    that does not fit in the room left pads the row (token 0, label -100, positions from 0) and starts the next."""
    rows: list[list[tuple[int, int, int, int]]] = []
    row: list[tuple[int, int, int, int]] = []
    for doc in docs:
        tokens = doc.tokens.tolist()
        trained = [True] * len(tokens) if doc.trained is None else doc.trained.tolist()
        if not doc.splittable and len(tokens) > seq_len - len(row) and row:
            row += [(0, IGNORE, j, 0) for j in range(seq_len - len(row))]
            rows.append(row)
            row = []
        for j, token in enumerate(tokens):
            label = tokens[j + 1] if j + 1 < len(tokens) and trained[j + 1] else IGNORE
            row.append((token, label, j, doc.source))
            if len(row) == seq_len:
                rows.append(row)
                row = []
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_mixed_documents_match_token_by_token_reference(seed: int) -> None:
    rng = random.Random(seed)
    seq_len = rng.choice([8, 16, 64])
    docs = []
    for _ in range(80):
        length = rng.choice([1, 2, 3, 7, 17, 40])
        tokens = torch.tensor([rng.randrange(1, 50_000) for _ in range(length)])
        if rng.random() < 0.5 and length <= seq_len:  # a conversation: some tokens trained
            trained = torch.tensor([rng.random() < 0.5 for _ in range(length)])
            docs.append(Document(tokens, trained, source=1, splittable=False))
        else:
            docs.append(Document(tokens, source=2))
    rows = list(Packer(iter(docs), seq_len))
    expected = reference_mixed_rows(docs, seq_len)
    assert len(rows) == len(expected) > 0
    for row, want in zip(rows, expected):
        ids, labels, positions, cu = as_lists(row)
        assert list(zip(ids, labels, positions, row.sources.tolist())) == want
        starts = [i for i, (_, _, pos, _) in enumerate(want) if pos == 0 and i > 0]
        assert cu == [0, *starts, seq_len]


def test_a_conversation_longer_than_a_row_is_refused() -> None:
    conversation = Document(torch.arange(5), torch.ones(5, dtype=torch.bool), splittable=False)
    with pytest.raises(ValueError, match="a conversation of 5 tokens does not fit in a row of seq_len=4"):
        next(Packer(iter([conversation]), 4))
