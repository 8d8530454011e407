"""FLOPs per token, the figure MFU divides by: parameters and causal attention, sliding windows against a brute-force
count of the visible pairs, packed rows of several documents."""

from __future__ import annotations

import pytest

from lctrain.flops import document_flops_per_token, flops_per_token


def test_flops_per_token_counts_parameters_and_causal_attention() -> None:
    assert flops_per_token(1000, 3, 32, 64) == 6 * 1000 + 6 * 3 * 32 * 64


def test_windowed_flops_count_the_pairs_each_layer_sees() -> None:
    """Per layer 12·hidden × visible pairs per token: a sliding window of W keys gives Σ min(i, W) / S pairs per
    token, counted here by brute force (the formula's continuous S/2 vs (S+1)/2 aside, the same difference as the
    causal count's); a window no shorter than the row is plain causal attention."""
    seq, window, hidden = 4096, 512, 32
    visible = sum(min(i, window) for i in range(1, seq + 1)) / seq
    one_window = flops_per_token(0, 1, hidden, seq, [window]) / (12 * hidden)
    assert abs(one_window - visible) <= 0.5 * window / seq
    assert abs(flops_per_token(0, 1, hidden, seq) / (12 * hidden) - sum(range(1, seq + 1)) / seq) == 0.5
    assert flops_per_token(1000, 2, hidden, seq, [seq, None]) == flops_per_token(1000, 2, hidden, seq)
    mixed = flops_per_token(1000, 3, hidden, seq, [None, window, window])  # Qwen: the first layers without
    assert mixed == 6 * 1000 + flops_per_token(0, 1, hidden, seq) + 2 * flops_per_token(0, 1, hidden, seq, [window])
    with pytest.raises(ValueError, match="2 windows for 3 layers"):
        flops_per_token(1000, 3, hidden, seq, [None, window])


def test_document_flops_count_the_visible_attention_of_packed_rows() -> None:
    assert document_flops_per_token(1000, 3, 32, [64]) == flops_per_token(1000, 3, 32, 64)
    attention = flops_per_token(0, 3, 32, 64)
    assert document_flops_per_token(0, 3, 32, [16] * 4) == attention / 4  # 4 documents: 1/4 of the pairs
    assert document_flops_per_token(1000, 3, 32, [48, 16]) == 6 * 1000 + attention * (48**2 + 16**2) / 64**2
