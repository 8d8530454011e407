"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Forward: each rank keeps its queries; K and V (packed as one ``[2, B, S, Hkv, D]`` buffer, never repeated for
GQA) travel around the ring. At step ``s`` a rank holds the K/V piece of ring rank ``(rank - s) mod R``; it posts
the send/receive for step ``s + 1`` (double buffers, ``batch_isend_irecv``) before computing step ``s``, so the
transfer overlaps the block computation. Partial results are merged with the online-softmax rule in fp32.

Backward: K/V travel the same way, followed by their gradient accumulators dK/dV (fp32), which collect each
rank's contribution and go back to their owner after the last step (directly, when the plan stops the ring early
because no rank needs the remaining steps). Each block's gradient is computed with
the final ``out`` and ``lse``, so it is exact on its own.

What each step computes comes from ``plan.py``: blocks that the causal mask or the document boundaries
(``cu_seqlens``) hide entirely are skipped. With ``layout="zigzag"`` (see ``layout.py``) and one document every
rank does the same work at every step: the diagonal block, then either all queries against the first half of the
received keys or the second half of the queries against all received keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.kernels import AttentionKernel, accumulation_dtype, default_scale, resolve_kernel
from lctrain.attention.layout import check_layout
from lctrain.attention.merge import merge_block
from lctrain.attention.ring_blocks import Block, plan_ring


class _RingExchange:
    """Sends a buffer ``offset`` ranks ahead on the ring while receiving one from ``offset`` ranks behind."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def start(self, send: Tensor, receive: Tensor, offset: int = 1) -> list[dist.Work]:
        send_to = dist.get_global_rank(self.group, (self.rank + offset) % self.size)
        receive_from = dist.get_global_rank(self.group, (self.rank - offset) % self.size)
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, send_to, self.group),
                dist.P2POp(dist.irecv, receive, receive_from, self.group),
            ]
        )


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _group_coordinates(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _kv_buffers(k: Tensor, v: Tensor, steps: int) -> list:
    """K/V as the ring sends them: one packed ``[2, B, S, Hkv, D]`` buffer plus a receive buffer; a plan of one
    step sends nothing and uses ``(k, v)`` as they are."""
    if steps == 1:
        return [(k, v)]
    packed = torch.stack([k, v])
    return [packed, torch.empty_like(packed)]


def _ring_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    plan: tuple[tuple[Block, ...], ...],
    *,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor]:
    steps = len(plan)
    exchange = _RingExchange(group) if steps > 1 else None
    batch, seq_len, heads, _ = q.shape
    acc_dtype = accumulation_dtype(q.dtype)
    out = lse = None
    kv_buffers = _kv_buffers(k, v, steps)
    for step, blocks in enumerate(plan):
        kv = kv_buffers[step % 2]
        pending = exchange.start(kv, kv_buffers[(step + 1) % 2]) if step + 1 < steps else []
        for block in blocks:
            out_block, lse_block = kernel.forward(
                q[:, block.rows], kv[0][:, block.cols], kv[1][:, block.cols], causal=block.causal, scale=scale
            )
            if out is None and block.rows == slice(0, seq_len):  # a first block over every row starts the accumulators
                out, lse = out_block.to(acc_dtype), lse_block.to(acc_dtype)
                continue
            if out is None:
                out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
                lse = torch.full((batch, heads, seq_len), float("-inf"), dtype=acc_dtype, device=q.device)
            merge_block(out[:, block.rows], lse[:, :, block.rows], out_block, lse_block)
        _wait(pending)
    return out.to(q.dtype), lse


def _accumulate(acc: Tensor | None, index: slice, grad: Tensor, like: Tensor, acc_dtype: torch.dtype) -> Tensor:
    """``acc[:, index] += grad``; the first gradient that covers the whole sequence becomes the accumulator."""
    if acc is None:
        if index == slice(0, like.shape[1]):
            return grad.to(acc_dtype)
        acc = torch.zeros(like.shape, dtype=acc_dtype, device=like.device)
    acc[:, index] += grad
    return acc


def _ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group: dist.ProcessGroup | None,
    plan: tuple[tuple[Block, ...], ...],
    *,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor, Tensor]:
    steps = len(plan)
    acc_dtype = lse.dtype
    kv_buffers = _kv_buffers(k, v, steps)
    dq = None
    if steps == 1:  # nothing travels: gradients go straight into local accumulators
        dk = dv = None
        for block in plan[0]:
            dq_block, dk_block, dv_block = kernel.backward(
                dout[:, block.rows],
                q[:, block.rows],
                k[:, block.cols],
                v[:, block.cols],
                out[:, block.rows],
                lse[:, :, block.rows],
                causal=block.causal,
                scale=scale,
            )
            dq = _accumulate(dq, block.rows, dq_block, q, acc_dtype)
            dk = _accumulate(dk, block.cols, dk_block, k, acc_dtype)
            dv = _accumulate(dv, block.cols, dv_block, v, acc_dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    exchange = _RingExchange(group)
    dkv_buffers = [torch.zeros(kv_buffers[0].shape, dtype=acc_dtype, device=q.device)]  # travels with K/V
    dkv_buffers.append(torch.empty_like(dkv_buffers[0]))
    dkv_pending: list[dist.Work] = []
    for step, blocks in enumerate(plan):
        kv = kv_buffers[step % 2]
        kv_pending = exchange.start(kv, kv_buffers[(step + 1) % 2]) if step + 1 < steps else []
        dkv_blocks = []
        for block in blocks:
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
            dq = _accumulate(dq, block.rows, dq_block, q, acc_dtype)
            dkv_blocks.append((block.cols, dk_block, dv_block))
        _wait(dkv_pending)  # the accumulator for the K/V piece we hold now, from the previous rank
        dkv = dkv_buffers[step % 2]
        for cols, dk_block, dv_block in dkv_blocks:
            dkv[0][:, cols] += dk_block
            dkv[1][:, cols] += dv_block
        # Pass it on to the rank that holds this K/V next; after the last step, straight back to its owner.
        offset = 1 if step + 1 < steps else -step
        dkv_pending = exchange.start(dkv, dkv_buffers[(step + 1) % 2], offset)
        _wait(kv_pending)
    _wait(dkv_pending)
    dkv = dkv_buffers[steps % 2]  # where the last transfer delivered it
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan, scale):  # noqa: ANN001, ANN205 (autograd signature)
        kernel = resolve_kernel(q.device, q.dtype)
        input_dtype = q.dtype
        if len(plan) == 1:  # nothing travels: keep q, k, v (and out, for the backward) in the kernel's dtype
            q, k, v = (t.to(kernel.compute_dtype(input_dtype)) for t in (q, k, v))
        out, lse = _ring_forward(q, k, v, group, plan, scale=scale, kernel=kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(group=group, plan=plan, scale=scale, kernel=kernel, input_dtype=input_dtype)
        return out.to(input_dtype)

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
            options["plan"],
            scale=options["scale"],
            kernel=options["kernel"],
        )
        dtype = options["input_dtype"]
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


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


def check_zigzag_piece(piece_len: int, ring_size: int, layout: str) -> None:
    """A zigzag piece is two equal chunks: a ring rank must hold an even number of tokens."""
    if layout == "zigzag" and ring_size > 1 and piece_len % 2:
        raise ValueError(
            f"each ring rank holds {piece_len} tokens, an odd number, but layout='zigzag' needs two equal chunks "
            f"per rank: make the global sequence length divisible by 2·ring_size·ulysses_size "
            f"(ring_size={ring_size}) and shard it with shard_sequence"
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
    differentiable in q, k, v. ``group=None`` means a ring of one rank. ``cu_seqlens`` (int, ``[num_docs + 1]``,
    0 to S) are the document boundaries of the global sequence, the same on every rank and for every batch row;
    tokens then attend only inside their document.
    """
    check_qkv(q, k, v)
    check_layout(layout)
    rank, size = _group_coordinates(group)
    if size == 1:  # a ring of one holds the whole sequence in order: both layouts are the same
        layout = "contiguous"
    bounds = check_cu_seqlens(cu_seqlens, q.shape[1] * size)
    check_zigzag_piece(q.shape[1], size, layout)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    plan = plan_ring(
        rank, size, q.shape[1], causal=causal, layout=layout, cu_seqlens=None if bounds is None else tuple(bounds)
    )
    return _RingAttention.apply(q, k, v, group, plan, scale)
