"""Exact distributed attention: ring, Ulysses and hybrid USP over blockwise (out, lse) kernels."""

from lctrain.attention.layout import SequencePlace, shard_sequence, unshard_sequence
from lctrain.attention.usp import ring_attention, ulysses_attention, usp_attention

__all__ = [
    "SequencePlace",
    "ring_attention",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
    "usp_attention",
]
