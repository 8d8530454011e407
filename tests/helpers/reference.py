"""The ground truth for attention tests: float64 math attention on the full sequence, per document if packed; for
rows with shared prefixes (preference pairs), the mask written out (``visible_mask``) and the prompt repeated for
each answer (``unshared_row``)."""

from __future__ import annotations

import random

import torch

from lctrain.attention.kernels import reference_attention


def reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool,
    bounds: list[int] | None = None,
    window: int | None = None,
) -> list[torch.Tensor]:
    """out, dq, dk, dv of float64 attention ``[B, S, H, D]``, run separately on each document of ``bounds``,
    with a sliding ``window`` (keys per query, itself included) when given."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    bounds = bounds or [0, q.shape[1]]
    out = torch.cat(
        [
            reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=causal, window=window)
            for a, b in zip(bounds, bounds[1:])
        ],
        dim=1,
    )
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def visible_mask(
    seq_len: int,
    *,
    causal: bool,
    bounds: list[int] | None = None,
    doc_prefix: list[int] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """bool ``[S, S]``: query i sees key j. Inside one document (``bounds``): j <= i when causal; a document also
    sees every key of its prefix document (``doc_prefix[d]``, -1: none). With a window, pos(i) - pos(j) < window,
    pos being a token's offset in its document plus the length of the document's prefix (its positions continue
    the prefix's)."""
    bounds = bounds or [0, seq_len]
    starts, lengths = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
    doc_prefix = doc_prefix if doc_prefix is not None else [-1] * len(lengths)
    tokens = torch.arange(seq_len)
    doc = torch.bucketize(tokens, torch.tensor(bounds[1:]), right=True)  # each token's document
    prefix = torch.tensor(doc_prefix)[doc]  # each token's document's prefix, -1: none
    position = tokens - starts[doc] + torch.where(prefix >= 0, lengths[prefix.clamp(min=0)], 0)
    same = doc[:, None] == doc[None, :]
    if causal:
        same &= tokens[:, None] >= tokens[None, :]
    shared = prefix[:, None] == doc[None, :]
    mask = same | shared
    if window is not None:
        mask &= position[:, None] - position[None, :] < window
    return mask


def masked_reference_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, visible: torch.Tensor
) -> list[torch.Tensor]:
    """out, dq, dk, dv of float64 attention ``[B, S, H, D]`` with the mask ``visible`` (bool ``[S, S]``, every
    query sees a key), K/V heads repeated for GQA."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    keys, values = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) / q.shape[-1] ** 0.5
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def unshared_row(bounds: list[int], doc_prefix: list[int]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The row with every shared prefix repeated: each document with a prefix becomes one plain document
    ``[prefix | document]`` (``[prompt | chosen]``, ``[prompt | rejected]``). Returns (the shared row's token at
    each place of the unshared row, the unshared row's cu_seqlens, each shared token's first place there)."""
    order, plain = [], [0]
    for doc, prefix in enumerate(doc_prefix):
        if doc in doc_prefix:  # a prefix: computed inside each document that shares it
            continue
        if prefix >= 0:
            order += range(bounds[prefix], bounds[prefix + 1])
        order += range(bounds[doc], bounds[doc + 1])
        plain.append(len(order))
    first = torch.tensor([order.index(token) for token in range(bounds[-1])])
    return torch.tensor(order), plain, first


def unshared_reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    bounds: list[int],
    doc_prefix: list[int],
    window: int | None = None,
) -> list[torch.Tensor]:
    """``reference_grads`` (causal) of the ``unshared_row``, mapped back to the shared row: a prefix token's output
    from its first copy, its gradients summed over its copies (autograd through the gather)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    index, plain, first = unshared_row(bounds, doc_prefix)
    out = torch.cat(
        [
            reference_attention(q[:, index[a:b]], k[:, index[a:b]], v[:, index[a:b]], causal=True, window=window)
            for a, b in zip(plain, plain[1:])
        ],
        dim=1,
    )[:, first]
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def random_pairs(seq_len: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A packed row of preference pairs ``[prompt | chosen | rejected]`` (the answers' prefix: the prompt) and plain
    documents, of random lengths (some 1): (cu_seqlens, doc_prefix)."""
    bounds, doc_prefix = [0], []
    while bounds[-1] < seq_len:
        left = seq_len - bounds[-1]
        answer = min(5, max(1, seq_len // 4))
        lengths = [rng.randint(1, max(1, seq_len // 3)), rng.randint(1, answer), rng.randint(1, answer)]
        if (len(bounds) == 1 or rng.random() < 0.75) and sum(lengths) <= left:  # the row starts with a pair
            doc_prefix += [-1, len(doc_prefix), len(doc_prefix)]
        else:
            lengths = [min(left, rng.randint(1, 6))]
            doc_prefix.append(-1)
        for length in lengths:
            bounds.append(bounds[-1] + length)
    return bounds, doc_prefix


def sink_reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    sinks: torch.Tensor,
    visible: torch.Tensor,
    scale: float | None = None,
) -> list[torch.Tensor]:
    """out, dq, dk, dv, dsinks of float64 attention ``[B, S, H, D]`` whose softmax has one more column per head, the
    sink ``sinks[h]`` (unscaled, no value behind it), with the mask ``visible`` (bool ``[S, S]``), K/V heads
    repeated for GQA: what gpt-oss's eager attention computes."""
    q, k, v, sinks = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    batch, seq_len, heads, dim = q.shape
    groups = heads // k.shape[2]
    keys, values = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    scale = dim**-0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * scale
    column = sinks.view(1, heads, 1, 1).expand(batch, heads, seq_len, 1)
    probs = torch.softmax(torch.cat([scores.masked_fill(~visible, float("-inf")), column], dim=-1), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :-1], values)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad, sinks.grad]
