"""The helpers every benchmark measures with (``benchmarks/timing.py``, ``benchmarks/rings.py``): sides taken in
rounds A B B A after untimed warm-ups, each round's figures the slowest rank's, and the ring's traffic read from its
plan (what ``bench_attention`` checks against the bytes its ranks really send)."""

from __future__ import annotations

from benchmarks.rings import ring_traffic
from benchmarks.timing import rounds, slowest


def test_rounds_alternate_the_sides_after_untimed_warm_ups() -> None:
    order: list[tuple[str, int]] = []

    def side(name: str):  # noqa: ANN202
        return lambda index: order.append((name, index)) or {"index": index}

    measured = rounds({"a": side("a"), "b": side("b")}, 1, 3)
    assert order == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert [r["index"] for r in measured["a"]] == [1, 2, 3]  # the warm-up round is not recorded
    assert all(r["wall"] >= 0 and r["cpu"] >= 0 for r in measured["b"])
    untimed = rounds({"a": side("a")}, 0, 1, timed=False)
    assert untimed == {"a": [{"index": 0}]}


def test_slowest_takes_each_figure_of_each_round_from_the_worst_rank() -> None:
    rank0 = [{"ok": True, "error": None, "wall": 1.0, "peak": 5}, {"ok": True, "error": None, "wall": 2.0, "peak": 1}]
    late = {"ok": False, "error": "late", "wall": 1.0, "peak": 9}
    rank1 = [{"ok": True, "error": None, "wall": 3.0, "peak": 2}, late]
    assert slowest([rank0, rank1]) == [
        {"ok": True, "error": None, "wall": 3.0, "peak": 5},
        {"ok": False, "error": "late", "wall": 2.0, "peak": 9},
    ]


def test_ring_traffic_reads_the_plan() -> None:
    """Zigzag, causal, one document: each step a rank sends its whole piece to a rank later in the sequence, half
    of it to an earlier one; nothing at step 0 (its own piece); the backward sends the K/V again but the last
    step's, and returns the dK/dV of every row it fetched."""
    tokens = 64
    for ranks in (2, 4, 8):
        traffic = ring_traffic(ranks, tokens)
        assert all(t.kv[0] == 0 and t.dkv[0] == 0 for t in traffic)
        assert all(set(t.kv[1:]) <= {tokens, tokens // 2} for t in traffic)
        assert sum(sum(t.kv) for t in traffic) == sum(sum(t.dkv) for t in traffic)  # every row sent is fetched
        forward, backward = traffic[0].bytes(4, 8)
        assert forward == 4 * sum(traffic[0].kv)
        assert backward == 4 * (sum(traffic[0].kv) - traffic[0].kv[-1]) + 8 * sum(traffic[0].dkv)
    assert ring_traffic(2, tokens, window=8)[0].kv == (0, 7)  # a window: the 7 keys before the other chunk
