"""The job the cluster tests launch, and what they check about how its ranks ended.

The tiny recipe (ring 2 × ulysses 2: 4 ranks, one Ulysses pair per node), shrunk as in ``tests/helpers/jobs.py``, on the
small corpus of ``testbed/corpus.py``: ``STEPS`` steps with a checkpoint every ``EVERY``. Faults are injected as
soon as a new checkpoint is complete, and the remaining steps leave room for the fault to land before the job ends. On
CPU with gloo the steps are bitwise deterministic, so every resumed or multi-node run must record exactly the losses,
gradient norms and learning rates of the uninterrupted one-node run (``reference``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.helpers.jobs import TINY, kill_job, rank_ends, recording_env

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)  # torchrun lives next to the interpreter running the tests
STEPS = 32
EVERY = 4
TIMEOUT_S = 15  # train.timeout_s: how long a rank waits for a peer that is gone or cut off
JOB_TIMEOUT_S = 300  # the longest any one job of this suite may take before the test gives up on it
STOPPED = re.compile(r"lctrain: rank (\d+) stopped: (.*?)\. Probably .*? Last complete checkpoint: (\S+); relaunch")


def overrides(run_dir: Path, corpus: Path) -> list[str]:
    return [
        *TINY,
        f"data.paths=['{corpus}']",
        f"train.steps={STEPS}",
        f"checkpoint.every={EVERY}",
        f"train.timeout_s={TIMEOUT_S}",
        f"train.run_dir={run_dir}",
    ]


def job_env(work: Path, name: str, **extra: str) -> dict[str, str]:
    """The environment of one launch named ``name``: the venv's torchrun first on ``PATH``, one thread per rank, and
    each worker recording how it ended in ``work/name/exits`` (``tests/helpers/exit_recorder``), its output in
    ``work/name/logs``."""
    directory = work / name
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", "TMPDIR": str(directory)}
    return env | recording_env(directory / "exits", directory / "logs") | extra


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def numbers(rows: list[dict[str, Any]]) -> list[tuple]:
    """What must be equal between runs, step by step."""
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in rows]


def complete_checkpoints(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (``step_XXXXXXXX``, not ``.tmp``)."""
    directory = run_dir / "checkpoints"
    found = directory.glob("step_????????") if directory.exists() else []
    return sorted(int(path.name[5:]) for path in found if path.is_dir())


def wait_for_checkpoint_after(run_dir: Path, step: int, alive: Any, what: str) -> int:
    """Wait until a complete checkpoint newer than ``step`` exists; returns its step. ``alive()`` must stay true
    (the job is still running), or the test fails naming ``what``."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        newer = [s for s in complete_checkpoints(run_dir) if s > step]
        if newer:
            return newer[0]
        assert alive(), f"{what} ended before writing a checkpoint after step {step}"
        assert time.monotonic() < deadline, f"{what}: no checkpoint after step {step} in {JOB_TIMEOUT_S} s"
        time.sleep(0.005)


def stopped_lines(output: str) -> list[tuple[int, str, str]]:
    """lctrain's one-line messages in a rank's output: (rank, cause, checkpoint)."""
    return [(int(rank), cause, checkpoint) for rank, cause, checkpoint in STOPPED.findall(output)]


# what a rank says stopped it when a peer's process ended or was cut off first (gloo's errors)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Read error", "Write error", "Timed out waiting")


def check_stopped(ends: dict[int, dict], ranks: list[int], checkpoint: Path, causes: tuple[str, ...]) -> None:
    """Each of ``ranks`` ended with exit status 1 and exactly one of lctrain's one-line messages, naming
    ``checkpoint`` and a cause starting with one of ``causes``; none printed a traceback."""
    assert sorted(ends) == sorted(ranks), f"ranks that recorded their end: {sorted(ends)}, expected {ranks}"
    for rank in ranks:
        end = ends[rank]
        assert "Traceback" not in end["output"], f"rank {rank} printed a traceback:\n{end['output'][-3000:]}"
        assert (end["status"], end["uncaught"]) == (1, None), f"rank {rank}: {end}"
        lines = stopped_lines(end["output"])
        assert len(lines) == 1, f"rank {rank} printed {len(lines)} stop messages:\n{end['output'][-3000:]}"
        (named_rank, cause, named) = lines[0]
        assert named_rank == rank and Path(named) == checkpoint, lines[0]
        assert cause.startswith(causes), f"rank {rank} stopped for {cause!r}, expected one of {causes}"


def run_reference(work: Path, corpus: Path) -> list[dict[str, Any]]:
    """The uninterrupted one-node job (``scripts/launch.sh``, 4 processes, ``--standalone``)."""
    run_dir = work / "run"
    env = job_env(work, "job", NNODES="1", NPROC_PER_NODE="4")
    log = work / "job.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "scripts/launch.sh", *overrides(run_dir, corpus)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        kill_job(proc)
    assert proc.returncode == 0, log.read_text()[-4000:]
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert sorted(rank_ends(work / "job" / "exits")) == [0, 1, 2, 3]
    return rows
