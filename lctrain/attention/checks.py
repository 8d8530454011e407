"""The input checks of the attention functions, run once on entry by ``usp_attention`` (which ``ring_attention`` and
``ulysses_attention`` are cases of), before any communication, so a bad input fails on all ranks instead of hanging
some."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lctrain.attention.kernels import check_kernel_choice, check_window
from lctrain.attention.transport import group_coordinates
from lctrain.rules import check_layout, check_ulysses_heads


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Shapes ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]``, ``Hq % Hkv == 0``, one float dtype and device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim]; got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in batch, local sequence length and head_dim"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for GQA")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def check_sinks(sinks: Tensor | None, q: Tensor) -> None:
    """Sinks are one float logit per query head (``[Hq]``), on q's device."""
    if sinks is None:
        return
    if sinks.shape != (q.shape[2],) or not sinks.dtype.is_floating_point or sinks.device != q.device:
        raise ValueError(
            f"sinks must be a float tensor [query heads] = [{q.shape[2]}] on {q.device}; got shape "
            f"{tuple(sinks.shape)}, dtype {sinks.dtype} on {sinks.device}"
        )


def check_cu_seqlens(cu_seqlens: Tensor | None, seq_len: int) -> list[int] | None:
    """Validate document boundaries of a global sequence of ``seq_len`` tokens; return them as a list."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1]; got shape {tuple(cu_seqlens.shape)}, "
            f"dtype {cu_seqlens.dtype}"
        )
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and strictly increase; got {bounds[:8]}...")
    if bounds[-1] != seq_len:
        raise ValueError(
            f"cu_seqlens ends at {bounds[-1]} but the sharded sequence has {seq_len} tokens (local length x ring "
            f"size x ulysses size): pass the boundaries of the global row, and groups matching how it was sharded"
        )
    return bounds


def check_doc_prefix(doc_prefix: Tensor | None, bounds: list[int] | None) -> tuple[int, ...] | None:
    """Validate the shared prefixes of the documents of ``bounds`` (``check_cu_seqlens``): an int tensor
    ``[num_docs]`` giving for each document an earlier one whose tokens it also sees, or -1; a prefix sees none
    itself. Return it as a tuple (None when no document has a prefix)."""
    if doc_prefix is None:
        return None
    if bounds is None:
        raise ValueError("doc_prefix needs cu_seqlens: pass the document boundaries the prefixes refer to")
    num_docs = len(bounds) - 1
    if doc_prefix.dim() != 1 or doc_prefix.dtype.is_floating_point or doc_prefix.numel() != num_docs:
        raise ValueError(
            f"doc_prefix must be a 1-D integer tensor [num_docs] ({num_docs} documents in cu_seqlens); got shape "
            f"{tuple(doc_prefix.shape)}, dtype {doc_prefix.dtype}"
        )
    prefixes = tuple(doc_prefix.tolist())
    for doc, prefix in enumerate(prefixes):
        if not -1 <= prefix < doc:
            raise ValueError(
                f"doc_prefix[{doc}]={prefix}: a document's prefix must be an earlier document (0 to {doc - 1}) or -1"
            )
        if prefix >= 0 and prefixes[prefix] >= 0:
            raise ValueError(
                f"doc_prefix[{doc}]={prefix} but document {prefix} has a prefix itself (doc_prefix[{prefix}]="
                f"{prefixes[prefix]}): a prefix sees no other document; point document {doc} at -1 or a plain one"
            )
    return prefixes if any(prefix >= 0 for prefix in prefixes) else None


def check_zigzag_piece(piece_len: int, ring_size: int, layout: str) -> None:
    """A zigzag piece is two equal chunks: a ring rank must hold an even number of tokens."""
    if layout == "zigzag" and ring_size > 1 and piece_len % 2:
        raise ValueError(
            f"each ring rank holds {piece_len} tokens, an odd number, but layout='zigzag' needs two equal chunks "
            f"per rank: make the global sequence length divisible by 2·ring_size·ulysses_size "
            f"(ring_size={ring_size}) and shard it with shard_sequence"
        )


def check_orthogonal(ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None) -> None:
    """The Ulysses and ring groups are two axes of one mesh: they meet only at this rank."""
    if ulysses_group is None or ring_group is None:
        return
    shared = set(dist.get_process_group_ranks(ulysses_group)) & set(dist.get_process_group_ranks(ring_group))
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"ulysses_group and ring_group share ranks {sorted(shared)}: they must be orthogonal axes of the mesh "
            f"(meet only at this rank); build them from a DeviceMesh with separate 'ring' and 'ulysses' dims"
        )


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    causal: bool,
    layout: str,
    window: int | None,
    cu_seqlens: Tensor | None,
    doc_prefix: Tensor | None,
    kernel: str,
    sinks: Tensor | None = None,
) -> tuple[list[int] | None, tuple[int, ...] | None]:
    """Every input check of an attention call: q, k, v (``check_qkv``), the sinks, the layout, the window, the
    heads over the Ulysses ranks, a zigzag piece of two equal chunks, the document bounds of the global row of
    ``S_local · ulysses_size · ring_size`` tokens and their prefixes, the kernel's name and the two groups'
    orthogonality. Returns the bounds as a list (None without ``cu_seqlens``) and the prefixes as a tuple (None
    when no document has one)."""
    ulysses_size, ring_size = group_coordinates(ulysses_group)[1], group_coordinates(ring_group)[1]
    check_qkv(q, k, v)
    check_sinks(sinks, q)
    check_layout(layout)
    check_window(window, causal)
    if ulysses_size > 1:
        check_ulysses_heads(q.shape[2], k.shape[2], ulysses_size, setting="Ulysses group size")
    piece_len = q.shape[1] * ulysses_size  # a ring rank's piece, as the ring sees it after the all-to-all
    check_zigzag_piece(piece_len, ring_size, layout)
    bounds = check_cu_seqlens(cu_seqlens, piece_len * ring_size)
    prefixes = check_doc_prefix(doc_prefix, bounds)
    check_kernel_choice(kernel)
    check_orthogonal(ulysses_group, ring_group)
    return bounds, prefixes
