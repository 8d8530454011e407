"""Ring, Ulysses and USP attention on spawned gloo groups against float64 attention on the full sequence.

One process group is spawned per world size (start-up dominates on 2 cores); it runs every case for that world
size and returns the gathered, unsharded outputs and gradients, which the tests below compare with the
reference. Tolerances:
- fp32: outputs within 1e-5 absolute (rtol 0), gradients within 3e-5 absolute (rtol 0).
- bf16: 5e-2 absolute + 5e-2 relative. This catches layout, masking and merge bugs (which give O(1) errors);
  the precision claim for bf16 is ``test_bf16_error_does_not_grow_with_world_size``.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lctrain.attention import shard_sequence, timeline, unshard_sequence, usp_attention
from lctrain.attention.kernels import AttentionKernel, resolve_kernel
from lctrain.attention.ring_blocks import Block, Step, group_documents, piece_chunks, plan_ring, visible_pairs
from lctrain.attention.ring_transfers import PIECES
from lctrain.testing import run_distributed
from tests.helpers import fake_attention_ops
from tests.helpers.reference import (
    masked_reference_grads,
    random_pairs,
    reference_grads,
    unshared_reference_grads,
    visible_mask,
)

# (ulysses, ring) splits per world size, as in the issue, plus pure ring and pure Ulysses at 8.
SPLITS = {
    1: [(1, 1)],
    2: [(1, 2), (2, 1)],
    4: [(2, 2), (1, 4), (4, 1)],
    8: [(2, 4), (4, 2), (1, 8), (8, 1)],
}


@dataclass(frozen=True)
class Case:
    ulysses: int
    ring: int
    causal: bool
    layout: str
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    batch: int = 2
    tokens_per_rank: int = 8
    # "one" document, or packed: "spanning" (one spans every shard), "random" lengths, "short" (4 tokens each) or
    # "pairs" (preference pairs [prompt | chosen | rejected], the answers sharing the prompt, and plain documents)
    documents: str = "one"
    window: int | None = None  # sliding window (keys per query, itself included)

    @property
    def seq_len(self) -> int:
        return self.tokens_per_rank * self.ring * self.ulysses

    @property
    def bounds(self) -> list[int] | None:
        """cu_seqlens of the packed row (None = one document); includes length-1 documents."""
        s = self.seq_len
        if self.documents == "spanning":
            return [0, 1, 2, s - 3, s - 1, s]
        if self.documents == "short":
            return list(range(0, s + 1, 4))
        if self.documents == "random":
            rng = random.Random(str(self))
            return sorted({0, 1, 2, *rng.sample(range(3, s), s // 6), s})
        if self.documents == "pairs":
            return random_pairs(s, random.Random(str(self)))[0]
        return None

    @property
    def doc_prefix(self) -> list[int] | None:
        """Each document's shared prefix (-1: none) for "pairs", else None."""
        return random_pairs(self.seq_len, random.Random(str(self)))[1] if self.documents == "pairs" else None

    def reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
        """out, dq, dk, dv of float64 attention on the full sequence; with shared prefixes, the mask written out."""
        if self.doc_prefix is None:
            return reference_grads(q, k, v, dout, causal=self.causal, bounds=self.bounds, window=self.window)
        mask = visible_mask(
            self.seq_len, causal=self.causal, bounds=self.bounds, doc_prefix=self.doc_prefix, window=self.window
        )
        return masked_reference_grads(q, k, v, dout, mask)

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        dtype = str(self.dtype).removeprefix("torch.")
        docs = "" if self.documents == "one" else f"-docs_{self.documents}"
        heads = f"h{self.q_heads}kv{self.kv_heads}d{self.head_dim}"
        window = "" if self.window is None else f"-window{self.window}"
        return f"U{self.ulysses}R{self.ring}-{mask}-{self.layout}-{heads}-{dtype}{docs}{window}"


HEADS = [(8, 8, 64), (8, 2, 80)]  # MHA with a power-of-two head_dim; GQA (Hkv < U when U >= 4) with head_dim 80
CASES = [
    Case(u, r, causal, layout, hq, hkv, d, dtype)
    for world in SPLITS
    for (u, r) in SPLITS[world]
    for causal, layout, (hq, hkv, d), dtype in itertools.product(
        (True, False), ("zigzag", "contiguous"), HEADS, (torch.float32, torch.bfloat16)
    )
] + [  # packed rows: document masking, GQA with head_dim 80, fp32
    Case(u, r, causal, layout, 8, 2, 80, torch.float32, documents=documents)
    for world in SPLITS
    for (u, r) in SPLITS[world]
    for causal, layout, documents in itertools.product((True, False), ("zigzag", "contiguous"), ("spanning", "random"))
]


def windows(ulysses: int, ring: int, layout: str) -> list[int]:
    """Windows smaller than, equal to and larger than a ring rank's chunk, and larger than the sequence."""
    piece = 8 * ulysses  # tokens of a ring rank (8 per rank, gathered over its Ulysses group)
    chunk = piece // 2 if layout == "zigzag" and ring > 1 else piece
    return [chunk - 1, chunk, chunk + 3, piece * ring + 1]


WINDOW_SPLITS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (2, 4), (1, 8)]
CASES += [  # sliding windows: causal, GQA with head_dim 80, fp32, packed rows
    Case(u, r, True, layout, 8, 2, 80, torch.float32, documents=documents, window=window)
    for (u, r) in WINDOW_SPLITS
    for layout, documents in itertools.product(("zigzag", "contiguous"), ("spanning", "random"))
    for window in windows(u, r, layout)
]
PAIR_CASES = (
    [  # preference pairs sharing their prompt: GQA with head_dim 80, fp32
        Case(u, r, causal, layout, 8, 2, 80, torch.float32, documents="pairs")
        for world in SPLITS
        for (u, r) in SPLITS[world]
        for causal, layout in itertools.product((True, False), ("zigzag", "contiguous"))
    ]
    + [  # and sliding windows counted in positions
        Case(u, r, True, layout, 8, 2, 80, torch.float32, documents="pairs", window=window)
        for (u, r) in WINDOW_SPLITS
        for layout in ("zigzag", "contiguous")
        for window in windows(u, r, layout)[:3]
    ]
)
CASES += PAIR_CASES


def make_inputs(case: Case) -> list[torch.Tensor]:
    """q, k, v, dout on the full sequence, the same in every process (rounded to the case's dtype)."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))  # stable across processes
    shapes = [(case.batch, case.seq_len, h, case.head_dim) for h in (case.q_heads, case.kv_heads, case.kv_heads)]
    shapes.append(shapes[0])
    return [torch.randn(shape, generator=gen).to(case.dtype) for shape in shapes]


def _groups(ring: int, ulysses: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, int, int]:
    """(ring_group, ulysses_group, ring_rank, ulysses_rank); Ulysses innermost, as in the trainer's mesh."""
    if ring * ulysses == 1:
        return None, None, 0, 0
    mesh = init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
    return (
        mesh.get_group("ring"),
        mesh.get_group("ulysses"),
        mesh.get_local_rank("ring"),
        mesh.get_local_rank("ulysses"),
    )


def _gather(x: torch.Tensor, world: int, *, ring: int, ulysses: int, layout: str) -> torch.Tensor:
    shards = [x]
    if world > 1:
        shards = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(shards, x.contiguous())
    return unshard_sequence(shards, dim=1, ring_size=ring, ulysses_size=ulysses, layout=layout)


def run_usp(case: Case, ring_group, ulysses_group, ring_rank: int, ulysses_rank: int) -> list[torch.Tensor]:  # noqa: ANN001
    """One fwd+bwd of usp_attention on this rank's shards; returns full out, dq, dk, dv (gathered)."""

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(
            x,
            dim=1,
            ring_rank=ring_rank,
            ring_size=case.ring,
            ulysses_rank=ulysses_rank,
            ulysses_size=case.ulysses,
            layout=case.layout,
        ).clone()

    q, k, v, dout = (shard(x) for x in make_inputs(case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu_seqlens = torch.tensor(case.bounds, dtype=torch.int32) if case.bounds is not None else None
    doc_prefix = torch.tensor(case.doc_prefix) if case.doc_prefix is not None else None
    out = usp_attention(
        q,
        k,
        v,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        causal=case.causal,
        layout=case.layout,
        cu_seqlens=cu_seqlens,
        doc_prefix=doc_prefix,
        window=case.window,
    )
    out.backward(dout)
    world = case.ring * case.ulysses
    return [
        _gather(t, world, ring=case.ring, ulysses=case.ulysses, layout=case.layout)
        for t in (out.detach(), q.grad, k.grad, v.grad)
    ]


Call = tuple[str, int, int, bool, int | None]  # (pass, query rows, key rows, causal, window_left)


class CountingKernel:
    """Wraps the resolved kernel and records every call as a ``Call``."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def resolve(self, device: torch.device, dtype: torch.dtype, **case) -> AttentionKernel:  # noqa: ANN003
        inner = resolve_kernel(device, dtype, **case)

        def forward(q, k, v, *, causal, scale, window_left):  # noqa: ANN001, ANN202
            self.calls.append(("fwd", q.shape[1], k.shape[1], causal, window_left))
            return inner.forward(q, k, v, causal=causal, scale=scale, window_left=window_left)

        def backward(dout, q, k, v, out, lse, *, causal, scale, window_left):  # noqa: ANN001, ANN202
            self.calls.append(("bwd", q.shape[1], k.shape[1], causal, window_left))
            return inner.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window_left=window_left)

        return AttentionKernel(f"counting_{inner.name}", forward, backward)


@dataclass
class Counts:
    """One rank's kernel calls in one fwd+bwd, its P2P exchanges (``batch_isend_irecv`` calls) and the elements
    it sent."""

    calls: list[Call]
    exchanges: int
    sent: int


def count_kernel_calls(
    ring: int, layout: str, causal: bool, seq_len: int, documents: str = "one", window: int | None = None
) -> Counts:
    """Counts of pure ring attention (ulysses 1) on this rank, 4 heads of 16 dims."""
    case = Case(
        1,
        ring,
        causal,
        layout,
        4,
        4,
        16,
        torch.float32,
        batch=1,
        tokens_per_rank=seq_len // ring,
        documents=documents,
        window=window,
    )
    counter = CountingKernel()
    counts = Counts(counter.calls, 0, 0)
    groups = _groups(ring, 1)
    exchange = dist.batch_isend_irecv

    def counting_exchange(ops: list[dist.P2POp]) -> list:
        counts.exchanges += 1
        counts.sent += sum(op.tensor.numel() for op in ops if op.op is dist.isend)
        return exchange(ops)

    with (
        mock.patch("lctrain.attention.ring.resolve_kernel", counter.resolve),
        mock.patch.object(dist, "batch_isend_irecv", counting_exchange),
    ):
        run_usp(case, *groups)
    return counts


def record_timeline(world: int) -> tuple[list[dict], list[Call]]:
    """One fwd+bwd of pure ring attention (zigzag, causal) with the ring timeline on: the records this rank wrote
    (``LCTRAIN_RING_TIMELINE``) and its kernel calls (``CountingKernel``)."""
    case = Case(1, world, True, "zigzag", 4, 4, 16, torch.float32, batch=1, tokens_per_rank=16)
    counter = CountingKernel()
    with (
        tempfile.TemporaryDirectory() as directory,
        mock.patch.dict(os.environ, {timeline.ENVIRONMENT: directory}),
        mock.patch("lctrain.attention.ring.resolve_kernel", counter.resolve),
    ):
        run_usp(case, *_groups(world, 1))
        return timeline.read_timelines(Path(directory), dist.get_rank()), counter.calls


def bad_input_errors(world: int) -> dict[str, str]:
    """Message of each bad-input error, raised on every rank before any communication (no rank hangs)."""
    ring_group, ulysses_group, _, _ = _groups(1, world)
    errors = {}

    def attempt(name: str, **kwargs) -> None:  # noqa: ANN003
        shapes = kwargs.pop("shapes")
        q, k, v = (torch.randn(*s) for s in shapes)
        try:
            usp_attention(q, k, v, **kwargs)
        except (ValueError, NotImplementedError) as error:
            errors[name] = str(error)

    attempt("q_heads", shapes=[(1, 4, 5, 8)] * 3, ulysses_group=ulysses_group)
    attempt("kv_heads", shapes=[(1, 4, 12, 8), (1, 4, 3, 8), (1, 4, 3, 8)], ulysses_group=ulysses_group)
    attempt("odd_zigzag", shapes=[(1, 3, 4, 8)] * 3, ring_group=ulysses_group, layout="zigzag")
    attempt("same_group", shapes=[(1, 4, 4, 8)] * 3, ring_group=ulysses_group, ulysses_group=ulysses_group)
    attempt("layout", shapes=[(1, 4, 4, 8)] * 3, ring_group=ulysses_group, layout="striped")
    attempt(
        "cu_seqlens",
        shapes=[(1, 4, 4, 8)] * 3,
        ring_group=ulysses_group,
        cu_seqlens=torch.tensor([0, 4 * world + 1], dtype=torch.int32),
    )
    attempt("window", shapes=[(1, 4, 4, 8)] * 3, ring_group=ulysses_group, window=0)
    attempt("window_not_causal", shapes=[(1, 4, 4, 8)] * 3, ulysses_group=ulysses_group, causal=False, window=2)
    return errors


BF16_GROWTH = dict(batch=1, seq_len=1024, heads=8, head_dim=64)


def bf16_growth_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    b, s, h, d = (BF16_GROWTH[key] for key in ("batch", "seq_len", "heads", "head_dim"))
    return [torch.randn(b, s, h, d, generator=gen).bfloat16() for _ in range(4)]


def rounding_to_bf16(device: torch.device, dtype: torch.dtype, **case) -> AttentionKernel:  # noqa: ANN003
    """The resolved kernel with every block result rounded to bf16, as a native-bf16 kernel (CUDA) returns it."""
    inner = resolve_kernel(device, dtype, **case)

    def forward(q, k, v, **options):  # noqa: ANN001, ANN003, ANN202
        out, lse = inner.forward(q, k, v, **options)
        return out.to(q.dtype), lse

    def backward(*args, **options):  # noqa: ANN002, ANN003, ANN202
        return tuple(grad.to(args[1].dtype) for grad in inner.backward(*args, **options))

    return AttentionKernel(f"bf16_rounding_{inner.name}", forward, backward)


def run_bf16_growth(ulysses: int, ring: int, round_blocks: bool) -> list[torch.Tensor]:
    ring_group, ulysses_group, ring_rank, ulysses_rank = _groups(ring, ulysses)
    world = ring * ulysses

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(
            x, dim=1, ring_rank=ring_rank, ring_size=ring, ulysses_rank=ulysses_rank, ulysses_size=ulysses
        ).clone()

    q, k, v, dout = (shard(x) for x in bf16_growth_inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with mock.patch("lctrain.attention.ring.resolve_kernel", rounding_to_bf16 if round_blocks else resolve_kernel):
        out = usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, causal=True)
        out.backward(dout)
    return [
        _gather(t, world, ring=ring, ulysses=ulysses, layout="zigzag") for t in (out.detach(), q.grad, k.grad, v.grad)
    ]


# The H200's auto kernels (cuDNN; windows and document groups on PyTorch's flash kernels, one varlen call per
# group) through CPU stand-ins for the CUDA ops, in float64: the engine's grouping across ring steps and ranks.
FAKE_H200_CASES = [
    Case(u, r, True, "zigzag", 8, 2, 16, torch.float64, documents=documents, window=window)
    for (u, r) in [(1, 2), (2, 2), (1, 4)]
    for documents, window in (
        ("short", None),
        ("random", None),
        ("random", 5),
        ("one", 5),
        ("pairs", None),
        ("pairs", 5),
    )
]


def run_fake_h200(case: Case, *groups) -> tuple[list[torch.Tensor], dict]:  # noqa: ANN002
    with (
        fake_attention_ops.patched() as calls,
        mock.patch("lctrain.attention.ring.resolve_kernel", lambda *a, **k: fake_attention_ops.h200_auto_kernel()),
    ):
        tensors = run_usp(case, *groups)
    return tensors, dict(calls)


def world_job(world: int) -> dict:
    """Everything one spawned group of ``world`` ranks computes. Rank 0's result holds the gathered tensors."""
    results: dict = {"cases": {}}
    results["fake_h200"] = {}
    for ulysses, ring in SPLITS[world]:
        groups = _groups(ring, ulysses)
        for case in CASES:
            if (case.ulysses, case.ring) == (ulysses, ring):
                results["cases"][str(case)] = run_usp(case, *groups)
        for case in FAKE_H200_CASES:
            if (case.ulysses, case.ring) == (ulysses, ring):
                results["fake_h200"][str(case)] = run_fake_h200(case, *groups)
    if world > 1:
        results["errors"] = bad_input_errors(world)
        results["counts"] = {}
        cases = [(layout, causal, "one") for layout in ("zigzag", "contiguous") for causal in (True, False)]
        for layout, causal, documents in [*cases, ("zigzag", True, "short")]:
            key = (layout, causal) if documents == "one" else (layout, causal, documents)
            results["counts"][key] = count_kernel_calls(world, layout, causal, 16 * world, documents)
        for layout in ("zigzag", "contiguous"):  # 16 tokens per rank, chunks of 8 (zigzag) or 16, window 4
            results["counts"][(layout, "window")] = count_kernel_calls(world, layout, True, 16 * world, window=4)
            results["counts"][(layout, True, "pairs")] = count_kernel_calls(world, layout, True, 16 * world, "pairs")
        results["timeline"] = record_timeline(world)
    if world == 8:
        results["bf16_growth"] = {
            (u, r, round_blocks): run_bf16_growth(u, r, round_blocks)
            for (u, r) in SPLITS[8]
            for round_blocks in (False, True)
        }
    return results


@functools.cache
def results_for(world: int) -> list[dict]:
    """Per-rank results of ``world_job`` (spawned once per world size and cached for the session)."""
    if world == 1:
        return [world_job(1)]
    return run_distributed(world_job, world, world)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_usp_matches_float64_reference(case: Case) -> None:
    world = case.ring * case.ulysses
    got = results_for(world)[0]["cases"][str(case)]
    expected = case.reference(*make_inputs(case))
    if case.dtype == torch.float32:
        tolerances = [dict(atol=1e-5, rtol=0)] + [dict(atol=3e-5, rtol=0)] * 3
    else:
        tolerances = [dict(atol=5e-2, rtol=5e-2)] * 4
    for name, actual, reference, tol in zip(("out", "dq", "dk", "dv"), got, expected, tolerances):
        assert actual.dtype == case.dtype, name
        torch.testing.assert_close(actual.double(), reference, **tol, msg=lambda m, n=name: f"{case} {n}: {m}")


def _relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return ((actual.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("round_blocks", [False, True], ids=["cpu-kernel", "bf16-rounded-blocks"])
@pytest.mark.parametrize("split", SPLITS[8], ids=lambda s: f"U{s[0]}R{s[1]}")
def test_bf16_error_does_not_grow_with_world_size(split: tuple[int, int], round_blocks: bool) -> None:
    """bf16 relative (Frobenius) error vs float64 at P=8 stays within 1.5x of one device's bf16 SDPA error.

    The CPU kernel computes bf16 blocks in fp32; ``bf16-rounded-blocks`` rounds every block result to bf16 first,
    as a native bf16 kernel does, so the bound also covers the merge of rounded partial results.
    """
    got = results_for(8)[0]["bf16_growth"][(*split, round_blocks)]
    q, k, v, dout = bf16_growth_inputs()
    expected = reference_grads(q, k, v, dout, causal=True)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    single_out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q1, k1, v1)), is_causal=True)
    single_out = single_out.transpose(1, 2)
    single_out.backward(dout)
    single = [single_out.detach(), q1.grad, k1.grad, v1.grad]
    for name, actual, one_device, reference in zip(("out", "dq", "dk", "dv"), got, single, expected):
        distributed_error = _relative_error(actual, reference)
        single_error = _relative_error(one_device, reference)
        assert distributed_error <= 1.5 * single_error, (name, distributed_error, single_error)


def _work(calls: list[Call]) -> float:
    """Query×key pairs a rank computed (a causal diagonal block counts half; ``visible_pairs`` for bands)."""
    return sum(
        visible_pairs(Block(slice(0, rows), slice(0, cols), causal, window_left))
        if window_left is not None
        else rows * cols * (0.5 if causal else 1.0)
        for _, rows, cols, causal, window_left in calls
    )


def _counts(world: int, key: tuple) -> list[Counts]:
    return [rank_result["counts"][key] for rank_result in results_for(world)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work(world: int) -> None:
    per_rank = [counts.calls for counts in _counts(world, ("zigzag", True))]
    # one fwd call per ring step, the last one's split into PIECES (its keys arrive in pieces); one bwd call for the
    # own piece and PIECES for each other step (its dK/dV leave in pieces)
    assert all(len(calls) == (world - 1 + PIECES) + (1 + (world - 1) * PIECES) for calls in per_rank)
    # K/V are fetched R - 2 times whole and once in PIECES pieces in the forward, R - 2 times in the backward
    # (which starts with the last step, on the K/V the forward kept); dK/dV returned R - 1 times in PIECES pieces
    exchanges = 2 * (world - 2) + PIECES + (world - 1) * PIECES
    assert all(counts.exchanges == exchanges for counts in _counts(world, ("zigzag", True)))
    assert len({_work(calls) for calls in per_rank}) == 1
    # Full attention would be R blocks of (S/R)^2 per pass; zigzag causal computes about half of that.
    full_work = 2 * world * (16 * world // world) ** 2
    assert _work(per_rank[0]) < 0.6 * full_work


@pytest.mark.parametrize("world", [2, 4, 8])
def test_timeline_locates_every_transfer_against_the_blocks(world: int) -> None:
    """The timeline has a record per pass with every kernel call and every transfer (posted, waited for, done, in
    that order), and shows the schedule: the forward's step s + 1 K/V posted before step s computes, the last
    step's in pieces, each waited for once the blocks of the pieces before it have computed; the backward from the
    last step down to the own piece, the next step's K/V travelling while a step computes, its dK/dV leaving in
    pieces while it still computes, and the last return while the own piece computes."""
    steps = list(range(world))
    for rank_result in results_for(world):
        (forward, backward), calls = rank_result["timeline"]
        assert (forward["pass"], backward["pass"]) == ("forward", "backward")
        for record, kind, order in ((forward, "fwd", steps), (backward, "bwd", steps[::-1])):
            computed = [e for e in record["events"] if e["what"] == "compute"]
            assert [source for source, _ in itertools.groupby(e["source"] for e in computed)] == order
            assert len(computed) == sum(call[0] == kind for call in calls)
            for event in record["events"]:
                if event["what"] != "compute":
                    assert event["posted"] <= event["wait"] <= event["done"] <= record["duration"]
        starts, ends = {}, {}
        for record in (forward, backward):
            for event in (e for e in record["events"] if e["what"] == "compute"):
                starts.setdefault((record["pass"], event["source"]), event["start"])  # the step's first call
                ends[(record["pass"], event["source"])] = event["end"]  # its last
        kv = [e for e in forward["events"] if e["what"] == "kv"]
        assert [e["source"] for e in kv] == steps[1:-1] + [world - 1] * PIECES
        assert all(e["posted"] <= starts[("forward", e["source"] - 1)] for e in kv)
        first_end = next(e["end"] for e in forward["events"] if e["what"] == "compute" and e["source"] == world - 1)
        assert all(e["wait"] >= first_end for e in kv[-PIECES + 1 :])  # later pieces awaited as blocks need them
        kv = [e for e in backward["events"] if e["what"] == "kv"]
        assert [e["source"] for e in kv] == steps[-2:0:-1]  # not the last step's: kept from the forward
        assert all(e["posted"] <= starts[("backward", e["source"] + 1)] for e in kv)
        returned = [e for e in backward["events"] if e["what"] == "dkv"]
        assert [e["source"] for e in returned] == [s for s in steps[:0:-1] for _ in range(PIECES)]
        assert all(e["posted"] <= starts[("backward", e["source"] - 1)] <= e["done"] for e in returned)
        for source in steps[1:]:  # the first piece leaves while the step's later blocks still compute
            first = next(e for e in returned if e["source"] == source)
            assert first["posted"] < ends[("backward", source)]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_documents_skip_blocks_no_query_can_see(world: int) -> None:
    """Documents of 4 tokens never cross a zigzag chunk (8 tokens): each rank computes its 2 + 2 documents at
    step 0, as causal 4x4 squares, and the ring stops there: no K/V is sent at all."""
    for rank_result in results_for(world):
        calls = rank_result["counts"][("zigzag", True, "short")].calls
        assert sorted(calls) == sorted([("fwd", 4, 4, True, None)] * 4 + [("bwd", 4, 4, True, None)] * 4)
        assert _work(rank_result["counts"][("zigzag", True)].calls) == 4 * world * _work(calls)  # 1/(4R) of it
        assert rank_result["counts"][("zigzag", True, "short")].exchanges == 0  # no rank needs another's K/V


@pytest.mark.parametrize("world", [2, 4, 8])
def test_contiguous_causal_skips_masked_blocks(world: int) -> None:
    per_rank = [counts.calls for counts in _counts(world, ("contiguous", True))]
    # Rank r sees keys of ranks 0..r only: r + 1 forward blocks (the last ring step's, rank R - 1's only, split into
    # PIECES) and r + 1 backward blocks (each but the own piece's split into PIECES); later blocks are skipped.
    split = [PIECES - 1 if rank == world - 1 else 0 for rank in range(world)]
    assert [len(calls) for calls in per_rank] == [rank + 1 + split[rank] + 1 + rank * PIECES for rank in range(world)]
    non_causal = [counts.calls for counts in _counts(world, ("contiguous", False))]
    assert [len(calls) for calls in non_causal] == [world - 1 + PIECES + 1 + (world - 1) * PIECES] * world


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_errors_name_the_setting(world: int) -> None:
    for rank_result in results_for(world):
        errors = rank_result["errors"]
        assert f"Ulysses group size={world} does not divide the 5 attention heads" in errors["q_heads"]
        assert "and the 3 key/value heads: one must divide the other" in errors["kv_heads"]
        assert "2·ring_size·ulysses_size" in errors["odd_zigzag"]
        assert "must be orthogonal" in errors["same_group"]
        assert "layout='striped'" in errors["layout"]
        assert (
            f"cu_seqlens ends at {4 * world + 1} but the sharded sequence has {4 * world} tokens"
            in errors["cu_seqlens"]
        )
        assert "window=0 must be a positive int" in errors["window"]
        assert "window=2 needs causal=True" in errors["window_not_causal"]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_small_window_computes_the_band_and_sends_only_its_edge(world: int, layout: str) -> None:
    """Window 4 on 16 tokens per rank: each query's work is the keys it sees (min(4, position + 1)), so a rank's
    work is its tokens x window at most; what travels are the 3 tokens before a chunk, from the ring neighbour
    that holds them (zigzag: up to two neighbours), and no other step sends or computes anything."""
    window, tokens, heads, dim = 4, 16, 4, 16
    for rank, counts in enumerate(_counts(world, (layout, "window"))):
        chunks = piece_chunks(rank, world, tokens, layout)
        positions = [p for chunk in chunks for p in range(chunk.start, chunk.stop)]
        band = sum(min(window, p + 1) for p in positions)
        assert _work([c for c in counts.calls if c[0] == "fwd"]) == band <= tokens * window
        assert _work([c for c in counts.calls if c[0] == "bwd"]) == band
        # A chunk's last window - 1 tokens go to the rank holding the next chunk, if another; K/V travel in the
        # forward and again in the backward, except those of the last step, which the forward kept; the backward
        # returns dK/dV of what this rank fetched to their owners.
        starts = {c.start: owner for owner in range(world) for c in piece_chunks(owner, world, tokens, layout)}
        stops = {c.stop: owner for owner in range(world) for c in piece_chunks(owner, world, tokens, layout)}
        sending = sum(starts.get(chunk.stop, rank) != rank for chunk in chunks)
        fetching = sum(stops.get(chunk.start, rank) != rank for chunk in chunks)
        last = plan_ring(rank, world, tokens, causal=True, layout=layout, window=window)[-1].send
        kept = (last.stop - last.start) * 2 * heads * dim  # K and V this rank sent at the last step
        assert counts.sent == (2 * sending + fetching) * 2 * (window - 1) * heads * dim - kept
        steps = 2 if layout == "contiguous" or world == 2 else 3  # sources 0, 1 (and R - 1 for zigzag)
        # forward: a fetch per other step, the last in PIECES pieces; backward: a fetch per other step but the last,
        # and the dK/dV of each other step returned in PIECES pieces
        assert counts.exchanges == (steps - 2) + PIECES + (steps - 2) + (steps - 1) * PIECES


def _piece_calls(step: Step) -> int:
    """The forward calls the last step makes beyond its grouped ones: its keys arrive in PIECES runs of rows
    (rows · i // PIECES), and each full rectangle (no mask, band or group) is computed once per run it spans."""
    if step.source == 0:
        return 0
    rows = step.keys.stop - step.keys.start
    bounds = [rows * i // PIECES for i in range(PIECES + 1)]
    extra = 0
    for block in group_documents(step.blocks):
        if not block.causal and block.window_left is None and block.segments is None:
            spans = sum(max(block.cols.start, a) < min(block.cols.stop, b) for a, b in zip(bounds, bounds[1:]))
            extra += spans - 1
    return extra


@pytest.mark.parametrize("case", FAKE_H200_CASES, ids=str)
def test_h200_kernels_group_documents_into_one_call_per_run(case: Case) -> None:
    """Every rank makes exactly the plan's grouped calls (one varlen call per run of documents lying end to end,
    instead of one per document) and the result is exact (float64 stand-ins for the CUDA ops)."""
    world = case.ring * case.ulysses
    per_rank = results_for(world)
    tensors, _ = per_rank[0]["fake_h200"][str(case)]
    expected = case.reference(*make_inputs(case))
    for name, actual, reference in zip(("out", "dq", "dk", "dv"), tensors, expected):
        torch.testing.assert_close(actual, reference, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{case} {n}: {m}")
    bounds = None if case.bounds is None else tuple(case.bounds)
    doc_prefix = None if case.doc_prefix is None else tuple(case.doc_prefix)
    piece = case.tokens_per_rank * case.ulysses
    for rank, rank_result in enumerate(per_rank):
        _, calls = rank_result["fake_h200"][str(case)]
        window = case.window if case.window is not None and case.window < case.seq_len else None
        plan = plan_ring(
            rank // case.ulysses,
            case.ring,
            piece,
            causal=True,
            layout="zigzag",
            cu_seqlens=bounds,
            doc_prefix=doc_prefix,
            window=window,
        )
        grouped = sum(len(group_documents(step.blocks)) for step in plan)
        forward = calls.get("_flash_attention_forward", 0) + calls.get("_scaled_dot_product_cudnn_attention", 0)
        assert forward == grouped + _piece_calls(plan[-1]), (rank, calls, grouped)
        if case.documents == "short":  # 4-token documents: a rank's diagonal documents are one call
            assert grouped < sum(len(step.blocks) for step in plan)


@pytest.mark.parametrize("case", [case for case in PAIR_CASES if case.causal], ids=str)
def test_shared_prefix_equals_the_prompt_repeated(case: Case) -> None:
    """Preference pairs sharing their prompt give what float64 attention gives on the row with the prompt repeated
    for each answer (two plain documents): the same outputs, and the prompt's gradients the sum of its copies'."""
    got = results_for(case.ring * case.ulysses)[0]["cases"][str(case)]
    options = dict(bounds=case.bounds, doc_prefix=case.doc_prefix, window=case.window)
    expected = unshared_reference_grads(*make_inputs(case), **options)
    tolerances = [dict(atol=1e-5, rtol=0)] + [dict(atol=3e-5, rtol=0)] * 3
    for name, actual, reference, tol in zip(("out", "dq", "dk", "dv"), got, expected, tolerances):
        torch.testing.assert_close(actual.double(), reference, **tol, msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_shared_prefix_skips_chosen_by_rejected_blocks(world: int, layout: str) -> None:
    """The kernels compute exactly the visible pairs of a row of preference pairs, over all ranks: each pair
    computed as one causal document would cost its chosen x rejected rectangle more."""
    case = Case(1, world, True, layout, 4, 4, 16, torch.float32, batch=1, tokens_per_rank=16, documents="pairs")
    bounds, doc_prefix = case.bounds, case.doc_prefix
    mask = visible_mask(case.seq_len, causal=True, bounds=bounds, doc_prefix=doc_prefix)
    pairs = [doc for doc in range(len(doc_prefix)) if doc in doc_prefix]  # prompts, each before its two answers
    merged = [b for doc, b in enumerate(bounds) if doc - 1 not in pairs and doc - 2 not in pairs]  # a pair: one doc
    skipped = sum((bounds[p + 2] - bounds[p + 1]) * (bounds[p + 3] - bounds[p + 2]) for p in pairs)
    assert pairs and visible_mask(case.seq_len, causal=True, bounds=merged).sum() - mask.sum() == skipped
    for kind in ("fwd", "bwd"):
        work = sum(
            visible_pairs(Block(slice(0, rows), slice(0, cols), causal, window_left))
            for counts in _counts(world, (layout, True, "pairs"))
            for pass_, rows, cols, causal, window_left in counts.calls
            if pass_ == kind
        )
        assert work == mask.sum()
