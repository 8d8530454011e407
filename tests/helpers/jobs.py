"""Watching and stopping real ``torchrun`` jobs started with ``subprocess.Popen(..., start_new_session=True)``, and
the tiny job they run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from testbed.jobs import tiny_job

# the tiny job (recipe tiny_cpu, ring 2 x ulysses 2) shrunk further: the job that the launch and cluster tests start
TINY = tiny_job("model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "data.seq_len=128")


def wait_for_checkpoint(proc: subprocess.Popen, checkpoint: Path, log: Path, timeout: float = 300) -> None:
    """Return as soon as the checkpoint directory exists (complete: renamed from ``.tmp``); fail if the job ends
    first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not checkpoint.is_dir():
        if proc.poll() is not None:
            pytest.fail(f"the job exited (rc {proc.returncode}) before {checkpoint.name}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {checkpoint.name} after {timeout} s")
        time.sleep(0.005)


def workers_by_rank(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """torchrun's worker processes, by their ``RANK``."""
    return {int(w.environ()["RANK"]): w for w in psutil.Process(proc.pid).children(recursive=True)}


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's process group and each worker's (the workers run in sessions of their own); wait until all
    are dead. A no-op for a job that already exited."""
    if proc.poll() is not None:
        return
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    for pgid in [proc.pid, *(worker.pid for worker in workers)]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 30
    for worker in workers:  # reparented now: gone, or a zombie its new parent has not reaped yet
        while True:
            try:
                if worker.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, f"worker {worker.pid} survived SIGKILL"
            time.sleep(0.01)


EXIT_RECORDER = Path(__file__).resolve().parent / "exit_recorder"  # its sitecustomize.py records each worker's end
REPO = Path(__file__).resolve().parents[2]


def recording_env(exit_dir: Path, log_dir: Path) -> dict[str, str]:
    """Environment for a torchrun job whose workers each record how they ended (``tests/helpers/exit_recorder``) in
    ``exit_dir``, and write their output to files of their own under ``log_dir`` as well as to the console (torchrun
    reads its options from ``PET_*`` variables: ``--log-dir``, ``--tee 3``)."""
    exit_dir.mkdir(parents=True, exist_ok=True)
    path = [str(EXIT_RECORDER), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        "PYTHONPATH": os.pathsep.join(path),
        "LCTRAIN_TEST_EXIT_DIR": str(exit_dir),
        "PET_LOG_DIR": str(log_dir),
        "PET_TEE": "3",
    }


def rank_ends(exit_dir: Path) -> dict[int, dict]:
    """What each worker recorded in ``exit_dir`` (see ``recording_env``), by rank: ``status`` (its exit status),
    ``uncaught`` (the type of an exception that escaped, else None) and ``output`` (its stdout and stderr)."""
    ends: dict[int, dict] = {}
    for path in sorted(exit_dir.glob("rank_*.json")):
        end = json.loads(path.read_text())
        assert end["rank"] not in ends, f"rank {end['rank']} ended twice in {exit_dir}"
        log_dir = Path(end["log_dir"])
        files = [log_dir / "stdout.log", log_dir / "stderr.log"]
        end["output"] = "".join(file.read_text() for file in files if file.exists())
        ends[end["rank"]] = end
    return ends
