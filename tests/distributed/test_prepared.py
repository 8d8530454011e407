"""Training from a prepared set (``lctrain prepare``, then ``train data.prepared=DIR``) on 4 processes is training
from the files: real ``torchrun`` launches on a mixture of a text and a chat source (``testbed/corpus.py``), world 4
as ``parallel.dp=2`` x ``parallel.ring=2``, 12 steps, a checkpoint every 6:

1. ``lctrain prepare`` (the command, 2 worker processes) writes the set; a job from the files (the reference) runs
   alongside
2. the same job from the prepared set, whose rank 1 is SIGKILLed as soon as its step-6 checkpoint is complete;
3. a relaunch from the prepared set on another mesh, ``parallel.dp=2`` x ``parallel.ulysses=2`` (the same dp
   ranks, so the same data positions), resuming from step 6.

Checked: steps 1-6 of the prepared job equal the reference's exactly (loss and grad norm; on CPU, fp32 and gloo the
same rows give bitwise the same steps), and steps 7-12 of the relaunch equal the reference's within 1e-4 relative
(ring and Ulysses attention sum in other orders), each step once; and the skipped-record counts at the end agree.

Preference pairs (TRL's three forms, ``testbed/corpus.py``): a DPO job from a prepared set on 2 processes as
``parallel.dp=2`` (each rank its own share of the pairs) gives every step of the same job from the files exactly
(loss, grad norm, reward margin and accuracy). How a prepared set's rows split over context-parallel ranks is
checked row by row in ``tests/unit/test_prepared.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testbed.corpus import write_chat_corpus, write_corpus, write_pair_corpus
from tests.helpers.jobs import kill_job, wait_for_checkpoint, workers_by_rank

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 12, 6
TIMEOUT_S = 400
MODEL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4"]
JOB = [
    *MODEL,
    "model.num_kv_heads=2",
    "data.seq_len=128",
    "data.shuffle_buffer=16",
    "optim.warmup_steps=3",
    "logging.progress_bar=false",
    "logging.plot=false",
    "checkpoint.export_hf=false",
    "train.timeout_s=60",
]


def data_overrides(root: Path) -> list[str]:
    sources = f"[{{name: text, paths: ['{root}/text.jsonl'], weight: 1}}, {{name: chat, paths: ['{root}/chat.jsonl']}}]"
    return [f"data.sources={sources}"]


def launch(run_dir: Path, log: Path, *extra: str, mesh: str = "parallel.ring=2", nproc: int = 4) -> subprocess.Popen:
    """``torchrun`` of ``nproc`` processes, dp 2 x ``mesh``, with ``extra`` overrides (the data among them)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command += ["-m", "lctrain", "train", *JOB, "parallel.dp=2", mesh]
    command += [f"train.run_dir={run_dir}", *extra]
    with log.open("w") as out:
        return subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=out,
            start_new_session=True,
        )


def finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        kill_job(proc)
    assert proc.returncode == 0, f"job failed:\n{log.read_text()[-4000:]}"
    return log.read_text()


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("prepared")
    write_corpus(root / "text.jsonl", 300)
    write_chat_corpus(root / "chat.jsonl", 200)
    prepared = f"data.prepared={root / 'set'}"
    command = [sys.executable, "-m", "lctrain", "prepare", *data_overrides(root), prepared, "data.prepare_workers=2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    job = [*data_overrides(root), f"train.steps={STEPS}", f"checkpoint.every={EVERY}"]
    reference = launch(root / "reference", root / "reference.log", *job)
    killed = root / "prepared"
    try:
        proc = launch(killed, root / "killed.log", *job, prepared)
        try:
            wait_for_checkpoint(proc, killed / "checkpoints" / f"step_{EVERY:08d}", root / "killed.log", TIMEOUT_S)
            workers = workers_by_rank(proc)
            if proc.poll() is not None or len(workers) != 4:
                pytest.fail(f"the job exited (rc {proc.returncode}) before it could be killed")
            workers[1].send_signal(signal.SIGKILL)
            proc.wait(timeout=120)
        finally:
            kill_job(proc)
        killed_steps = [r["step"] for r in records(killed)]
    finally:
        reference_log = finish(reference, root / "reference.log")
    log = finish(launch(killed, root / "resumed.log", *job, prepared, mesh="parallel.ulysses=2"), root / "resumed.log")
    return {"root": root, "killed_steps": killed_steps, "log": log, "reference_log": reference_log}


def test_prepared_job_steps_equal_the_files_job_and_resume_on_another_mesh(runs: dict[str, Any]) -> None:
    root = runs["root"]
    assert EVERY <= len(runs["killed_steps"]) < STEPS  # killed between the checkpoints
    assert f"resumed from {root / 'prepared' / 'checkpoints' / f'step_{EVERY:08d}'} at step {EVERY}" in runs["log"]
    reference, resumed = records(root / "reference"), records(root / "prepared")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for ref, res in zip(reference, resumed, strict=True):
        for key in ("loss", "grad_norm", "loss/text", "loss/chat"):
            if ref["step"] <= EVERY or ref[key] is None:  # None: no token of the source in the step
                assert res[key] == ref[key], f"step {ref['step']} {key}: prepared {res[key]}, files {ref[key]}"
            else:
                assert res[key] == pytest.approx(ref[key], rel=1e-4), f"step {ref['step']} {key}"
    skipped = [line.split(" data: ", 1)[1] for line in runs["reference_log"].splitlines() if " data: " in line]
    assert skipped and any(line.endswith(skipped[-1]) for line in runs["log"].splitlines())


def test_preference_pairs_from_a_prepared_set_train_as_from_the_files(tmp_path: Path) -> None:
    write_pair_corpus(tmp_path / "pairs.jsonl", 200)
    data = [f"data.paths=['{tmp_path / 'pairs.jsonl'}']", f"data.prepared={tmp_path / 'set'}", "data.prepare_workers=1"]
    done = subprocess.run(
        [sys.executable, "-m", "lctrain", "prepare", *data], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    dpo = ["objective.name=dpo", "train.steps=4", "checkpoint.every=0", "data.shuffle_buffer=0"]
    jobs = {
        name: launch(tmp_path / name, tmp_path / f"{name}.log", *dpo, *extra, mesh="parallel.ulysses=1", nproc=2)
        for name, extra in (("files", data[:1]), ("prepared", data[:2]))
    }
    for name, job in jobs.items():
        finish(job, tmp_path / f"{name}.log")
    files, prepared = records(tmp_path / "files"), records(tmp_path / "prepared")
    assert len(files) == 4 and all(r["rewards/margins"] is not None for r in files)
    for want, got in zip(files, prepared, strict=True):
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies"):
            assert got[key] == want[key], f"step {want['step']} {key}: prepared {got[key]}, files {want[key]}"
