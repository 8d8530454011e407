"""The ring plan computes exactly the visible (query, key) pairs, each once, fetches only the keys it uses, and
skips everything else."""

import random

import pytest
import torch

from lctrain.attention.ring_blocks import Block, group_documents, piece_chunks, plan_ring, visible_pairs
from tests.helpers.reference import random_pairs, visible_mask


def global_positions(ring_rank: int, ring_size: int, piece_len: int, layout: str) -> torch.Tensor:
    chunks = piece_chunks(ring_rank, ring_size, piece_len, layout)
    return torch.cat([torch.arange(c.start, c.stop) for c in chunks])


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    bounds: list[int] | None,
    causal: bool,
    window: int | None = None,
    doc_prefix: list[int] | None = None,
) -> torch.Tensor:
    """The true mask [Sq, Sk] (``visible_mask``): same document or its prefix, key not after query when causal,
    fewer than ``window`` positions back."""
    seq_len = int(max(q_pos.max(), k_pos.max())) + 1 if bounds is None else bounds[-1]
    mask = visible_mask(seq_len, causal=causal, bounds=bounds, doc_prefix=doc_prefix, window=window)
    return mask[q_pos][:, k_pos]


def block_mask(block: Block) -> torch.Tensor:
    """The (query row, key column) pairs a kernel computes for ``block`` (package doc of lctrain.attention.kernels):
    with ``segments``, each segment's, laid end to end (block-diagonal)."""
    if block.segments is not None:
        rows, cols = block.rows.stop - block.rows.start, block.cols.stop - block.cols.start
        mask = torch.zeros(rows, cols, dtype=torch.bool)
        row, col = 0, 0
        for seg_rows, seg_cols in block.segments:
            segment = Block(slice(0, seg_rows), slice(0, seg_cols), block.causal, block.window_left)
            mask[row : row + seg_rows, col : col + seg_cols] = block_mask(segment)
            row, col = row + seg_rows, col + seg_cols
        assert (row, col) == (rows, cols)
        return mask
    rows = torch.arange(block.rows.stop - block.rows.start)[:, None]
    cols = torch.arange(block.cols.stop - block.cols.start)[None, :]
    mask = torch.ones(rows.shape[0], cols.shape[1], dtype=torch.bool)
    if block.causal:
        assert rows.shape[0] == cols.shape[1]
        mask &= cols <= rows
    if block.window_left is not None:
        mask &= cols >= rows - block.window_left
    return mask


def covered(blocks, piece_len: int, keys: slice) -> torch.Tensor:  # noqa: ANN001
    """How many times the plan's blocks compute each (local query, source key) pair."""
    count = torch.zeros(piece_len, piece_len, dtype=torch.int64)
    for block in blocks:
        cols = slice(keys.start + block.cols.start, keys.start + block.cols.stop)
        mask = block_mask(block)
        assert visible_pairs(block) == mask.sum()
        count[block.rows, cols] += mask.long()
    return count


def random_bounds(seq_len: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(1, min(12, seq_len - 1))))
    if rng.random() < 0.5:  # length-1 documents
        cuts = sorted(set(cuts + [cuts[0] + 1] if cuts[0] + 1 < seq_len else cuts))
    return [0, *cuts, seq_len]


def plans_for(ring_size: int, piece_len: int, **options) -> list:  # noqa: ANN003
    return [plan_ring(rank, ring_size, piece_len, **options) for rank in range(ring_size)]


def check_plans(  # noqa: ANN001
    plans: list, ring_size: int, piece_len: int, layout: str, bounds, causal: bool, window, doc_prefix=None
) -> None:
    """Every visible pair computed once, nothing else, also with the documents grouped for varlen kernels; keys
    fetched = what the blocks use = what the owner sends."""
    sources = [step.source for step in plans[0]]
    assert sources[0] == 0 and sources == sorted(set(sources))
    assert all(plan[0].keys == slice(0, piece_len) and plan[0].send == slice(0, 0) for plan in plans)
    assert all([step.source for step in plan] == sources for plan in plans)  # every rank runs the same steps
    for index in range(len(sources)):  # and each of them is needed by some rank
        assert any(plan[index].blocks for plan in plans)
    for rank, plan in enumerate(plans):
        q_pos = global_positions(rank, ring_size, piece_len, layout)
        steps = {step.source: step for step in plan}
        for source in range(ring_size):  # offsets that are not steps must have nothing to compute
            step = steps.get(source)
            blocks, keys = (step.blocks, step.keys) if step else ((), slice(0, 0))
            k_pos = global_positions((rank - source) % ring_size, ring_size, piece_len, layout)
            expected = visible(q_pos, k_pos, bounds, causal, window, doc_prefix).long()
            msg = f"{bounds} {doc_prefix} w{window} r{rank} s{source}"
            torch.testing.assert_close(covered(blocks, piece_len, keys), expected, msg=msg)
            grouped = group_documents(blocks) if len(blocks) > 1 else blocks
            torch.testing.assert_close(covered(grouped, piece_len, keys), expected, msg=msg)
            if step is None or source == 0:
                continue
            used = [i for b in blocks for i in range(keys.start + b.cols.start, keys.start + b.cols.stop)]
            assert (keys.start, keys.stop) == ((min(used), max(used) + 1) if used else (0, 0)), msg
            assert step.send == plans[(rank + source) % ring_size][plan.index(step)].keys, msg
        for step in plan:
            for block in step.blocks:
                if block.window_left is not None:  # a band: every row sees a key (kernels rely on it) ...
                    assert block_mask(block).any(dim=1).all()
                    # ... and flash-attn's bottom-right left edge is not negative (negative = no limit)
                    assert (
                        block.window_left + (block.cols.stop - block.cols.start) >= block.rows.stop - block.rows.start
                    )


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 8])
def test_plan_covers_exactly_the_visible_pairs(ring_size: int, causal: bool, layout: str) -> None:
    rng = random.Random(ring_size * 10 + causal)
    piece_len = 6
    seq_len = piece_len * ring_size
    for bounds in [None, [0, seq_len], *(random_bounds(seq_len, rng) for _ in range(8))]:
        cu_seqlens = None if bounds is None else tuple(bounds)
        plans = plans_for(ring_size, piece_len, causal=causal, layout=layout, cu_seqlens=cu_seqlens)
        check_plans(plans, ring_size, piece_len, layout, bounds, causal, None)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5, 8])
def test_window_plan_covers_exactly_the_visible_pairs(ring_size: int, layout: str) -> None:
    """Windows of 1, smaller than, equal to and larger than a chunk, spanning several chunks, and the whole row."""
    rng = random.Random(ring_size)
    piece_len = 8
    seq_len = piece_len * ring_size
    chunk = piece_len // 2 if layout == "zigzag" and ring_size > 1 else piece_len
    windows = sorted({1, 2, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, seq_len - 1, seq_len})
    for window in windows:
        for bounds in [None, *(random_bounds(seq_len, rng) for _ in range(4))]:
            cu_seqlens = None if bounds is None else tuple(bounds)
            plans = plans_for(ring_size, piece_len, causal=True, layout=layout, cu_seqlens=cu_seqlens, window=window)
            check_plans(plans, ring_size, piece_len, layout, bounds, True, window)


def work(plan) -> int:  # noqa: ANN001
    return sum(visible_pairs(b) for step in plan for b in step.blocks)


def test_documents_skip_blocks_on_a_row_of_short_documents() -> None:
    """A 64K-token row of 128-token documents on a ring of 8: off-diagonal steps cost nothing."""
    ring_size, seq_len, doc_len = 8, 65536, 128
    bounds = tuple(range(0, seq_len + 1, doc_len))
    piece_len = seq_len // ring_size
    for rank in range(ring_size):
        dense = plan_ring(rank, ring_size, piece_len, causal=True, layout="zigzag")
        packed = plan_ring(rank, ring_size, piece_len, causal=True, layout="zigzag", cu_seqlens=bounds)
        assert len(packed) == 1  # no document crosses a chunk boundary: one step, no communication
        assert sum(b.causal for b in packed[0].blocks) == len(packed[0].blocks) == piece_len // doc_len
        assert work(packed) * 50 < work(dense)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_small_window_fetches_only_the_window_from_neighbours(layout: str) -> None:
    """Window W <= chunk: each chunk needs the W - 1 tokens before it, held by a ring neighbour (zigzag: the one
    before for the first chunk, the one after for the second); no other rank sends anything."""
    ring_size, piece_len, window = 8, 1024, 100
    chunk = piece_len // 2 if layout == "zigzag" else piece_len
    plans = plans_for(ring_size, piece_len, causal=True, layout=layout, window=window)
    sources = [step.source for step in plans[0]]
    assert sources == ([0, 1, ring_size - 1] if layout == "zigzag" else [0, 1])
    for rank, plan in enumerate(plans):
        steps = {step.source: step for step in plan}
        before = steps[1].keys  # the tail of the previous chunk, from ring rank - 1
        assert (before.stop - before.start) == (0 if rank == 0 else window - 1)
        if rank:
            assert before == slice(chunk - window + 1, chunk)
        if layout == "zigzag":  # the second chunk's predecessor is the second chunk of ring rank + 1
            after = steps[ring_size - 1].keys
            expected = slice(0, 0) if rank == ring_size - 1 else slice(piece_len - window + 1, piece_len)
            assert after == expected  # ring rank R - 1's chunks R - 1 and R are adjacent: its own piece
        # work: every query sees min(window, position + 1) keys
        positions = global_positions(rank, ring_size, piece_len, layout)
        assert work(plan) == int(torch.clamp(positions + 1, max=window).sum())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5, 8])
def test_shared_prefix_plan_covers_exactly_the_visible_pairs(ring_size: int, layout: str) -> None:
    """Packed preference pairs: each answer's queries against the prompt's keys and its own, never the other
    answer's, each pair once, with or without a causal mask, and under windows counted in positions (the rejected
    answer's continue the prompt's)."""
    rng = random.Random(100 + ring_size)
    piece_len = 8
    seq_len = piece_len * ring_size
    chunk = piece_len // 2 if layout == "zigzag" and ring_size > 1 else piece_len
    for _ in range(6):
        bounds, doc_prefix = random_pairs(seq_len, rng)
        assert any(prefix >= 0 for prefix in doc_prefix)
        options = dict(layout=layout, cu_seqlens=tuple(bounds), doc_prefix=tuple(doc_prefix))
        for causal, window in [(True, None), (False, None), *((True, w) for w in (1, 2, chunk, chunk + 3, 9))]:
            plans = plans_for(ring_size, piece_len, causal=causal, window=window, **options)
            check_plans(plans, ring_size, piece_len, layout, bounds, causal, window, doc_prefix)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shared_prompt_skips_chosen_by_rejected_and_computes_the_prompt_once(layout: str) -> None:
    """One pair [prompt 96 | chosen 16 | rejected 16] on a ring of 4: the work is the prompt's causal triangle
    once plus each answer's rectangle against it and its own triangle: one causal document of the whole pair
    costs the chosen x rejected rectangle more, the prompt repeated for each answer its triangle more."""
    ring_size, prompt, answer = 4, 96, 16
    seq_len = prompt + 2 * answer
    bounds, doc_prefix = (0, prompt, prompt + answer, seq_len), (-1, 0, 0)
    plans = plans_for(
        ring_size, seq_len // ring_size, causal=True, layout=layout, cu_seqlens=bounds, doc_prefix=doc_prefix
    )

    def triangle(n: int) -> int:
        return n * (n + 1) // 2

    shared = sum(work(plan) for plan in plans)
    assert shared == triangle(prompt) + 2 * (answer * prompt + triangle(answer))
    one_document = sum(work(plan) for plan in plans_for(ring_size, seq_len // ring_size, causal=True, layout=layout))
    assert one_document - shared == answer * answer  # chosen x rejected: never computed
    unshared_bounds = (0, prompt + answer, 2 * (prompt + answer))
    unshared_len = 2 * (prompt + answer)
    unshared = plans_for(ring_size, unshared_len // ring_size, causal=True, layout=layout, cu_seqlens=unshared_bounds)
    assert sum(work(plan) for plan in unshared) - shared == triangle(prompt)


def test_shared_prompt_blocks_are_joined() -> None:
    """One pair [prompt 4,095 | chosen 257 | rejected 257 | padding 7] on a ring of 2 (the preference benchmark's
    16:1 row): the prompt with the chosen answer, which continues it, is one causal square, the answers against
    the prompt's keys of a chunk one rectangle; the rank without answers computes what one document would."""
    bounds, doc_prefix = (0, 4095, 4352, 4609, 4616), (-1, 0, 0, -1)
    piece_len = bounds[-1] // 2
    shared = plans_for(2, piece_len, causal=True, layout="zigzag", cu_seqlens=bounds, doc_prefix=doc_prefix)
    one_document = plans_for(2, piece_len, causal=True, layout="zigzag", cu_seqlens=(0, 4095, bounds[-1]))
    check_plans(shared, 2, piece_len, "zigzag", list(bounds), True, None, list(doc_prefix))
    own, other = shared[0]
    chunk = piece_len // 2  # rank 0 holds chunks 0 and 3, the answers in its second one
    answers = slice(chunk + 4095 - 3 * chunk, chunk + 4352 - 3 * chunk)  # the chosen answer's local rows
    assert own.blocks == (
        Block(slice(0, answers.stop), slice(0, answers.stop), causal=True),  # the prompt, then the chosen answer
        Block(slice(answers.stop, answers.stop + 257), slice(0, answers.start), causal=False),  # rejected x prompt
        Block(slice(answers.stop, answers.stop + 257), slice(answers.stop, answers.stop + 257), causal=True),
        Block(slice(piece_len - 7, piece_len), slice(piece_len - 7, piece_len), causal=True),  # the padding
    )
    assert other.blocks == (Block(slice(chunk, piece_len - 7), slice(0, piece_len), causal=False),)
    assert [step.blocks for step in shared[1]] == [step.blocks for step in one_document[1]]
    assert [len(step.blocks) for step in shared[1]] == [1, 1]
