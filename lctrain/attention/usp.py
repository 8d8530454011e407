"""Unified sequence parallelism: Ulysses all-to-all inside (adjacent ranks, one node), ring attention across.

``usp_attention`` is the one attention function: it checks its inputs once (``checks.py``), then runs the ring
(``ring.py``) on the head-sharded layout (``ulysses.py``). ``ring_attention`` (no Ulysses group) and
``ulysses_attention`` (no ring group, contiguous layout) are its cases.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lctrain.attention.checks import check_attention_inputs
from lctrain.attention.ring import attend_ring
from lctrain.attention.ulysses import attend_head_sharded, own_heads


def usp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "zigzag",
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    doc_prefix: Tensor | None = None,
    window: int | None = None,
    kernel: str = "auto",
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded with ``shard_sequence`` over (ring, ulysses) ranks.

    q ``[B, S/(R·U), Hq, D]``, k/v ``[B, S/(R·U), Hkv, D]`` -> ``[B, S/(R·U), Hq, D]`` in q's dtype,
    differentiable in q, k, v. Ulysses turns the local part into the ring rank's whole piece for ``Hq/U`` heads;
    ring attention then runs over ``ring_group`` on that piece; a second all-to-all restores the sequence sharding.
    A group of None has size 1. ``cu_seqlens`` (int, ``[num_docs + 1]``, 0 to S) are the document boundaries of
    the global sequence, the same on every rank and for every batch row; tokens then attend only inside their
    document. ``doc_prefix`` (int, ``[num_docs]``, needs ``cu_seqlens``): for each document, an earlier document
    whose every token it also sees, as a prefix its positions continue, or -1; a prefix has none itself. A
    preference pair ``[prompt | chosen | rejected]`` is three documents, the answers' prefix the prompt: each answer
    sees the prompt and itself, never the other. ``window`` (needs ``causal``): query ``i`` sees only keys ``j``
    with ``i - window < j <= i`` (``window`` keys, itself included: Hugging Face's ``sliding_window``), in its
    document, counted in positions for a prefix's keys (for the rejected answer: as if the chosen one were not
    between them); ``window >= S`` is the same as no window. ``kernel``: ``"auto"`` or a kernel name
    (``KERNEL_CHOICES``), the first choice of ``resolve_kernel`` for each kind of block. ``sinks`` (``[Hq]``, any
    float dtype, differentiable; gpt-oss): a learned logit per head in every query's softmax denominator, with no
    value behind it, not scaled by ``scale``; each Ulysses rank takes its heads' and the ring folds them in once,
    after merging every block (``merge.fold_sink``). Each rank's gradient of ``sinks`` sums over its own queries
    and heads: summed over the ranks (as a replicated weight's gradient is), it is the whole sequence's.
    """
    options = dict(causal=causal, layout=layout, window=window)  # read by the checks and by the ring
    documents = dict(cu_seqlens=cu_seqlens, doc_prefix=doc_prefix)
    bounds, prefixes = check_attention_inputs(
        q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, kernel=kernel, sinks=sinks, **documents, **options
    )
    sink = None if sinks is None else own_heads(sinks, ulysses_group)
    attend = functools.partial(
        attend_ring,
        group=ring_group,
        scale=scale,
        bounds=bounds,
        prefixes=prefixes,
        kernel=kernel,
        sink=sink,
        **options,
    )
    return attend_head_sharded(q, k, v, ulysses_group, attend)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None, **options: Any) -> Tensor:
    """``usp_attention`` with ``ring_group=group`` and no Ulysses group (``options``: its keywords): q ``[B, S_local,
    Hq, D]``, k/v ``[B, S_local, Hkv, D]`` -> ``[B, S_local, Hq, D]``, sharded with ``shard_sequence(layout=...)``."""
    return usp_attention(q, k, v, ring_group=group, **options)


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None = None, **options: Any
) -> Tensor:
    """``usp_attention`` with ``ulysses_group=group``, no ring group and the contiguous layout (``options``: its other
    keywords): a sequence split contiguously over ``group``. q ``[B, S/U, Hq, D]``, k/v ``[B, S/U, Hkv, D]`` ->
    ``[B, S/U, Hq, D]``; needs ``Hq % U == 0`` and ``Hkv % U == 0`` or ``U % Hkv == 0``."""
    return usp_attention(q, k, v, ulysses_group=group, layout="contiguous", **options)
