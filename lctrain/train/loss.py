"""Token-summed cross-entropy over the vocabulary head, computed in chunks of tokens.

At long context the logits ``[tokens, vocab]`` are the largest activation of the model (128K tokens × 128K vocab
in fp32 is 64 GiB). ``chunked_cross_entropy`` never holds more than ``chunk_tokens × vocab`` of them: each chunk's
logits are computed, reduced to a loss and freed, and recomputed in the backward (activation checkpointing).

The caller divides the sum by the number of valid tokens over every rank that shares the step (dp × ring ×
ulysses and the gradient-accumulation micro-batches), so that the loss equals the mean over the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    logits = (hidden @ weight.t()).float()  # [chunk, vocab]
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_tokens: int = 4096
) -> tuple[Tensor, Tensor]:
    """(summed loss, number of valid tokens) of ``logits = hidden @ weight.T`` against ``labels``.

    hidden ``[..., H]``, weight ``[vocab, H]`` (the LM head, no bias), labels ``[...]`` already shifted, with
    ``IGNORE_INDEX`` for tokens that predict nothing. Logits are computed in fp32, ``chunk_tokens`` at a time.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, H]
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_loss, hidden[rows], weight, labels[rows], use_reentrant=False)
    return total, (labels != IGNORE_INDEX).sum()
