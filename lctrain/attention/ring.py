"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Forward: each rank keeps its queries; K and V (packed as one ``[2, B, S, Hkv, D]`` buffer, never repeated for
GQA) travel around the ring. At step ``s`` a rank holds the K/V piece of ring rank ``(rank - s) mod R``; it posts
the send/receive for step ``s + 1`` (double buffers, ``batch_isend_irecv``) before computing step ``s``, so the
transfer overlaps the block computation. Partial results are merged with the online-softmax rule in fp32.

Backward: K/V travel the same way, followed by their gradient accumulators dK/dV (fp32), which collect each
rank's contribution and arrive back at their owner after the last step. Each block's gradient is computed with
the final ``out`` and ``lse``, so it is exact on its own.

Causal blocks that are fully masked are skipped. With ``layout="zigzag"`` (see ``layout.py``) every rank does
the same work at every step: the diagonal block, then either all queries against the first half of the
received keys or the second half of the queries against all received keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.kernels import AttentionKernel, accumulation_dtype, default_scale, resolve_kernel
from lctrain.attention.layout import check_layout
from lctrain.attention.merge import merge_block


@dataclass(frozen=True)
class Block:
    """The part of one ring step that is computed: local query rows × rows of the received K/V piece."""

    rows: slice
    cols: slice
    causal: bool


def block_for_step(step: int, rank: int, size: int, seq_len: int, *, causal: bool, layout: str) -> Block | None:
    """What ring rank ``rank`` computes at ``step`` (K/V of rank ``(rank - step) mod size``); None = skipped."""
    source = (rank - step) % size
    everything = slice(0, seq_len)
    if not causal:
        return Block(everything, everything, causal=False)
    if source == rank:
        return Block(everything, everything, causal=True)
    if layout == "contiguous":
        return Block(everything, everything, causal=False) if source < rank else None
    half = seq_len // 2
    if source < rank:  # both local chunks come after the source's first chunk and before its second
        return Block(everything, slice(0, half), causal=False)
    return Block(slice(half, seq_len), everything, causal=False)  # only the local second chunk sees the source


class _RingExchange:
    """Sends a buffer to the next ring rank while receiving the same-shaped buffer from the previous one."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group = group
        self.send_to = dist.get_global_rank(group, (rank + 1) % size)
        self.receive_from = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, send: Tensor, receive: Tensor) -> list[dist.Work]:
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, self.send_to, self.group),
                dist.P2POp(dist.irecv, receive, self.receive_from, self.group),
            ]
        )


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _ring_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool,
    layout: str,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor]:
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    exchange = _RingExchange(group) if size > 1 else None
    batch, seq_len, heads, _ = q.shape
    acc_dtype = accumulation_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.empty((batch, heads, seq_len), dtype=acc_dtype, device=q.device)
    kv_buffers = [torch.stack([k, v])]  # [2, B, S, Hkv, D]
    if size > 1:
        kv_buffers.append(torch.empty_like(kv_buffers[0]))
    for step in range(size):
        kv = kv_buffers[step % 2]
        pending = exchange.start(kv, kv_buffers[(step + 1) % 2]) if step + 1 < size else []
        block = block_for_step(step, rank, size, seq_len, causal=causal, layout=layout)
        if block is not None:
            out_block, lse_block = kernel.forward(
                q[:, block.rows], kv[0][:, block.cols], kv[1][:, block.cols], causal=block.causal, scale=scale
            )
            if step == 0:  # the first block always covers every row: it initialises the accumulators
                out.copy_(out_block)
                lse.copy_(lse_block)
            else:
                merge_block(out[:, block.rows], lse[:, :, block.rows], out_block, lse_block)
        _wait(pending)
    return out.to(q.dtype), lse


def _ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool,
    layout: str,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor, Tensor]:
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    exchange = _RingExchange(group) if size > 1 else None
    seq_len = q.shape[1]
    acc_dtype = lse.dtype
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv_buffers = [torch.stack([k, v])]  # [2, B, S, Hkv, D]
    dkv_buffers = [torch.zeros(kv_buffers[0].shape, dtype=acc_dtype, device=q.device)]  # travels with K/V
    if size > 1:
        kv_buffers.append(torch.empty_like(kv_buffers[0]))
        dkv_buffers.append(torch.empty_like(dkv_buffers[0]))
    dkv_pending: list[dist.Work] = []
    for step in range(size):
        kv = kv_buffers[step % 2]
        kv_pending = exchange.start(kv, kv_buffers[(step + 1) % 2]) if step + 1 < size else []
        block = block_for_step(step, rank, size, seq_len, causal=causal, layout=layout)
        if block is not None:
            dq_block, dk_block, dv_block = kernel.backward(
                dout[:, block.rows],
                q[:, block.rows],
                kv[0][:, block.cols],
                kv[1][:, block.cols],
                out[:, block.rows],
                lse[:, :, block.rows],
                causal=block.causal,
                scale=scale,
            )
            dq[:, block.rows] += dq_block
        _wait(dkv_pending)  # the accumulator for the K/V piece we hold now, from the previous rank
        dkv = dkv_buffers[step % 2]
        if block is not None:
            dkv[0][:, block.cols] += dk_block
            dkv[1][:, block.cols] += dv_block
        if size > 1:  # pass it on; after the last step it reaches the piece's owner
            dkv_pending = exchange.start(dkv, dkv_buffers[(step + 1) % 2])
        _wait(kv_pending)
    _wait(dkv_pending)
    dkv = dkv_buffers[size % 2] if size > 1 else dkv_buffers[0]  # where the last transfer delivered it
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale):  # noqa: ANN001, ANN205 (autograd signature)
        kernel = resolve_kernel(q.device, q.dtype)
        out, lse = _ring_forward(q, k, v, group, causal=causal, layout=layout, scale=scale, kernel=kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(group=group, causal=causal, layout=layout, scale=scale, kernel=kernel)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        options = ctx.options
        dq, dk, dv = _ring_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            options["group"],
            causal=options["causal"],
            layout=options["layout"],
            scale=options["scale"],
            kernel=options["kernel"],
        )
        return dq, dk, dv, None, None, None, None


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


def document_masking_not_ready(cu_seqlens: Tensor | None) -> None:
    if cu_seqlens is not None:
        raise NotImplementedError(
            "cu_seqlens (document masking of packed sequences) is not implemented yet; pass cu_seqlens=None"
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across ``group`` with ``shard_sequence(layout=layout)``.

    q ``[B, S_local, Hq, D]``, k/v ``[B, S_local, Hkv, D]`` -> ``[B, S_local, Hq, D]`` in q's dtype,
    differentiable in q, k, v. ``group=None`` means a ring of one rank.
    """
    check_qkv(q, k, v)
    check_layout(layout)
    document_masking_not_ready(cu_seqlens)
    size = dist.get_world_size(group) if group is not None else 1
    if layout == "zigzag" and size > 1 and q.shape[1] % 2:
        raise ValueError(
            f"each ring rank holds {q.shape[1]} tokens, an odd number, but layout='zigzag' needs two equal chunks "
            f"per rank: make the global sequence length divisible by 2·ring_size·ulysses_size "
            f"(ring_size={size}) and shard it with shard_sequence"
        )
    scale = default_scale(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, layout, scale)
