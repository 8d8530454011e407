"""The one FLOP count behind every MFU lctrain reports (the trainer's metrics line, the layout planner, the
benchmarks), and MFU itself. Plain arithmetic."""

from __future__ import annotations

from collections.abc import Sequence


def attention_pairs_per_token(seq_len: int, window: int | None = None) -> float:
    """Visible (query, key) pairs per token of a causal row of ``seq_len`` tokens: S/2, or with a sliding window of
    W keys (each query sees its last W tokens) W − W²/(2S) when W < S (the first W queries see fewer)."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def delta_rule_flops_per_token(value_heads: int, key_dim: int, value_dim: int, chunk: int = 64) -> float:
    """Training FLOPs per token of one gated delta (linear-attention) layer's chunked recurrence, its projections
    aside (counted with the parameters): per value head, the chunk's products (keys with keys, queries with keys,
    the chunk's mixing of the beta-scaled values and keys and of the corrected values: 2·chunk·(3·dk + 2·dv)) and
    the state's (read by the queries and the keys, updated: 3 · 2·dk·dv), forward and backward (3x). Independent of
    the sequence length."""
    forward = 2 * chunk * (3 * key_dim + 2 * value_dim) + 6 * key_dim * value_dim
    return 3 * value_heads * forward


def flops_per_token(
    num_params: int,
    num_layers: int,
    hidden_size: int,
    seq_len: int,
    windows: Sequence[int | None] = (),
    linear: Sequence[bool] = (),
    delta_rule: float = 0.0,
) -> float:
    """Training FLOPs per token: 6 per parameter (forward and backward matmuls) plus causal attention,
    12·hidden per visible pair and layer: 6·layers·hidden·seq_len without windows (half of the 12·L·H·S of full
    attention). ``windows``: each layer's sliding window (``layer_windows``; None = full causal), () = none.
    ``linear``: whether each layer is a gated delta layer (a hybrid's), which attends to no pair and counts
    ``delta_rule`` (``delta_rule_flops_per_token``) instead; () = none."""
    for name, given in (("windows", windows), ("linear", linear)):
        if given and len(given) != num_layers:
            raise ValueError(f"flops_per_token: {len(given)} {name} for {num_layers} layers")
    kinds = linear or [False] * num_layers
    pairs = sum(
        attention_pairs_per_token(seq_len, window)
        for window, is_linear in zip(windows or [None] * num_layers, kinds)
        if not is_linear
    )
    return 6 * num_params + 12 * hidden_size * pairs + sum(kinds) * delta_rule


def document_flops_per_token(num_params: int, num_layers: int, hidden_size: int, doc_lengths: Sequence[int]) -> float:
    """``flops_per_token`` of a packed row counted on the attention it really has: each token attends to the earlier
    tokens of its own document only. The causal term becomes 6·layers·hidden·Σd²/S for documents of lengths d
    (S = Σd): the row's visible (query, key) pairs, Σd²/2, instead of S²/2. One document gives ``flops_per_token``."""
    seq_len = sum(doc_lengths)
    return 6 * num_params + 6 * num_layers * hidden_size * sum(d * d for d in doc_lengths) / seq_len


def mfu(tokens_per_s: float, per_token: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilization: ``tokens_per_s`` (all ``devices`` together) × FLOPs ``per_token`` over the devices'
    peak FLOP/s (``peak`` each); None when the peak is unknown."""
    return None if peak is None else tokens_per_s * per_token / (devices * peak)
