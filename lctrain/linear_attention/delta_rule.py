"""The gated delta rule on pieces of a sequence, exact: a piece's summary, the summaries composed, each piece run
from its true entering state.

Per head, the state ``S`` is ``[dk, dv]`` and each token ``t`` updates it as transformers' reference does:
``S_t = M_t S_{t-1} + beta_t k_t v_t^T`` with ``M_t = exp(g_t) (I - beta_t k_t k_t^T)`` (``[dk, dk]``), and reads
``o_t = S_t^T q_t``. Over a piece of tokens the state leaving is therefore affine in the state entering:
``S_out = A S_in + B``, with ``A = M_T ... M_1`` (``[dk, dk]``) and ``B`` the state leaving from a zero state
(``[dk, dv]``), whatever the piece's length. The delta rule updates the state's columns independently (column j
sees only column j of the values), so one kernel run on values ``[0 | v]`` from the state ``[I | 0]`` leaves
``[A | B]``.

A document start restarts the state (a zero transition): a piece is cut into segments at the document starts it
holds; only its first segment, when no document starts at the piece's first token, continues the state entering
the piece. Its summary is that segment's ``(A, B)`` when it is the piece's only segment, else ``(0, B)`` of its
last segment, run from zero. ``compose`` chains the summaries in global order (fp32); ``finish_piece`` then gives
each continuing segment its outputs from its true entering state: the same run's outputs are ``[A_t^T q_t | o_t]``
(the state after token t read by q_t), so a piece's outputs from ``S`` are ``o_t + S^T A_t^T q_t`` without a second
run; a continuing segment followed by others in its piece (whose summary is not its) is run once from ``S``.

The kernel (``kernel.py``) is fla's chunked gated delta rule on CUDA in bf16/fp16 when installed (a piece's documents
that start from zero in one call, by their offsets), else transformers' pure-torch one (the Qwen3-Next and Qwen3.5
reference), with the queries' and keys' L2 norm inside it as the models call it. Everything is differentiable by
autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lctrain.linear_attention.kernel import gated_delta, gated_delta_documents


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, stop)`` of a rank's local sequence, in one document; ``continues``: the state entering it is
    the state leaving the previous piece in global order (no document starts at its first token)."""

    start: int
    stop: int
    continues: bool


def piece_segments(start: int, stop: int, local_start: int, doc_starts: Sequence[int]) -> list[Segment]:
    """The segments of the piece holding global tokens ``[start, stop)`` at local offset ``local_start``, cut at
    ``doc_starts`` (the global document starts, sorted; token 0 always starts one)."""
    cuts = sorted({start, *(s for s in doc_starts if start < s < stop)})
    continues = start != 0 and start not in doc_starts
    return [
        Segment(local_start + a - start, local_start + b - start, continues and a == start)
        for a, b in zip(cuts, [*cuts[1:], stop])
    ]


def _take(segment: Segment, *tensors: Tensor) -> list[Tensor]:
    return [t[:, segment.start : segment.stop] for t in tensors]


@dataclass
class PieceRun:
    """A piece's first pass: its summary ``[A | B]`` (``[B, Hv, dk, dk + dv]``, fp32), the outputs of the segments
    that start from zero (final), by segment index, and for a piece whose one segment continues the entering state,
    that run's outputs ``[A_t^T q_t | o_t from zero]`` (``[B, L, Hv, dk + dv]``, fp32): its outputs from the entering
    state ``S`` are ``o_t + S^T A_t^T q_t``, with no second run."""

    summary: Tensor
    outputs: dict[int, Tensor]
    reads: Tensor | None = None


def summarize_piece(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Sequence[Segment]) -> PieceRun:
    """The piece's summary and its final outputs (see the module docstring); tensors as ``kernel.gated_delta``'s,
    the whole local sequence, ``segments`` those of one piece."""
    batch, heads, dk, dv = v.shape[0], v.shape[2], q.shape[3], v.shape[3]
    from_zero = [index for index, segment in enumerate(segments) if not segment.continues]
    outputs, last_state = {}, None
    if from_zero:
        bounds = [(segments[i].start, segments[i].stop) for i in from_zero]
        outs, last_state = gated_delta_documents(q, k, v, g, beta, bounds)
        outputs = dict(zip(from_zero, outs))
    if segments[-1].continues:  # the only segment: [A | B] and the outputs' two parts in one run, in fp32
        qs, ks, vs, gs, bs = _take(segments[-1], q.float(), k, v, g, beta)
        eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(batch, heads, dk, dk)
        state = torch.cat([eye, eye.new_zeros(batch, heads, dk, dv)], dim=-1)
        values = torch.cat([vs.new_zeros(*vs.shape[:3], dk), vs], dim=-1)
        reads, summary = gated_delta(qs, ks, values, gs, bs, state)
        return PieceRun(summary, outputs, reads)
    summary = torch.cat([last_state.new_zeros(batch, heads, dk, dk), last_state], dim=-1)
    return PieceRun(summary, outputs)


def compose(summaries: Sequence[Tensor]) -> list[Tensor]:
    """The state entering each piece, given the summaries ``[A | B]`` of every piece of the sequence in global order
    (fp32, ``[B, Hv, dk, dk + dv]``): zero for the first, ``A_i S_i + B_i`` for the next."""
    dk = summaries[0].shape[2]
    states = [summaries[0].new_zeros(*summaries[0].shape[:2], dk, summaries[0].shape[3] - dk)]
    for summary in summaries[:-1]:
        states.append(summary[..., :dk] @ states[-1] + summary[..., dk:])
    return states


def finish_piece(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    segments: Sequence[Segment],
    run: PieceRun,
    entering: Tensor,
) -> Tensor:
    """The piece's outputs ``[B, L_piece, Hv, dv]`` in q's dtype: its continuing segment's from ``entering`` (the
    state the composition gives it: read through ``run.reads``, or run from it when the piece holds other segments
    too), its other segments' from ``run``."""
    outs, dk = [], q.shape[3]
    for index, segment in enumerate(segments):
        if segment.continues and run.reads is not None:
            reads = run.reads
            outs.append((reads[..., dk:] + torch.einsum("blhk,bhkv->blhv", reads[..., :dk], entering)).to(q.dtype))
        elif segment.continues:
            outs.append(gated_delta(*_take(segment, q, k, v, g, beta), entering)[0])
        else:
            outs.append(run.outputs[index])
    return torch.cat(outs, dim=1)


def delta_rule_pieces(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    pieces: Sequence[tuple[int, int]],
    doc_starts: Sequence[int],
) -> Tensor:
    """The gated delta rule over a whole sequence held as ``pieces`` (global ``[start, stop)`` runs, in local order,
    covering every token once), each summarised, composed and finished: equal to the unsplit recurrence with the
    state restarted at each of ``doc_starts``. q, k ``[B, S, Hk, dk]``, v ``[B, S, Hv, dv]``, g, beta
    ``[B, S, Hv]`` in local order -> ``[B, S, Hv, dv]``. The single-process form of what ``context.py`` does over
    ranks."""
    local, segments = 0, []
    for start, stop in pieces:
        segments.append(piece_segments(start, stop, local, doc_starts))
        local += stop - start
    runs = [summarize_piece(q, k, v, g, beta, s) for s in segments]
    order = sorted(range(len(pieces)), key=lambda i: pieces[i][0])
    entering = dict(zip(order, compose([runs[i].summary for i in order])))
    return torch.cat(
        [finish_piece(q, k, v, g, beta, s, r, entering[i]) for i, (s, r) in enumerate(zip(segments, runs))], dim=1
    )
