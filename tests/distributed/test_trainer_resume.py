"""A training job one of whose ranks is killed with SIGKILL stops cleanly, and relaunched with
``checkpoint.resume=auto`` it continues exactly where its last checkpoint left it.

Three real ``torchrun`` launches on a small jsonl corpus (``testbed/corpus.py``), world 2 as ``parallel.dp=2``
(two data-parallel ranks, each with its own data loader position, FSDP-sharded parameters and optimizer state),
``train.grad_accum=2``, 20 steps, a checkpoint every 10 steps:

1. an uninterrupted job (the reference), run alongside job 2;
2. the same job in another run directory, whose rank 1 is SIGKILLed as soon as ``checkpoints/step_00000010``
   appears. The test fails if the job finished first. Checked: torchrun ends with status 1 (within
   ``train.timeout_s`` + 60 s), naming the killed rank; rank 0 stops with lctrain's one-line message naming
   ``step_00000010`` and ``checkpoint.resume=auto``; no step-20 checkpoint and no ``hf/`` export were written;
3. a relaunch of job 2 with ``checkpoint.resume=auto``, after planting ``checkpoints/step_00000015.tmp`` (with a
   ``.metadata`` file: a save that crashed before its rename), which must not be resumed from.

Checked: the relaunch logs that it resumed from ``step_00000010`` at step 10, keeps the killed job's records of
steps 1-10 byte for byte (they are not re-run) and records steps 11-20 once each; its loss, grad norm and learning
rate of every step equal the uninterrupted job's exactly (tolerance 0: on CPU, fp32 and gloo, resuming is bitwise
deterministic), and so do the exported weights (``hf/model.safetensors``, compared with ``torch.equal``). The stale
``.tmp`` directory is gone after the relaunch's first save, and ``checkpoint.keep=2`` left ``step_00000010`` and
``step_00000020``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from testbed.corpus import corpus_overrides, write_corpus
from tests.helpers.jobs import kill_job, wait_for_checkpoint, workers_by_rank

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
EVERY = 10
COLLECTIVE_TIMEOUT_S = 60  # train.timeout_s: how long a rank may wait for a dead or hung peer
OVERRIDES = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "data.seq_len=128",
    "parallel.dp=2",
    "train.grad_accum=2",
    f"train.steps={STEPS}",
    f"checkpoint.every={EVERY}",
    "checkpoint.keep=2",
    "optim.warmup_steps=5",
    "logging.progress_bar=false",
    "logging.plot=false",
    f"train.timeout_s={COLLECTIVE_TIMEOUT_S}",
]
TIMEOUT_S = 300


def launch(run_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node 2 -m lctrain train ...`` in its own session; stdout and stderr (the
    rank-0 log) to ``log``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "lctrain", "train", *OVERRIDES, *corpus_overrides(run_dir.parent / "corpus.jsonl")]
    command += [f"train.run_dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True)


def finish(proc: subprocess.Popen, log: Path) -> str:
    """Wait for a job that must succeed; returns its log."""
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        kill_job(proc)
    text = log.read_text()
    assert proc.returncode == 0, f"job failed:\n{text[-4000:]}"
    return text


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kill_rank_after_checkpoint(run_dir: Path) -> str:
    """Run the job and SIGKILL its rank 1 as soon as the step-10 checkpoint is complete (renamed from ``.tmp``);
    returns the job's log once torchrun has ended (the surviving rank stops with lctrain's message)."""
    checkpoint = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    log = run_dir.parent / "killed.log"
    proc = launch(run_dir, log)
    try:
        wait_for_checkpoint(proc, checkpoint, log, TIMEOUT_S)
        workers = workers_by_rank(proc)
        if proc.poll() is not None or len(workers) != 2:
            pytest.fail(f"the job exited (rc {proc.returncode}) before it could be killed: make its steps slower")
        workers[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=COLLECTIVE_TIMEOUT_S + 60)
        print(f"the job ended {time.monotonic() - killed_at:.1f} s after rank 1 was killed")
    finally:
        kill_job(proc)
    assert proc.returncode == 1  # torchrun: a worker failed
    return log.read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resume")
    write_corpus(root / "corpus.jsonl")
    reference, resumed = root / "reference", root / "resumed"
    reference_job = launch(reference, root / "reference.log")  # runs alongside the job that is killed
    try:
        killed_log = kill_rank_after_checkpoint(resumed)
    except BaseException:
        kill_job(reference_job)
        raise
    finish(reference_job, root / "reference.log")
    killed_steps = [r["step"] for r in records(resumed)]
    killed_dirs = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    killed_hf = (resumed / "hf").exists()
    killed_lines = (resumed / "metrics.jsonl").read_text().splitlines()
    stale = resumed / "checkpoints" / "step_00000015.tmp"  # a save that crashed after writing its .metadata
    stale.mkdir()
    (stale / ".metadata").write_bytes(b"not a checkpoint")

    log = finish(launch(resumed, root / "resumed.log", "checkpoint.resume=auto"), root / "resumed.log")
    return {
        "reference": reference,
        "resumed": resumed,
        "killed_steps": killed_steps,
        "killed_dirs": killed_dirs,
        "killed_hf": killed_hf,
        "killed_lines": killed_lines,
        "log": log,
        "killed_log": killed_log,
    }


def test_job_was_killed_between_checkpoints(runs: dict[str, Any]) -> None:
    steps = runs["killed_steps"]
    assert steps == list(range(1, len(steps) + 1)) and EVERY <= len(steps) < STEPS, steps
    assert runs["killed_dirs"] == [f"step_{EVERY:08d}"]
    assert not runs["killed_hf"]


def test_survivor_stops_with_the_checkpoint_to_resume_from(runs: dict[str, Any]) -> None:
    checkpoint = runs["resumed"] / "checkpoints" / f"step_{EVERY:08d}"
    message = f"Last complete checkpoint: {checkpoint}; relaunch the same command (checkpoint.resume=auto)"
    assert "lctrain: rank 0 stopped: " in runs["killed_log"] and message in runs["killed_log"], runs["killed_log"]
    assert "exitcode  : -9" in runs["killed_log"]  # torchrun names the killed rank as the first failure


def test_relaunch_resumes_from_last_complete_checkpoint(runs: dict[str, Any]) -> None:
    resumed: Path = runs["resumed"]
    checkpoint = resumed / "checkpoints" / f"step_{EVERY:08d}"
    assert f"resumed from {checkpoint} at step {EVERY}" in runs["log"]
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    assert lines[:EVERY] == runs["killed_lines"][:EVERY]  # steps 1-10 kept from the killed job, not re-run
    assert [r["step"] for r in records(resumed)] == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == [f"step_{EVERY:08d}", f"step_{STEPS:08d}"]


def test_resumed_steps_equal_uninterrupted_run(runs: dict[str, Any]) -> None:
    reference, resumed = records(runs["reference"]), records(runs["resumed"])
    for ref, res in zip(reference, resumed, strict=True):
        for key in ("step", "loss", "grad_norm", "lr"):
            assert res[key] == ref[key], f"step {ref['step']} {key}: resumed {res[key]!r}, uninterrupted {ref[key]!r}"


def test_resumed_weights_equal_uninterrupted_run(runs: dict[str, Any]) -> None:
    reference = load_file(runs["reference"] / "hf" / "model.safetensors")
    resumed = load_file(runs["resumed"] / "hf" / "model.safetensors")
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        assert torch.equal(resumed[name], tensor), name
