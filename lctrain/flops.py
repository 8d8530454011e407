"""The one FLOP count behind every MFU lctrain reports (the trainer's metrics line, the layout planner, the
benchmarks). Plain arithmetic."""

from __future__ import annotations


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward matmuls) plus causal attention,
    6·layers·hidden·seq_len (half of the 12·L·H·S of full attention)."""
    return 6 * num_params + 6 * num_layers * hidden_size * seq_len
