"""The gated delta rule on pieces of a sequence, exact: each piece's segments run, the exported maps composed in
global order, each segment finished from its true entering state.

Per head, the state ``S`` is ``[dk, dv]`` and each token ``t`` updates it as transformers' reference does:
``S_t = M_t S_{t-1} + beta_t k_t v_t^T`` with ``M_t = exp(g_t) (I - beta_t k_t k_t^T)`` (``[dk, dk]``), and reads
``o_t = S_t^T q_t``. Over a run of tokens the state leaving is therefore affine in the state entering:
``S_out = A S_in + B``, with ``A = M_T ... M_1`` (``[dk, dk]``) and ``B`` the state leaving from a zero state
(``[dk, dv]``), whatever the run's length. The delta rule updates the state's columns independently (column j sees
only column j of the values), so one kernel run on values ``[0 | v]`` from the state ``[a | b]`` leaves
``[A a | A b + B]``: the map from a node ``X`` (the state ``a X + b`` entering) to the state leaving.

The segments of a piece (``plan.py``) whose entering state is known without the composition (zero, or the state
leaving such a segment) run once, finished. Those affine in a node ``X`` run once on ``[0 | v]`` from their map
(``[I | 0]`` at the node): besides the map leaving, the outputs are ``[a^T A_t^T q_t | o_t from b]`` (the state
after token t read by q_t), so the outputs from ``X`` are ``o_t + X^T a^T A_t^T q_t`` without a second run. A
segment whose map nothing exported needs (``deferred``) runs once from its true entering state after the
composition instead. ``compose`` gives each node from the exported maps in global order (fp32).

The kernel (``kernel.py``) is fla's chunked gated delta rule on CUDA in bf16/fp16 when installed (a piece's documents
that start from zero in one call, by their offsets), else transformers' pure-torch one (the Qwen3-Next and Qwen3.5
reference), with the queries' and keys' L2 norm inside it as the models call it. Everything is differentiable by
autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lctrain.linear_attention.kernel import gated_delta, gated_delta_documents
from lctrain.linear_attention.plan import Node, PiecePlan, RowPlan, Segment


def _take(segment: Segment, *tensors: Tensor) -> list[Tensor]:
    return [t[:, segment.start : segment.stop] for t in tensors]


@dataclass
class PieceRun:
    """A piece's first pass, by segment index: ``outputs`` of the known segments (final), ``reads``
    (``[B, L_s, Hv, dk + dv]`` fp32) of the segments run on their maps, and ``leaving``: the known state
    (``[B, Hv, dk, dv]``) or the map ``[a | b]`` (``[B, Hv, dk, dk + dv]``) leaving each segment run."""

    outputs: dict[int, Tensor] = field(default_factory=dict)
    reads: dict[int, Tensor] = field(default_factory=dict)
    leaving: dict[int, Tensor] = field(default_factory=dict)


def summarize_piece(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, piece: PiecePlan) -> PieceRun:
    """Run the piece's segments that need no composition's result (see the module docstring); tensors as
    ``kernel.gated_delta``'s, the whole local sequence. Consecutive segments from zero run as one call's
    documents."""
    run, dk, segments = PieceRun(), q.shape[3], piece.segments
    for index, segment in enumerate(segments):
        kind, ref = segment.source
        if segment.deferred or index in run.leaving:
            continue
        if segment.symbol is None and kind == "zero":
            group = [index]
            while group[-1] + 1 < len(segments) and segments[group[-1] + 1].source[0] == "zero":
                group.append(group[-1] + 1)
            bounds = [(segments[i].start, segments[i].stop) for i in group]
            outs, states = gated_delta_documents(q, k, v, g, beta, bounds)
            run.outputs.update(zip(group, outs))
            run.leaving.update(zip(group, states))
        elif segment.symbol is None:
            run.outputs[index], run.leaving[index] = gated_delta(*_take(segment, q, k, v, g, beta), run.leaving[ref])
        else:
            qs, ks, vs, gs, bs = _take(segment, q.float(), k, v, g, beta)
            if kind == "segment":
                state = run.leaving[ref]
            else:  # the map [I | 0] at the node
                eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(v.shape[0], v.shape[2], dk, dk)
                state = torch.cat([eye, eye.new_zeros(*eye.shape[:3], v.shape[3])], dim=-1)
            values = torch.cat([vs.new_zeros(*vs.shape[:3], dk), vs], dim=-1)
            run.reads[index], run.leaving[index] = gated_delta(qs, ks, values, gs, bs, state)
    return run


def exported_maps(runs: Sequence[PieceRun], plan: RowPlan, like: Tensor) -> Tensor:
    """This rank's exported maps ``[slots, B, Hv, dk, dk + dv]`` (fp32; a known state as ``[0 | S]``, padding zero):
    ``runs`` of ``plan.pieces``, ``like`` a map's shape and device (``[B, Hv, dk, dk + dv]``)."""
    dk, maps = like.shape[2], []
    for piece, run in zip(plan.pieces, runs):
        for _, index in piece.exports:
            state = run.leaving[index]
            maps.append(
                state
                if piece.segments[index].symbol is not None
                else torch.cat([state.new_zeros(*state.shape[:2], dk, dk), state], dim=-1)
            )
    maps += [like.new_zeros(like.shape)] * (plan.slots - len(maps))
    return torch.stack(maps)


def compose(maps: Sequence[Tensor], links: Sequence[tuple[Node, Node | None]]) -> dict[Node, Tensor]:
    """Every node's state ``[B, Hv, dk, dv]`` from the maps ``[a | b]`` (fp32 ``[B, Hv, dk, dk + dv]``) that define
    them, given in global order with (node, the node the map is of: None for a known state ``b``)."""
    states: dict[Node, Tensor] = {}
    for summary, (node, symbol) in zip(maps, links):
        dk = summary.shape[2]
        states[node] = summary[..., dk:] if symbol is None else summary[..., :dk] @ states[symbol] + summary[..., dk:]
    return states


def finish_piece(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, piece: PiecePlan, run: PieceRun, states: dict
) -> Tensor:
    """The piece's outputs ``[B, L_piece, Hv, dv]`` in q's dtype: each segment's from its true entering state, given
    the nodes' ``states`` (``compose``)."""
    outs, actual, dk = [], {}, q.shape[3]

    def leaving(index: int) -> Tensor:  # the true state leaving a segment run before the composition
        if index not in actual:
            state, symbol = run.leaving[index], piece.segments[index].symbol
            actual[index] = state if symbol is None else state[..., :dk] @ states[symbol] + state[..., dk:]
        return actual[index]

    for index, segment in enumerate(piece.segments):
        if segment.symbol is None:
            outs.append(run.outputs[index])
        elif not segment.deferred:
            reads, entering = run.reads[index], states[segment.symbol]
            outs.append((reads[..., dk:] + torch.einsum("blhk,bhkv->blhv", reads[..., :dk], entering)).to(q.dtype))
        else:
            kind, ref = segment.source
            state = leaving(ref) if kind == "segment" else states[segment.source]
            out, actual[index] = gated_delta(*_take(segment, q, k, v, g, beta), state)
            outs.append(out)
    return torch.cat(outs, dim=1)


def delta_rule_pieces(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    plan: RowPlan,
    gather: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """The gated delta rule on this rank's pieces of ``plan``: q, k ``[B, L, Hk, dk]``, v ``[B, L, Hv, dv]``, g,
    beta ``[B, L, Hv]`` in local order -> (``[B, L, Hv, dv]``, the gathered maps ``[P, slots, ...]``). ``gather``
    stacks every rank's exported maps in rank order (``lambda t: t[None]`` on one rank holding every piece); each
    document runs as if alone after its prefix (``plan.py``)."""
    runs = [summarize_piece(q, k, v, g, beta, piece) for piece in plan.pieces]
    like = v.new_empty(v.shape[0], v.shape[2], q.shape[3], q.shape[3] + v.shape[3], dtype=torch.float32)
    maps = gather(exported_maps(runs, plan, like))
    states = compose([maps[r, s] for r, s, _, _ in plan.links], [(node, symbol) for _, _, node, symbol in plan.links])
    out = torch.cat([finish_piece(q, k, v, g, beta, p, run, states) for p, run in zip(plan.pieces, runs)], dim=1)
    return out, maps
