"""Attention sinks (gpt-oss) under ring, Ulysses and USP on spawned gloo groups, against float64 attention on the
full sequence with the sink as an extra softmax column (``sink_reference_grads``).

Each case runs one fwd+bwd on every rank; outputs and q/k/v gradients are gathered and unsharded, the sinks'
gradient (each rank's: its queries, its heads) is summed over the ranks, as a replicated weight's is. The rows hold
one document, random documents, or preference pairs sharing their prompt (``doc_prefix``), with and without a
sliding window (the mask written out by ``visible_mask``: each answer sees its prompt and itself). Tolerances
(fp32): outputs 1e-5, gradients (the sinks' included) 3e-5 absolute, rtol 0. The sink changes nothing of what the
ring computes or sends: the kernel calls and the elements exchanged are those of the same case without sinks, so
windows and documents still skip the blocks they hide.
"""

from __future__ import annotations

import functools
import random
import zlib
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lctrain.attention import shard_sequence, unshard_sequence, usp_attention
from lctrain.attention.kernels import AttentionKernel, resolve_kernel
from lctrain.testing import run_distributed
from tests.distributed.test_attention import _groups
from tests.helpers.reference import random_pairs, sink_reference_grads, visible_mask

TOKENS_PER_RANK = 8


@dataclass(frozen=True)
class Case:
    ulysses: int
    ring: int
    layout: str
    documents: str = "one"  # "one", "random" (some of length 1, crossing pieces) or "pairs" (shared prompts)
    window: int | None = None
    causal: bool = True

    @property
    def seq_len(self) -> int:
        return TOKENS_PER_RANK * self.ring * self.ulysses

    @property
    def bounds(self) -> list[int] | None:
        s = self.seq_len
        if self.documents == "random":
            return [0, 1, 5, s // 2 + 3, s - 2, s]
        if self.documents == "pairs":
            return random_pairs(s, _rng(self))[0]
        return None

    @property
    def doc_prefix(self) -> list[int] | None:
        return random_pairs(self.seq_len, _rng(self))[1] if self.documents == "pairs" else None

    def __str__(self) -> str:
        window = "" if self.window is None else f"-window{self.window}"
        mask = "" if self.causal else "-full"
        return f"U{self.ulysses}R{self.ring}-{self.layout}-docs_{self.documents}{window}{mask}"


def _rng(case: Case) -> random.Random:
    return random.Random(f"{case.ulysses}{case.ring}{case.layout}")


CASES = [
    Case(1, 2, "zigzag"),
    Case(1, 2, "contiguous"),
    Case(1, 2, "zigzag", causal=False),
    Case(2, 1, "contiguous"),
    Case(1, 2, "zigzag", "random"),
    Case(1, 2, "zigzag", "one", window=3),  # smaller than a zigzag chunk (4): the far blocks are skipped
    Case(1, 2, "contiguous", "random", window=5),
    Case(2, 2, "zigzag"),
    Case(2, 2, "zigzag", "random", window=6),
    Case(2, 2, "contiguous", "pairs"),
    Case(1, 2, "zigzag", "pairs", window=3),  # preference pairs (shared prompts) under windows, in positions
    Case(2, 2, "zigzag", "pairs", window=5),
    Case(1, 4, "contiguous", "pairs", window=3),
    Case(1, 4, "zigzag", "random"),
    Case(1, 4, "zigzag", "random", window=3),
    Case(4, 1, "contiguous", "random", window=5),
]
COUNTED = [Case(1, 2, "zigzag", "one", window=3), Case(1, 4, "contiguous", "random", window=3)]


def make_inputs(case: Case) -> list[torch.Tensor]:
    """q (8 heads), k, v (2 heads, head_dim 80), dout and the sinks (8), the same in every process."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    tensors = [torch.randn(2, case.seq_len, h, 80, generator=gen) for h in (8, 2, 2, 8)]
    return [*tensors, 2 * torch.randn(8, generator=gen)]


def run_case(case: Case, sinks_on: bool = True) -> list[torch.Tensor]:
    """One fwd+bwd of usp_attention on this rank's shards: the full out, dq, dk, dv and the summed dsinks."""
    ring_group, ulysses_group, ring_rank, ulysses_rank = _groups(case.ring, case.ulysses)
    place = dict(ring_rank=ring_rank, ring_size=case.ring, ulysses_rank=ulysses_rank, ulysses_size=case.ulysses)
    q, k, v, dout, sinks = make_inputs(case)
    q, k, v, dout = (shard_sequence(t, dim=1, layout=case.layout, **place).clone() for t in (q, k, v, dout))
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    out = usp_attention(
        q,
        k,
        v,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        causal=case.causal,
        layout=case.layout,
        cu_seqlens=None if case.bounds is None else torch.tensor(case.bounds),
        doc_prefix=None if case.doc_prefix is None else torch.tensor(case.doc_prefix),
        window=case.window,
        sinks=sinks if sinks_on else None,
    )
    out.backward(dout)
    world = case.ring * case.ulysses
    gathered = []
    for t in (out.detach(), q.grad, k.grad, v.grad):
        shards = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(shards, t.contiguous())
        gathered.append(
            unshard_sequence(shards, dim=1, ring_size=case.ring, ulysses_size=case.ulysses, layout=case.layout)
        )
    dsinks = sinks.grad if sinks_on else torch.zeros_like(sinks)
    dist.all_reduce(dsinks)
    return [*gathered, dsinks]


def count_traffic(case: Case, sinks_on: bool) -> tuple[int, int]:
    """(kernel calls, elements sent) of this rank in one fwd+bwd."""
    calls, sent = [0], [0]

    def counting_resolve(device, dtype, **options) -> AttentionKernel:  # noqa: ANN001, ANN003
        inner = resolve_kernel(device, dtype, **options)

        def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            return inner.forward(*args, **kwargs)

        def backward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            return inner.backward(*args, **kwargs)

        return AttentionKernel(f"counting_{inner.name}", forward, backward)

    exchange = dist.batch_isend_irecv

    def counting_exchange(ops: list[dist.P2POp]) -> list:
        sent[0] += sum(op.tensor.numel() for op in ops if op.op is dist.isend)
        return exchange(ops)

    with (
        mock.patch("lctrain.attention.ring.resolve_kernel", counting_resolve),
        mock.patch.object(dist, "batch_isend_irecv", counting_exchange),
    ):
        run_case(case, sinks_on)
    return calls[0], sent[0]


def world_job(world: int) -> dict:
    results = {str(case): run_case(case) for case in CASES if case.ring * case.ulysses == world}
    for case in COUNTED:
        if case.ring * case.ulysses == world:
            results[f"counts {case}"] = (count_traffic(case, True), count_traffic(case, False))
    return results


@functools.cache
def results_for(world: int) -> list[dict]:
    return run_distributed(world_job, world, world)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sinks_match_float64_softmax_with_the_sink_column(case: Case) -> None:
    got = results_for(case.ring * case.ulysses)[0][str(case)]
    q, k, v, dout, sinks = make_inputs(case)
    visible = visible_mask(
        case.seq_len, causal=case.causal, bounds=case.bounds, doc_prefix=case.doc_prefix, window=case.window
    )
    expected = sink_reference_grads(q, k, v, dout, sinks, visible)
    tolerances = [dict(atol=1e-5, rtol=0)] + [dict(atol=3e-5, rtol=0)] * 4
    for name, actual, reference, tol in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, tolerances):
        torch.testing.assert_close(actual.double(), reference, **tol, msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.mark.parametrize("case", COUNTED, ids=str)
def test_sinks_change_no_kernel_call_and_no_transfer(case: Case) -> None:
    for rank, result in enumerate(results_for(case.ring * case.ulysses)):
        with_sinks, without = result[f"counts {case}"]
        assert with_sinks == without, f"rank {rank}: (calls, elements sent) {with_sinks} with sinks, {without} without"
