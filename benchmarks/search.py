"""The longest sequence that fits, found by probes: double from a start while it fits (halve while it does not), then
bisect between the longest fit and the shortest failure; lengths are multiples of a unit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Probe:
    """One length tried: whether it fits, and the run's result (``error``: why not, when it failed)."""

    seq: int
    fits: bool
    result: dict[str, Any]

    @property
    def reason(self) -> str:
        """Why it does not fit: the run's error, or its memory over the budget."""
        return self.result.get("error") or "over the memory budget"


@dataclass
class Search:
    """The longest fitting S for one side; ``probe(seq)`` runs one probe (once per length) and keeps it."""

    probe_fn: Callable[[int], Probe]
    unit: int
    max_seq: int
    probes: dict[int, Probe] = field(default_factory=dict)

    def probe(self, seq: int) -> Probe:
        if seq not in self.probes:
            self.probes[seq] = self.probe_fn(seq)
        return self.probes[seq]

    def longest(self) -> int | None:
        return max((p.seq for p in self.probes.values() if p.fits), default=None)

    def shortest_failure(self) -> int | None:
        best = self.longest() or 0
        return min((p.seq for p in self.probes.values() if not p.fits and p.seq > best), default=None)

    def run(self, start: int, *, bisect: int, jump: bool = False) -> int | None:
        """Double from ``start`` while it fits (not above ``max_seq``); while ``start`` does not fit, halve (not below
        ``unit``); then ``bisect`` bisection steps between the longest fit and the shortest failure above it.
        ``jump``: when ``start`` fits, try ``max_seq`` first (a fit there ends the search)."""
        seq = start
        if self.probe(seq).fits:
            if not (jump and self.probe(self.max_seq).fits):
                while seq < self.max_seq and self.probe(min(2 * seq, self.max_seq)).fits:
                    seq = min(2 * seq, self.max_seq)
        else:
            while seq // 2 >= self.unit and not self.probe(seq // 2 // self.unit * self.unit).fits:
                seq = seq // 2 // self.unit * self.unit
        for _ in range(bisect):
            best, failure = self.longest(), self.shortest_failure()
            if best is None or failure is None:
                break
            middle = (best + failure) // 2 // self.unit * self.unit
            if not best < middle < failure:
                break
            self.probe(middle)
        return self.longest()
