"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

The plan (``ring_blocks.py``) lists the ring steps; step ``s`` computes this rank's queries against keys of ring
rank ``(rank - s) mod R``, of which only the rows the step's blocks need travel, straight from that rank
(``batch_isend_irecv``); in exchange this rank sends the rows ring rank ``(rank + s) mod R`` needs. Offsets at
which no rank computes anything are not steps: with a sliding window of W keys smaller than a chunk a rank
fetches only the W - 1 tokens before each of its chunks, from its ring neighbours, and far ranks send nothing.

Forward: each rank keeps its queries; it posts the transfers of the next step before computing the current one
(two steps' K/V buffers at most), so the transfer overlaps the block computation; the own piece (step 0) comes
first, so the first transfer overlaps it. The last step's K/V travel in ``PIECES`` pieces of rows, and its full
rectangles are computed piece by piece as the rows arrive. Partial results are merged with the online-softmax
rule in fp32. K and V are never repeated for GQA. The K/V rows of the last step are kept for the backward (one
more K/V piece per layer).

Backward: the steps run in reverse, the last one first, on the K/V kept from the forward, so the first step
fetches nothing. Each block's gradient is computed with the final ``out`` and ``lse``, so it is exact on its own.
While a step's blocks run, the K/V of the step after it travel; the dK/dV this rank computes (fp32) for the
step's keys leave for their owner in pieces as their rows are complete, once the previous step's have come back;
the own piece comes last, so the last return overlaps it. Each rank adds what comes back to the gradients of its
own piece.

The timeline of every pass (``timeline.py``, ``LCTRAIN_RING_TIMELINE``) records when each transfer is posted,
waited for and done, against each block's computation.

What each step computes comes from the plan: blocks that the causal mask, the document boundaries
(``cu_seqlens``) or the window hide entirely are skipped. With ``layout="zigzag"`` (see ``layout.py``) and one
document every rank does the same work at every step: the diagonal block, then either all queries against the
first half of the source's keys (only that half travels) or the second half of the queries against all of them.
With a kernel that has a varlen mode, the document rectangles of a step that lie end to end go to it in one call
(``group_documents``). The kernel of each kind of block comes from ``resolve_kernel`` (``kernel="auto"`` or a
name: the ``kernels`` package).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention.kernels import (
    AttentionKernel,
    accumulation_dtype,
    check_kernel_choice,
    check_window,
    default_scale,
    resolve_kernel,
)
from lctrain.attention.merge import merge_block
from lctrain.attention.ring_blocks import Block, Step, group_documents, plan_ring
from lctrain.attention.timeline import NoTimeline, PassTimeline, pass_timeline
from lctrain.rules import check_layout, check_ulysses_heads


def _group_coordinates(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _rows(index: slice) -> int:
    return index.stop - index.start


def _bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# The forward's last K/V fetch and every dK/dV return travel in this many pieces of rows, each its own exchange:
# the blocks of the rows that have arrived compute while the rest travels, and a return starts as soon as its
# rows' gradients are complete (docs/parallelism.md, "What travels"). lctrain.planner.timing.RING_PIECES says the same.
PIECES = 4


def _cuts(rows: int, pieces: int) -> list[slice]:
    """``rows`` rows cut into ``pieces`` consecutive runs as even as can be (empty ones when there are fewer rows):
    every rank cuts the same rows the same way, so each piece's send meets its receive."""
    bounds = [rows * i // pieces for i in range(pieces + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _rows_first(like: Tensor, rows: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """An empty buffer of ``rows`` rows stored rows first, ``[rows, B, ...]`` (a run of rows is contiguous: it can be
    received into), and its ``[B, rows, ...]`` view, which the blocks index."""
    store = torch.empty((rows, like.shape[0], *like.shape[2:]), dtype=dtype, device=like.device)
    return store, store.transpose(0, 1)


@dataclass
class _Transfer:
    """Posted sends and receives; the tensors stay referenced until ``wait`` returns."""

    works: list[dist.Work]
    tensors: list[Tensor]
    timeline: PassTimeline | NoTimeline = field(default_factory=NoTimeline)
    event: dict | None = None  # its timeline event

    def wait(self) -> None:
        self.timeline.waiting(self.event)
        for work in self.works:
            work.wait()
        self.timeline.done(self.event)


class _Arriving:
    """A step's transfers, one per piece of its rows, waited for in order as far as each block needs."""

    def __init__(self, transfers: list[_Transfer]) -> None:
        self.transfers = transfers
        self.done = 0

    def wait(self, piece: int | None = None) -> None:
        """Wait for pieces up to ``piece`` (None: all)."""
        last = len(self.transfers) - 1 if piece is None else min(piece, len(self.transfers) - 1)
        while self.done <= last:
            self.transfers[self.done].wait()
            self.done += 1


class _Peers:
    """Point-to-point transfers with the ring ranks at a given offset from this one, recorded in ``timeline``."""

    def __init__(self, group: dist.ProcessGroup | None, timeline: PassTimeline | NoTimeline) -> None:
        self.group = group
        self.timeline = timeline
        self.rank, self.size = _group_coordinates(group)

    def start(
        self, what: str, source: int, send: list[Tensor], send_offset: int, receive: list[Tensor], receive_offset: int
    ) -> _Transfer:
        """Send ``send`` to ring rank ``rank + send_offset`` and receive ``receive`` from ``rank + receive_offset``
        (``what`` of step ``source``, for the timeline).

        Every rank calls this at every step other than step 0, with tensors of zero rows when it has nothing to
        send or receive: each call then involves every rank of the group, as ``batch_isend_irecv`` requires when
        it is the group's first collective (NCCL), and an empty message costs nothing.
        """
        send = [t.contiguous() for t in send]
        ops = [dist.P2POp(dist.isend, t, self._global(send_offset), self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self._global(receive_offset), self.group) for t in receive]
        works = dist.batch_isend_irecv(ops)
        event = self.timeline.posted(what, source, _bytes(send), _bytes(receive))
        return _Transfer(works, send + receive, self.timeline, event)

    def exchange(
        self,
        what: str,
        source: int,
        send: list[Tensor],
        send_offset: int,
        receive: list[Tensor],
        receive_offset: int,
        pieces: list[tuple[slice, slice]],
    ) -> list[_Transfer]:
        """``start`` once per piece: rows ``a`` of the ``[B, rows, ...]`` tensors ``send`` (sent rows first) and
        rows ``b`` of the rows-first buffers ``receive``, for each ``(a, b)`` of ``pieces``."""
        return [
            self.start(
                what,
                source,
                [t[:, a].transpose(0, 1) for t in send],
                send_offset,
                [t[b] for t in receive],
                receive_offset,
            )
            for a, b in pieces
        ]

    def _global(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)


def _fetch(peers: _Peers, step: Step, k: Tensor, v: Tensor, pieces: int = 1) -> tuple[_Arriving, Tensor, Tensor]:
    """Post a step's K/V transfers, in ``pieces`` pieces of rows: rows ``step.send`` of ``k``, ``v`` out, rows
    ``step.keys`` of the source's in; returns them and the K/V the step's blocks index (local views at step 0)."""
    if step.source == 0:
        return _Arriving([]), k[:, step.keys], v[:, step.keys]
    (k_store, k_in), (v_store, v_in) = (_rows_first(k, _rows(step.keys), k.dtype) for _ in range(2))
    cuts = list(zip(_cuts(_rows(step.send), pieces), _cuts(_rows(step.keys), pieces)))
    send = [k[:, step.send], v[:, step.send]]
    transfers = peers.exchange("kv", step.source, send, step.source, [k_store, v_store], -step.source, cuts)
    return _Arriving(transfers), k_in, v_in


def _plain(block: Block) -> bool:
    """A full rectangle: it can be cut at any key column."""
    return not block.causal and block.window_left is None and block.segments is None


def _by_piece(blocks: tuple[Block, ...], cuts: list[slice]) -> list[tuple[int, Block]]:
    """The kernel calls of a step whose key rows arrive (or whose dK/dV leave) in pieces ``cuts``, in order, each
    with the last piece it needs: the full rectangles cut at the pieces' boundaries, piece by piece, then every
    other block (causal, banded, document groups), which needs them all."""
    last = len(cuts) - 1
    if last <= 0:
        return [(0, block) for block in blocks]
    parts = []
    for index, cut in enumerate(cuts):
        for block in filter(_plain, blocks):
            cols = slice(max(block.cols.start, cut.start), min(block.cols.stop, cut.stop))
            if cols.start < cols.stop:
                parts.append((index, Block(block.rows, cols, causal=False)))
    return parts + [(last, block) for block in blocks if not _plain(block)]


def _calls(step: Step, kernel: AttentionKernel) -> tuple[Block, ...]:
    """The kernel calls of a step: its blocks, with document runs grouped when the kernel has a varlen mode."""
    if kernel.varlen_forward is None or len(step.blocks) < 2:
        return step.blocks
    return group_documents(step.blocks)


def _block_forward(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, block: Block, scale: float):  # noqa: ANN202
    q, k, v = q[:, block.rows], k[:, block.cols], v[:, block.cols]
    options = dict(causal=block.causal, scale=scale, window_left=block.window_left)
    if block.segments is not None:
        return kernel.varlen_forward(q, k, v, block.segments, **options)
    return kernel.forward(q, k, v, **options)


def _block_backward(  # noqa: ANN202
    kernel: AttentionKernel,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    block: Block,
    scale: float,
):
    rows, cols = block.rows, block.cols
    tensors = (dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows])
    options = dict(causal=block.causal, scale=scale, window_left=block.window_left)
    if block.segments is not None:
        return kernel.varlen_backward(*tensors, block.segments, **options)
    return kernel.backward(*tensors, **options)


def _ring_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    peers: _Peers,
    plan: tuple[Step, ...],
    *,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """(out, lse, the last step's K/V when it is not the own piece: kept for the backward)."""
    timeline = peers.timeline
    batch, seq_len, heads, _ = q.shape
    acc_dtype = accumulation_dtype(q.dtype)
    out = lse = None
    fetched = _fetch(peers, plan[0], k, v)
    for index, step in enumerate(plan):
        arriving, k_step, v_step = fetched
        last = index + 1 == len(plan)
        if not last:  # the next step's keys travel while this step computes; the last step's in pieces
            arriving.wait()
            fetched = _fetch(peers, plan[index + 1], k, v, PIECES if index + 2 == len(plan) else 1)
        cuts = _cuts(_rows(step.keys), len(arriving.transfers)) if step.source else [step.keys]
        for piece, block in _by_piece(_calls(step, kernel), cuts):
            arriving.wait(piece)
            started = timeline.now()
            out_block, lse_block = _block_forward(kernel, q, k_step, v_step, block, scale)
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


class _Returning:
    """The dK/dV this rank computed at ``step`` (``dk``, ``dv``: fp32, the rows it fetched), on their way back to
    the keys' owner piece by piece, and what comes back in exchange: the gradients of rows ``step.send`` of this
    rank's piece, from the rank that fetched them."""

    def __init__(self, peers: _Peers, step: Step, dk: Tensor, dv: Tensor) -> None:
        self.peers, self.step, self.dk, self.dv = peers, step, dk, dv
        (self.dk_store, self.dk_in), (self.dv_store, self.dv_in) = (
            _rows_first(dk, _rows(step.send), dk.dtype) for _ in range(2)
        )
        self.cuts = list(zip(_cuts(_rows(step.keys), PIECES), _cuts(_rows(step.send), PIECES)))
        self.posted = 0
        self.transfers: list[_Transfer] = []

    def post(self, pieces: int) -> None:
        """Send the pieces before ``pieces`` not sent yet: their rows' gradients are complete."""
        cuts, self.posted = self.cuts[self.posted : pieces], max(self.posted, pieces)
        stores, source = [self.dk_store, self.dv_store], self.step.source
        self.transfers += self.peers.exchange("dkv", source, [self.dk, self.dv], -source, stores, source, cuts)

    def add_to(self, dk: Tensor | None, dv: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor]:
        """Wait for every piece and add what came back to the gradients of this rank's piece."""
        _Arriving(self.transfers).wait()
        rows, acc_dtype = self.step.send, self.dk.dtype
        return _accumulate(dk, rows, self.dk_in, k, acc_dtype), _accumulate(dv, rows, self.dv_in, k, acc_dtype)


def _ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kept: tuple[Tensor, Tensor] | None,
    peers: _Peers,
    plan: tuple[Step, ...],
    *,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """The plan's steps in reverse: the last on the K/V ``kept`` by the forward, the own piece (step 0) last. A
    step's dK/dV leave in pieces as their rows are done (when all its blocks are full rectangles, computed piece by
    piece), after the previous step's have come back."""
    timeline = peers.timeline
    acc_dtype = lse.dtype
    dq = dk = dv = None  # gradients of this rank's queries and of its own K/V piece
    returning: _Returning | None = None  # the previous step's dK/dV, in flight
    steps = plan[::-1]
    fetched = (_Arriving([]), *kept) if kept is not None else _fetch(peers, steps[0], k, v)
    for index, step in enumerate(steps):
        arriving, k_step, v_step = fetched
        arriving.wait()
        if index + 1 < len(steps):
            fetched = _fetch(peers, steps[index + 1], k, v)
        if step.source == 0:  # our own keys
            for block in _calls(step, kernel):
                started = timeline.now()
                dq_block, dk_block, dv_block = _block_backward(kernel, dout, q, k_step, v_step, out, lse, block, scale)
                timeline.computed(step.source, started)
                dq = _accumulate(dq, block.rows, dq_block, q, acc_dtype)
                dk = _accumulate(dk, block.cols, dk_block, k, acc_dtype)
                dv = _accumulate(dv, block.cols, dv_block, v, acc_dtype)
            continue
        # this rank's part of the gradients of the keys fetched at this step, returned to their owner piece by piece
        dk_step = torch.zeros(k_step.shape, dtype=acc_dtype, device=k.device)
        dv_step = torch.zeros(v_step.shape, dtype=acc_dtype, device=k.device)
        current = _Returning(peers, step, dk_step, dv_step)
        calls = _calls(step, kernel)
        parts = _by_piece(calls, _cuts(_rows(step.keys), PIECES))
        piecewise = all(map(_plain, calls))  # else some block needs every row: its gradients are complete at the end
        for position, (piece, block) in enumerate(parts):
            started = timeline.now()
            dq_block, dk_block, dv_block = _block_backward(kernel, dout, q, k_step, v_step, out, lse, block, scale)
            timeline.computed(step.source, started)
            dq = _accumulate(dq, block.rows, dq_block, q, acc_dtype)
            dk_step[:, block.cols] += dk_block
            dv_step[:, block.cols] += dv_block
            following = parts[position + 1][0] if position + 1 < len(parts) else PIECES
            if piecewise and following > piece:  # pieces before the next part's are complete
                if returning is not None:  # one step's dK/dV in flight at a time
                    dk, dv = returning.add_to(dk, dv, k)
                    returning = None
                current.post(following)
        if returning is not None:
            dk, dv = returning.add_to(dk, dv, k)
        current.post(PIECES)  # the rest: pieces no block touched, or every piece when not piecewise
        returning = current
    if returning is not None:
        dk, dv = returning.add_to(dk, dv, k)
    timeline.finish()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _peers(group: dist.ProcessGroup | None, pass_name: str, plan: tuple[Step, ...]) -> _Peers:
    """The pass's transfers, recorded in its timeline when the ring has more than one step (``timeline.py``)."""
    if len(plan) == 1:
        return _Peers(group, NoTimeline())
    ring_rank, ring_size = _group_coordinates(group)
    return _Peers(group, pass_timeline(pass_name, dist.get_rank(), ring_rank, ring_size))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan, scale, choice):  # noqa: ANN001, ANN205 (autograd signature)
        kernel = resolve_kernel(
            q.device, q.dtype, head_dim=q.shape[-1], q_heads=q.shape[2], kv_heads=k.shape[2], choice=choice
        )
        input_dtype = q.dtype
        if len(plan) == 1:  # nothing travels: keep q, k, v (and out) in the dtype the kernel's backward takes
            q, k, v = (t.to(kernel.backward_dtype(input_dtype)) for t in (q, k, v))
        else:  # K/V rows are sent at every step: contiguous here once, row slices need no copy at batch 1
            k, v = k.contiguous(), v.contiguous()
        peers = _peers(group, "forward", plan)
        out, lse, kept = _ring_forward(q, k, v, peers, plan, scale=scale, kernel=kernel)
        ctx.save_for_backward(q, k, v, out, lse, *(kept or (None, None)))
        ctx.options = dict(group=group, plan=plan, scale=scale, kernel=kernel, input_dtype=input_dtype)
        return out.to(input_dtype)

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse, k_kept, v_kept = ctx.saved_tensors
        options = ctx.options
        dq, dk, dv = _ring_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            None if k_kept is None else (k_kept, v_kept),
            _peers(options["group"], "backward", options["plan"]),
            options["plan"],
            scale=options["scale"],
            kernel=options["kernel"],
        )
        dtype = options["input_dtype"]
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None


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


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    layout: str,
    window: int | None,
    cu_seqlens: Tensor | None,
    ring_size: int,
    ulysses_size: int = 1,
) -> list[int] | None:
    """Every input check of an attention function, run once on entry (before any communication, so a bad input
    fails on all ranks instead of hanging some): q, k, v (``check_qkv``), the layout, the window, the heads over
    ``ulysses_size`` ranks, a zigzag piece of two equal chunks, and the document bounds of the global row of
    ``S_local · ulysses_size · ring_size`` tokens, which it returns as a list (None without ``cu_seqlens``)."""
    check_qkv(q, k, v)
    check_layout(layout)
    check_window(window, causal)
    if ulysses_size > 1:
        check_ulysses_heads(q.shape[2], k.shape[2], ulysses_size, setting="Ulysses group size")
    piece_len = q.shape[1] * ulysses_size  # a ring rank's piece, as the ring sees it after the all-to-all
    check_zigzag_piece(piece_len, ring_size, layout)
    return check_cu_seqlens(cu_seqlens, piece_len * ring_size)


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
    window: int | None = None,
    kernel: str = "auto",
) -> Tensor:
    """Exact attention over a sequence sharded across ``group`` with ``shard_sequence(layout=layout)``.

    q ``[B, S_local, Hq, D]``, k/v ``[B, S_local, Hkv, D]`` -> ``[B, S_local, Hq, D]`` in q's dtype,
    differentiable in q, k, v. ``group=None`` means a ring of one rank. ``cu_seqlens`` (int, ``[num_docs + 1]``,
    0 to S) are the document boundaries of the global sequence, the same on every rank and for every batch row;
    tokens then attend only inside their document. ``window`` (needs ``causal``): query ``i`` sees only keys
    ``j`` with ``i - window < j <= i`` (``window`` keys, itself included: Hugging Face's ``sliding_window``), in
    its document; ``window >= S`` is the same as no window. ``kernel``: ``"auto"`` or a kernel name
    (``KERNEL_CHOICES``), the first choice of ``resolve_kernel`` for each kind of block.
    """
    size = _group_coordinates(group)[1]
    bounds = check_attention_inputs(
        q, k, v, causal=causal, layout=layout, window=window, cu_seqlens=cu_seqlens, ring_size=size
    )
    check_kernel_choice(kernel)
    return attend_ring(
        q, k, v, group, causal=causal, layout=layout, scale=scale, bounds=bounds, window=window, kernel=kernel
    )


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
    window: int | None,
    kernel: str,
) -> Tensor:
    """``ring_attention`` on inputs already checked (``check_attention_inputs``; ``bounds`` is what it returned):
    the step for the attention functions that run the ring inside their own (``ulysses_attention``,
    ``usp_attention``)."""
    rank, size = _group_coordinates(group)
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
        window=None if window is None or window >= seq_len else window,
    )
    return _RingAttention.apply(q, k, v, group, plan, scale, kernel)
