"""shard_sequence / unshard_sequence: the picture in the layout module docstring, round trips, and errors."""

import itertools

import pytest
import torch

from lctrain.attention import shard_sequence, unshard_sequence


def shards_of(x: torch.Tensor, ring: int, ulysses: int, layout: str) -> list[list[int]]:
    return [
        shard_sequence(
            x, dim=0, ring_rank=r, ring_size=ring, ulysses_rank=u, ulysses_size=ulysses, layout=layout
        ).tolist()
        for r in range(ring)
        for u in range(ulysses)
    ]


def test_zigzag_matches_design_picture() -> None:
    # S = 16, R = 2, U = 2: ring 0 holds chunks 0 and 3, ring 1 chunks 1 and 2; each piece split over U.
    assert shards_of(torch.arange(16), ring=2, ulysses=2, layout="zigzag") == [
        [0, 1, 2, 3],
        [12, 13, 14, 15],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]


def test_zigzag_ring_of_four() -> None:
    # 2R = 8 chunks of 2: ring rank r holds chunk r and chunk 7 - r.
    assert shards_of(torch.arange(16), ring=4, ulysses=1, layout="zigzag") == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]


def test_contiguous_layout_gives_each_rank_consecutive_tokens() -> None:
    assert shards_of(torch.arange(8), ring=2, ulysses=2, layout="contiguous") == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    "ring,ulysses,layout", list(itertools.product((1, 2, 3, 4), (1, 2, 4), ("zigzag", "contiguous")))
)
def test_round_trip_on_any_dim(ring: int, ulysses: int, layout: str) -> None:
    seq = 2 * ring * ulysses * 3
    x = torch.randn(2, seq, 5)
    shards = [
        shard_sequence(x, dim=1, ring_rank=r, ring_size=ring, ulysses_rank=u, ulysses_size=ulysses, layout=layout)
        for r in range(ring)
        for u in range(ulysses)
    ]
    assert all(s.shape == (2, seq // (ring * ulysses), 5) for s in shards)
    torch.testing.assert_close(unshard_sequence(shards, dim=1, ring_size=ring, ulysses_size=ulysses, layout=layout), x)


def test_every_token_lands_exactly_once() -> None:
    tokens = sorted(sum(shards_of(torch.arange(48), ring=3, ulysses=2, layout="zigzag"), []))
    assert tokens == list(range(48))


def test_bad_lengths_ranks_and_layouts_name_the_setting_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"sequence length \(dim 0\)=12 is not divisible by 16 .* multiple of 16"):
        shard_sequence(torch.arange(12), dim=0, ring_rank=0, ring_size=4, ulysses_rank=0, ulysses_size=2)
    with pytest.raises(ValueError, match="ring_rank=2 is outside"):
        shard_sequence(torch.arange(16), dim=0, ring_rank=2, ring_size=2)
    with pytest.raises(ValueError, match="ulysses_rank=3 is outside"):
        shard_sequence(torch.arange(16), dim=0, ring_rank=0, ring_size=2, ulysses_rank=3, ulysses_size=2)
    with pytest.raises(ValueError, match="layout='striped' must be one of"):
        shard_sequence(torch.arange(16), dim=0, ring_rank=0, ring_size=2, layout="striped")
    with pytest.raises(ValueError, match="one shard per rank"):
        unshard_sequence([torch.arange(4)], dim=0, ring_size=2)
