"""The one FLOP count behind every MFU lctrain reports (the trainer's metrics line, the layout planner, the
benchmarks). Plain arithmetic."""

from __future__ import annotations

from collections.abc import Sequence


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward matmuls) plus causal attention,
    6·layers·hidden·seq_len (half of the 12·L·H·S of full attention)."""
    return 6 * num_params + 6 * num_layers * hidden_size * seq_len


def document_flops_per_token(num_params: int, num_layers: int, hidden_size: int, doc_lengths: Sequence[int]) -> float:
    """``flops_per_token`` of a packed row counted on the attention it really has: each token attends to the earlier
    tokens of its own document only. The causal term becomes 6·layers·hidden·Σd²/S for documents of lengths d
    (S = Σd): the row's visible (query, key) pairs, Σd²/2, instead of S²/2. One document gives ``flops_per_token``."""
    seq_len = sum(doc_lengths)
    return 6 * num_params + 6 * num_layers * hidden_size * sum(d * d for d in doc_lengths) / seq_len
