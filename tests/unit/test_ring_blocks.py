"""The ring plan computes exactly the visible (query, key) pairs, each once, and skips everything else."""

import random

import pytest
import torch

from lctrain.attention.ring_blocks import piece_chunks, plan_ring


def global_positions(ring_rank: int, ring_size: int, piece_len: int, layout: str) -> torch.Tensor:
    chunks = piece_chunks(ring_rank, ring_size, piece_len, layout)
    return torch.cat([torch.arange(c.start, c.stop) for c in chunks])


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, bounds: list[int] | None, causal: bool) -> torch.Tensor:
    """The true mask [Sq, Sk]: same document and, when causal, key not after query."""
    allowed = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if bounds is not None:
        edges = torch.tensor(bounds[1:-1])
        allowed &= torch.bucketize(q_pos, edges, right=True)[:, None] == torch.bucketize(k_pos, edges, right=True)
    if causal:
        allowed &= q_pos[:, None] >= k_pos[None, :]
    return allowed


def covered(blocks, piece_len: int) -> torch.Tensor:  # noqa: ANN001
    """How many times the plan's blocks compute each (local query, received key) pair."""
    count = torch.zeros(piece_len, piece_len, dtype=torch.int64)
    for block in blocks:
        rows = block.rows.stop - block.rows.start
        cols = block.cols.stop - block.cols.start
        tile = torch.ones(rows, cols, dtype=torch.int64)
        if block.causal:
            assert rows == cols
            tile = tile.tril()
        count[block.rows, block.cols] += tile
    return count


def random_bounds(seq_len: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(1, min(12, seq_len - 1))))
    if rng.random() < 0.5:  # length-1 documents
        cuts = sorted(set(cuts + [cuts[0] + 1] if cuts[0] + 1 < seq_len else cuts))
    return [0, *cuts, seq_len]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 8])
def test_plan_covers_exactly_the_visible_pairs(ring_size: int, causal: bool, layout: str) -> None:
    rng = random.Random(ring_size * 10 + causal)
    piece_len = 6
    seq_len = piece_len * ring_size
    for bounds in [None, [0, seq_len], *(random_bounds(seq_len, rng) for _ in range(8))]:
        plans = [
            plan_ring(
                rank,
                ring_size,
                piece_len,
                causal=causal,
                layout=layout,
                cu_seqlens=None if bounds is None else tuple(bounds),
            )
            for rank in range(ring_size)
        ]
        assert len({len(plan) for plan in plans}) == 1  # every rank runs the same number of ring steps
        assert any(plan[-1] for plan in plans)  # and the last one is needed by some rank
        for rank, plan in enumerate(plans):
            q_pos = global_positions(rank, ring_size, piece_len, layout)
            for step in range(ring_size):  # steps past the plan's end must have nothing to compute
                blocks = plan[step] if step < len(plan) else []
                k_pos = global_positions((rank - step) % ring_size, ring_size, piece_len, layout)
                expected = visible(q_pos, k_pos, bounds, causal).long()
                torch.testing.assert_close(covered(blocks, piece_len), expected, msg=f"{bounds} r{rank} s{step}")


def work(plan) -> int:  # noqa: ANN001
    total = 0
    for blocks in plan:
        for b in blocks:
            rows, cols = b.rows.stop - b.rows.start, b.cols.stop - b.cols.start
            total += rows * (rows + 1) // 2 if b.causal else rows * cols
    return total


def test_documents_skip_blocks_on_a_row_of_short_documents() -> None:
    """A 64K-token row of 128-token documents on a ring of 8: off-diagonal steps cost nothing."""
    ring_size, seq_len, doc_len = 8, 65536, 128
    bounds = list(range(0, seq_len + 1, doc_len))
    piece_len = seq_len // ring_size
    for rank in range(ring_size):
        dense = plan_ring(rank, ring_size, piece_len, causal=True, layout="zigzag")
        packed = plan_ring(
            rank,
            ring_size,
            piece_len,
            causal=True,
            layout="zigzag",
            cu_seqlens=None if bounds is None else tuple(bounds),
        )
        assert len(packed) == 1  # no document crosses a chunk boundary: one step, no communication
        assert work(packed) == 2 * (piece_len // 2 // doc_len) * doc_len * (doc_len + 1) // 2
        assert work(packed) * 50 < work(dense)
