"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

The plan (``ring_blocks.py``) lists the ring steps; step ``s`` computes this rank's queries against keys of ring
rank ``(rank - s) mod R``, of which only the rows the step's blocks need travel, straight from that rank
(``batch_isend_irecv``); in exchange this rank sends the rows ring rank ``(rank + s) mod R`` needs. Offsets at
which no rank computes anything are not steps: with a sliding window of W keys smaller than a chunk a rank
fetches only the W - 1 tokens before each of its chunks, from its ring neighbours, and far ranks send nothing.
The transfers themselves (peers, pieces of rows, the buffers they arrive in) are ``transport.py``'s; the inputs
have been checked on entry (``checks.py``).

Forward: each rank keeps its queries; it posts the transfers of the next step before computing the current one
(two steps' K/V buffers at most), so the transfer overlaps the block computation; the own piece (step 0) comes
first, so the first transfer overlaps it. The last step's K/V travel in ``PIECES`` pieces of rows, and its full
rectangles are computed piece by piece as the rows arrive. Partial results are merged with the online-softmax
rule in fp32. A learned sink per head (gpt-oss) enters once, after the last merge (``merge.fold_sink``), never per
block or per rank. K and V are never repeated for GQA. The K/V rows of the last step are kept for the backward (one
more K/V piece per layer).

Backward: the steps run in reverse, the last one first, on the K/V kept from the forward, so the first step
fetches nothing. Each block's gradient is computed with the final ``out`` and ``lse`` (the sink's folded in), so it
is exact on its own; the sink's gradient is a sum over this rank's queries (``merge.sink_grad``), which the
gradient reduction of replicated weights completes.
While a step's blocks run, the K/V of the step after it travel; the dK/dV this rank computes (fp32) for the
step's keys leave for their owner in pieces as their rows are complete, once the previous step's have come back;
the own piece comes last, so the last return overlaps it. Each rank adds what comes back to the gradients of its
own piece.

The timeline of every pass (``timeline.py``, ``LCTRAIN_RING_TIMELINE``) records when each transfer is posted,
waited for and done, against each block's computation.

What each step computes comes from the plan: blocks that the causal mask, the document boundaries
(``cu_seqlens``, with the prefixes documents share: ``doc_prefix``) or the window hide entirely are skipped. With
``layout="zigzag"`` (see ``layout.py``) and one document every rank does the same work at every step: the
diagonal block, then either all queries against the first half of the source's keys (only that half travels) or
the second half of the queries against all of them.
With a kernel that has a varlen mode, the document rectangles of a step that lie end to end go to it in one call
(``group_documents``). The kernel of each kind of block comes from ``resolve_kernel`` (``kernel="auto"`` or a
name: the ``kernels`` package).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.kernels import AttentionKernel, accumulation_dtype, default_scale, resolve_kernel
from lctrain.attention.merge import fold_sink, merge_block, sink_grad
from lctrain.attention.ring_blocks import Block, Step, group_documents, plain, plan_ring
from lctrain.attention.ring_transfers import PIECES, Returning, fetch
from lctrain.attention.transport import Arriving, Peers, group_coordinates, pass_peers, row_count, row_cuts


def _by_piece(blocks: tuple[Block, ...], cuts: list[slice]) -> list[tuple[int, Block]]:
    """The kernel calls of a step whose key rows arrive (or whose dK/dV leave) in pieces ``cuts``, in order, each
    with the last piece it needs: the full rectangles cut at the pieces' boundaries, piece by piece, then every
    other block (causal, banded, document groups), which needs them all."""
    last = len(cuts) - 1
    if last <= 0:
        return [(0, block) for block in blocks]
    parts = []
    for index, cut in enumerate(cuts):
        for block in filter(plain, blocks):
            cols = slice(max(block.cols.start, cut.start), min(block.cols.stop, cut.stop))
            if cols.start < cols.stop:
                parts.append((index, Block(block.rows, cols, causal=False)))
    return parts + [(last, block) for block in blocks if not plain(block)]


def _calls(step: Step, kernel: AttentionKernel) -> tuple[Block, ...]:
    """The kernel calls of a step: its blocks, with document runs grouped when the kernel has a varlen mode."""
    if kernel.varlen_forward is None or len(step.blocks) < 2:
        return step.blocks
    return group_documents(step.blocks)


def _compute_block(  # noqa: ANN202
    kernel: AttentionKernel,
    block: Block,
    scale: float,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backward_of: tuple[Tensor, Tensor, Tensor] | None = None,
):
    """One kernel call on ``block``: the forward, ``(out, lse)`` of its rows; with ``backward_of = (dout, out,
    lse)`` (the whole rows', final) the backward, ``(dq, dk, dv)`` of its rows and columns."""
    rows, cols = block.rows, block.cols
    tensors = (q[:, rows], k[:, cols], v[:, cols])
    dense, varlen = kernel.forward, kernel.varlen_forward
    if backward_of is not None:
        dout, out, lse = backward_of
        tensors = (dout[:, rows], *tensors, out[:, rows], lse[:, :, rows])
        dense, varlen = kernel.backward, kernel.varlen_backward
    options = dict(causal=block.causal, scale=scale, window_left=block.window_left)
    if block.segments is not None:
        return varlen(*tensors, block.segments, **options)
    return dense(*tensors, **options)


def _ring_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    peers: Peers,
    plan: tuple[Step, ...],
    *,
    scale: float,
    kernel: AttentionKernel,
    sink: Tensor | None,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """(out, lse, the last step's K/V when it is not the own piece: kept for the backward); with a ``sink`` ``[H]``
    folded into the merged rows once, after every block (``fold_sink``)."""
    timeline = peers.timeline
    batch, seq_len, heads, _ = q.shape
    acc_dtype = accumulation_dtype(q.dtype)
    out = lse = None
    fetched = fetch(peers, plan[0], k, v)
    for index, step in enumerate(plan):
        arriving, k_step, v_step = fetched
        last = index + 1 == len(plan)
        if not last:  # the next step's keys travel while this step computes; the last step's in pieces
            arriving.wait()
            fetched = fetch(peers, plan[index + 1], k, v, PIECES if index + 2 == len(plan) else 1)
        cuts = row_cuts(row_count(step.keys), len(arriving.transfers)) if step.source else [step.keys]
        for piece, block in _by_piece(_calls(step, kernel), cuts):
            arriving.wait(piece)
            started = timeline.now()
            out_block, lse_block = _compute_block(kernel, block, scale, q, k_step, v_step)
            timeline.computed(step.source, started)
            if out is None and block.rows == slice(0, seq_len):  # a first block over every row starts the accumulators
                out, lse = out_block.to(acc_dtype), lse_block.to(acc_dtype)
                continue
            if out is None:
                out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
                lse = torch.full((batch, heads, seq_len), float("-inf"), dtype=acc_dtype, device=q.device)
            merge_block(out[:, block.rows], lse[:, :, block.rows], out_block, lse_block)
        arriving.wait()  # pieces no block needed
    timeline.finish()
    if sink is not None:
        out, lse = fold_sink(out, lse, sink)
    kept = (k_step, v_step) if plan[-1].source != 0 else None
    return out.to(q.dtype), lse, kept


def _accumulate(acc: Tensor | None, index: slice, grad: Tensor, like: Tensor, acc_dtype: torch.dtype) -> Tensor:
    """``acc[:, index] += grad`` in ``acc_dtype``; a first gradient that covers the whole sequence becomes the
    accumulator as it is, converted to ``acc_dtype`` when a second one comes (a lone one is the result)."""
    if acc is None:
        if index == slice(0, like.shape[1]):
            return grad
        acc = torch.zeros(like.shape, dtype=acc_dtype, device=like.device)
    elif acc.dtype != acc_dtype:
        acc = acc.to(acc_dtype)
    acc[:, index] += grad
    return acc


def _add_returned(returning: Returning, dk: Tensor | None, dv: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor]:
    """Wait for every piece of ``returning`` and add what came back to the gradients of this rank's piece."""
    index, dk_in, dv_in = returning.received()
    return _accumulate(dk, index, dk_in, k, dk_in.dtype), _accumulate(dv, index, dv_in, k, dv_in.dtype)


def _ring_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    backward_of: tuple[Tensor, Tensor, Tensor],
    kept: tuple[Tensor, Tensor] | None,
    peers: Peers,
    plan: tuple[Step, ...],
    *,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v from ``backward_of = (dout, out, lse)``. The plan's steps in reverse: the last on
    the K/V ``kept`` by the forward, the own piece (step 0) last. A step's dK/dV leave in pieces as their rows are
    done (when all its blocks are full rectangles, computed piece by piece), after the previous step's have come
    back."""
    timeline = peers.timeline
    acc_dtype = backward_of[2].dtype  # lse's: fp32
    dq = dk = dv = None  # gradients of this rank's queries and of its own K/V piece
    returning: Returning | None = None  # the previous step's dK/dV, in flight
    steps = plan[::-1]
    fetched = (Arriving([]), *kept) if kept is not None else fetch(peers, steps[0], k, v)
    for index, step in enumerate(steps):
        arriving, k_step, v_step = fetched
        arriving.wait()
        if index + 1 < len(steps):
            fetched = fetch(peers, steps[index + 1], k, v)
        if step.source == 0:  # our own keys
            for block in _calls(step, kernel):
                started = timeline.now()
                dq_block, dk_block, dv_block = _compute_block(kernel, block, scale, q, k_step, v_step, backward_of)
                timeline.computed(step.source, started)
                dq = _accumulate(dq, block.rows, dq_block, q, acc_dtype)
                dk = _accumulate(dk, block.cols, dk_block, k, acc_dtype)
                dv = _accumulate(dv, block.cols, dv_block, v, acc_dtype)
            continue
        # this rank's part of the gradients of the keys fetched at this step, returned to their owner piece by piece
        dk_step = torch.zeros(k_step.shape, dtype=acc_dtype, device=k.device)
        dv_step = torch.zeros(v_step.shape, dtype=acc_dtype, device=k.device)
        current = Returning(peers, step, dk_step, dv_step)
        calls = _calls(step, kernel)
        parts = _by_piece(calls, row_cuts(row_count(step.keys), PIECES))
        piecewise = all(map(plain, calls))  # else some block needs every row: its gradients are complete at the end
        for position, (piece, block) in enumerate(parts):
            started = timeline.now()
            dq_block, dk_block, dv_block = _compute_block(kernel, block, scale, q, k_step, v_step, backward_of)
            timeline.computed(step.source, started)
            dq = _accumulate(dq, block.rows, dq_block, q, acc_dtype)
            dk_step[:, block.cols] += dk_block
            dv_step[:, block.cols] += dv_block
            following = parts[position + 1][0] if position + 1 < len(parts) else PIECES
            if piecewise and following > piece:  # pieces before the next part's are complete
                if returning is not None:  # one step's dK/dV in flight at a time
                    dk, dv = _add_returned(returning, dk, dv, k)
                    returning = None
                current.post(following)
        if returning is not None:
            dk, dv = _add_returned(returning, dk, dv, k)
        current.post(PIECES)  # the rest: pieces no block touched, or every piece when not piecewise
        returning = current
    if returning is not None:
        dk, dv = _add_returned(returning, dk, dv, k)
    timeline.finish()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, group, plan, scale, choice):  # noqa: ANN001, ANN205 (autograd signature)
        kernel = resolve_kernel(
            q.device, q.dtype, head_dim=q.shape[-1], q_heads=q.shape[2], kv_heads=k.shape[2], choice=choice
        )
        input_dtype = q.dtype
        if len(plan) == 1:  # nothing travels: keep q, k, v (and out) in the dtype the kernel's backward takes
            q, k, v = (t.to(kernel.backward_dtype(input_dtype)) for t in (q, k, v))
        else:  # K/V rows are sent at every step: contiguous here once, row slices need no copy at batch 1
            k, v = k.contiguous(), v.contiguous()
        peers = pass_peers(group, "forward", len(plan))
        out, lse, kept = _ring_forward(q, k, v, peers, plan, scale=scale, kernel=kernel, sink=sink)
        ctx.save_for_backward(q, k, v, out, lse, sink, *(kept or (None, None)))
        ctx.options = dict(group=group, plan=plan, scale=scale, kernel=kernel, input_dtype=input_dtype)
        return out.to(input_dtype)

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse, sink, k_kept, v_kept = ctx.saved_tensors
        options = ctx.options
        dq, dk, dv = _ring_backward(
            q,
            k,
            v,
            (dout.contiguous(), out, lse),
            None if k_kept is None else (k_kept, v_kept),
            pass_peers(options["group"], "backward", len(options["plan"])),
            options["plan"],
            scale=options["scale"],
            kernel=options["kernel"],
        )
        dtype = options["input_dtype"]
        dsink = None if sink is None else sink_grad(dout, out, lse, sink).to(sink.dtype)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), dsink, None, None, None, None


def attend_ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool,
    layout: str,
    scale: float | None,
    bounds: list[int] | None,
    prefixes: tuple[int, ...] | None,
    window: int | None,
    kernel: str,
    sink: Tensor | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across ``group`` (None: a ring of one) with ``shard_sequence(layout=
    layout)``, on inputs already checked (``checks.check_attention_inputs``; ``bounds`` and ``prefixes`` are what
    it returned): q ``[B, S_local, Hq, D]``, k/v ``[B, S_local, Hkv, D]`` -> ``[B, S_local, Hq, D]`` in q's dtype,
    differentiable in q, k, v and ``sink`` (``[Hq]``, these heads' sinks, or None: ``merge.fold_sink``). The ring
    inside ``usp_attention``, and with it ``ring_attention`` and ``ulysses_attention``."""
    rank, size = group_coordinates(group)
    if size == 1:  # a ring of one holds the whole sequence in order: both layouts are the same
        layout = "contiguous"
    seq_len = q.shape[1] * size
    scale = default_scale(q.shape[-1]) if scale is None else scale
    plan = plan_ring(
        rank,
        size,
        q.shape[1],
        causal=causal,
        layout=layout,
        cu_seqlens=None if bounds is None else tuple(bounds),
        doc_prefix=prefixes,
        window=None if window is None or window >= seq_len else window,
    )
    return _RingAttention.apply(q, k, v, sink, group, plan, scale, kernel)
