"""The key-token loss's window pass: each block of window / 2 tokens predicted from itself and the block before it,
inside its document, positions from 0, labelled on the block only; padded to the mesh's multiple; and the window
refused when it is not shorter than the rows."""

from __future__ import annotations

import pytest
import torch

from lctrain.data import IGNORE_INDEX
from lctrain.train.key_tokens import check_key_window, windowed_row


def test_every_labelled_token_is_predicted_once_from_its_window() -> None:
    # two documents (10 and 7 tokens) in a row of 17; the last token of each has no label
    ids = torch.arange(100, 117)[None]
    labels = torch.cat(
        [torch.arange(101, 110), torch.tensor([IGNORE_INDEX]), torch.arange(111, 117), torch.tensor([IGNORE_INDEX])]
    )
    positions = torch.cat([torch.arange(10), torch.arange(7)])[None]
    bounds = [torch.tensor([0, 10, 17], dtype=torch.int32)]
    row = {"input_ids": ids, "labels": labels[None], "position_ids": positions, "cu_seqlens": bounds}
    short, origin = windowed_row(row, window=4, divisor=8)
    bounds = short["cu_seqlens"][0].tolist()
    assert bounds[-1] % 8 == 0 and short["input_ids"].shape == (1, bounds[-1]) == short["labels"].shape
    # each labelled token appears once, with its own label, after 2 (or fewer, at a document's start) to 3 tokens of
    # its document before it; the context tokens carry no label
    assert sorted(origin[origin >= 0].tolist()) == [t for t in range(17) if labels[t] != IGNORE_INDEX]
    for j in (origin >= 0).nonzero()[:, 0].tolist():
        t = origin[j].item()
        assert short["labels"][0, j] == labels[t] and short["input_ids"][0, j] == ids[0, t]
        document = next(i for i in range(len(bounds) - 1) if bounds[i] <= j < bounds[i + 1])
        seen = j - bounds[document]  # tokens before it in its window document
        start = 0 if t < 10 else 10
        assert seen == short["position_ids"][0, j] and seen <= 3 and (seen >= 2 or t - start == seen)
        assert torch.equal(short["input_ids"][0, j - seen : j], ids[0, t - seen : t])
    assert (short["labels"][0, origin < 0] == IGNORE_INDEX).all()


def test_a_window_as_long_as_the_rows_is_refused() -> None:
    check_key_window(0, 1024)
    check_key_window(512, 1024)
    with pytest.raises(ValueError, match="train.val_key_window=1024 must be shorter than data.seq_len=1024"):
        check_key_window(1024, 1024)
