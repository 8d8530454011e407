"""The ring's per-step timeline, a debug option: when each transfer is posted, waited for and done, and when each
block is computed, so that communication the blocks do not hide is located, not guessed.

Set ``LCTRAIN_RING_TIMELINE=DIR`` and every pass of ``ring_attention`` with more than one step (each forward and
each backward, every layer) appends one JSON line to ``DIR/ring_timeline.rank<global rank>.jsonl``::

    {"pass": "forward", "ring_rank": 0, "ring_size": 2, "start": <time.time()>, "duration": 0.41,
     "events": [{"what": "kv", "source": 1, "sent": 524288, "received": 1048576,
                 "posted": 0.0001, "wait": 0.20, "done": 0.21},
                {"what": "compute", "source": 0, "start": 0.0002, "end": 0.20}, ...]}

Times are seconds from the pass's start. ``what``: ``kv`` (a step's K/V fetch), ``dkv`` (the fp32 dK/dV returned
to the keys' owner) or ``compute`` (one kernel call of step ``source``). A transfer's ``done - wait`` is the time
the pass waited for it, i.e. exposed communication; a transfer done while the blocks ran waits about nothing. Its
actual completion lies between ``posted`` and ``done`` (gloo and NCCL report completion only to ``wait``).
``exposed(record)`` sums the waits of one record per kind of transfer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENVIRONMENT = "LCTRAIN_RING_TIMELINE"


class PassTimeline:
    """One pass's events, written as one line when the pass ends (``finish``)."""

    def __init__(self, path: Path, pass_name: str, ring_rank: int, ring_size: int) -> None:
        self.path = path
        self.record: dict[str, Any] = {
            "pass": pass_name,
            "ring_rank": ring_rank,
            "ring_size": ring_size,
            "start": time.time(),
            "events": [],
        }
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    def posted(self, what: str, source: int, sent: int, received: int) -> dict[str, Any]:
        """A transfer just posted; returns its event, which ``waiting`` and ``done`` complete."""
        event = {"what": what, "source": source, "sent": sent, "received": received, "posted": self.now()}
        self.record["events"].append(event)
        return event

    def waiting(self, event: dict[str, Any] | None) -> None:
        if event is not None:
            event["wait"] = self.now()

    def done(self, event: dict[str, Any] | None) -> None:
        if event is not None:
            event["done"] = self.now()

    def computed(self, source: int, start: float) -> None:
        """A kernel call of step ``source`` that began at ``start`` (``now()``) just returned."""
        self.record["events"].append({"what": "compute", "source": source, "start": start, "end": self.now()})

    def finish(self) -> None:
        self.record["duration"] = self.now()
        with self.path.open("a") as f:
            f.write(json.dumps(self.record) + "\n")


class NoTimeline:
    """What the ring records into when the timeline is off: nothing."""

    def now(self) -> float:
        return 0.0

    def posted(self, what: str, source: int, sent: int, received: int) -> None:
        return None

    def waiting(self, event: None) -> None:
        pass

    def done(self, event: None) -> None:
        pass

    def computed(self, source: int, start: float) -> None:
        pass

    def finish(self) -> None:
        pass


def pass_timeline(pass_name: str, rank: int, ring_rank: int, ring_size: int) -> PassTimeline | NoTimeline:
    """The recorder of one ring pass on global rank ``rank``: a ``PassTimeline`` when ``LCTRAIN_RING_TIMELINE``
    names a directory (made if missing), else a ``NoTimeline``."""
    directory = os.environ.get(ENVIRONMENT)
    if not directory:
        return NoTimeline()
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"{ENVIRONMENT}={directory!r}: cannot make that directory ({error}); point it at a writable directory "
            f"or unset it to record no ring timeline"
        ) from None
    return PassTimeline(Path(directory) / f"ring_timeline.rank{rank}.jsonl", pass_name, ring_rank, ring_size)


def read_timelines(directory: Path, rank: int) -> list[dict[str, Any]]:
    """The records global rank ``rank`` wrote into ``directory``, in order."""
    path = Path(directory) / f"ring_timeline.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def exposed(record: dict[str, Any]) -> dict[str, float]:
    """Seconds one pass waited for each kind of transfer (``kv``, ``dkv``), and its ``compute`` seconds."""
    totals = {"kv": 0.0, "dkv": 0.0, "compute": 0.0}
    for event in record["events"]:
        if event["what"] == "compute":
            totals["compute"] += event["end"] - event["start"]
        else:
            totals[event["what"]] += event["done"] - event["wait"]
    return totals
