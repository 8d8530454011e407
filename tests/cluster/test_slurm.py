"""``scripts/slurm/train.sbatch`` on a real slurm cluster (``tests/cluster/harness.py``: slurmctld and two slurmd
nodes on this machine), submitted as a user would: ``NPROC_PER_NODE=2 sbatch --nodes=2 --gpus-per-node=0
scripts/slurm/train.sbatch recipe=tiny_cpu ...`` (4 ranks: ring 2 × ulysses 2, one Ulysses pair per node).

One run directory is carried through two jobs, each interrupted as soon as it has written a new checkpoint; each
new run continues from the newest complete checkpoint:

a. ``scancel``: every rank ends with exit status 1 and lctrain's one-line message naming the last complete
   checkpoint, no traceback on any rank (slurm signals every process of the step and torchrun passes SIGTERM on
   too). Each line names its rank's own cause: ``received SIGTERM``, or, for a rank whose peer stopped first, the
   closed connection. The job is CANCELLED (exit code 0:15).
b. the same command submitted again, with ``--requeue``, resumes from that checkpoint; it is preempted by a job in
   a higher-priority partition (``PreemptMode=REQUEUE``): every rank ends with status 1 and the message, as under
   ``scancel``. Slurm requeues the job (holding it about two minutes by its begin-time rule; released here at
   once), and its second run resumes from the newest checkpoint. Then one node fails: its job step's processes
   (launch.sh, torchrun, its two ranks) are SIGKILLed. The other node's ranks end with status 1 and the message,
   and the job is FAILED.

Every step recorded in the run directory (each by a 2-node job, most after a resume) equals the uninterrupted
one-node run's exactly: loss, gradient norm and learning rate (tolerance 0).
"""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import psutil
import pytest

from testbed.hosts import alive, marked
from tests.cluster.harness import SlurmCluster, free_port, wait_until
from tests.cluster.training import (
    EVERY,
    JOB_TIMEOUT_S,
    PEER_GONE,
    REPO,
    check_stopped,
    complete_checkpoints,
    job_env,
    numbers,
    overrides,
    records,
    wait_for_checkpoint_after,
)
from tests.helpers.jobs import rank_ends


@pytest.fixture(scope="module")
def cluster() -> SlurmCluster:
    # not under pytest's base directory: munged wants every directory above its socket searchable by all
    with SlurmCluster(Path(tempfile.mkdtemp(prefix="lctrain-slurm-"))) as running:
        yield running


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobs")


def submit(cluster: SlurmCluster, work: Path, corpus: Path, name: str, *sbatch: str) -> int:
    """``NPROC_PER_NODE=2 sbatch --nodes=2 --gpus-per-node=0 [sbatch...] scripts/slurm/train.sbatch <job>``, from
    the repository, with the job's output in ``work/<name>.out``."""
    env = job_env(work, name, NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    args = ["--nodes=2", "--gpus-per-node=0", f"--output={work / name}.out", "--open-mode=append", *sbatch]
    return cluster.sbatch([*args, "scripts/slurm/train.sbatch", *overrides(work / "run", corpus)], env=env, cwd=REPO)


def running(cluster: SlurmCluster, job_id: int) -> bool:
    return cluster.job(job_id)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING")


def wait_over(cluster: SlurmCluster, job_id: int, states: tuple[str, ...]) -> dict[str, str]:
    """Wait until the job is in one of ``states`` and none of its processes is left; returns its record."""
    record = cluster.wait_job(job_id, states, JOB_TIMEOUT_S)
    wait_until(lambda: not cluster.steps(job_id), 120, f"job {job_id}'s steps gone")
    wait_until(lambda: not job_processes(cluster, job_id), 120, f"job {job_id}'s processes gone")
    return record


def job_processes(cluster: SlurmCluster, job_id: int, node: str | None = None) -> list[psutil.Process]:
    """The processes of the job's step 0 (``srun``'s tasks: launch.sh, torchrun and the ranks), on ``node``."""
    found = []
    for process in marked(cluster.marker):
        try:
            env = process.environ()
        except psutil.NoSuchProcess:
            continue
        if env.get("SLURM_JOB_ID") == str(job_id) and env.get("SLURM_STEP_ID") == "0" and alive(process):
            if node is None or env.get("SLURMD_NODENAME") == node:
                found.append(process)
    return found


def phase(cluster: SlurmCluster, work: Path, name: str, job_id: int, state: dict[str, str]) -> dict[str, Any]:
    return {
        "job": job_id,
        "state": state,
        "ends": rank_ends(work / name / "exits"),
        "checkpoints": complete_checkpoints(work / "run"),
        "records": records(work / "run"),
        "output": (work / f"{name}.out").read_text(),
    }


@pytest.fixture(scope="module")
def cancelled(cluster: SlurmCluster, work: Path, corpus: Path) -> dict[str, Any]:
    """Job a, cancelled with ``scancel`` once its first checkpoint is complete."""
    job_id = submit(cluster, work, corpus, "a")
    wait_for_checkpoint_after(work / "run", 0, lambda: running(cluster, job_id), f"job {job_id}")
    cluster.scancel(str(job_id))
    return phase(cluster, work, "a", job_id, wait_over(cluster, job_id, ("CANCELLED",)))


@pytest.fixture(scope="module")
def preempted(cluster: SlurmCluster, work: Path, corpus: Path, cancelled: dict[str, Any]) -> dict[str, Any]:
    """Job b, the same command submitted again with ``--requeue``; once it has written a new checkpoint, a job in
    the ``urgent`` partition preempts it. Slurm requeues it, and it is released at once."""
    job_id = submit(cluster, work, corpus, "b", "--requeue")
    last = cancelled["checkpoints"][-1]
    wait_for_checkpoint_after(work / "run", last, lambda: running(cluster, job_id), f"job {job_id}")
    urgent = cluster.sbatch(
        ["--partition=urgent", "--nodes=2", f"--output={work}/urgent.out", "--wrap", "hostname"], env={}
    )
    cluster.wait_job(urgent, ("COMPLETED",), JOB_TIMEOUT_S)
    requeued = wait_until(
        lambda: (job := cluster.job(job_id))["JobState"] == "PENDING" and job, JOB_TIMEOUT_S, f"job {job_id} requeued"
    )
    wait_until(lambda: not job_processes(cluster, job_id), 120, f"job {job_id}'s first run gone")
    first = phase(cluster, work, "b", job_id, requeued)
    shutil.move(work / "b" / "exits", work / "b" / "exits_first")  # the second run records into an empty one
    cluster.scontrol("update", f"JobId={job_id}", "StartTime=now")  # slurm holds a requeued job for ~2 minutes
    return first


@pytest.fixture(scope="module")
def node_failed(cluster: SlurmCluster, work: Path, preempted: dict[str, Any]) -> dict[str, Any]:
    """Job b's second run; once it has written a new checkpoint, the second node's job step is SIGKILLed
    (launch.sh, torchrun and its ranks at once), as when a node dies."""
    job_id = preempted["job"]
    last = preempted["checkpoints"][-1]
    wait_for_checkpoint_after(work / "run", last, lambda: running(cluster, job_id), f"job {job_id}'s second run")
    failed_node = cluster.nodes[1]
    victims = job_processes(cluster, job_id, failed_node)
    assert len(victims) >= 4, victims  # bash, torchrun and two ranks at least
    for process in victims:
        process.send_signal(signal.SIGKILL)
    result = phase(cluster, work, "b", job_id, wait_over(cluster, job_id, ("FAILED",)))
    return result | {"failed_node": failed_node}


def resumed_from(output: str) -> list[tuple[Path, int]]:
    """Where each run logged in ``output`` resumed from (rank 0 logs it), in order."""
    return [(Path(path), int(step)) for path, step in re.findall(r"resumed from (\S+) at step (\d+)", output)]


def named_checkpoint(output: str) -> Path:
    return Path(output.split("Last complete checkpoint: ")[-1].split(";")[0])


def test_two_node_job_records_the_losses_of_one_node(
    cancelled: dict[str, Any], reference: list[dict[str, Any]], cluster: SlurmCluster
) -> None:
    assert cancelled["state"]["NodeList"] == f"{cluster.prefix}[1-2]"
    assert "mesh pp=1 dp=1 ring=2 ulysses=2" in cancelled["ends"][0]["output"]  # one job of 4 ranks
    nodes = {rank: end["node"] for rank, end in cancelled["ends"].items()}
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3] and set(nodes.values()) == set(cluster.nodes), nodes
    steps = len(cancelled["records"])
    assert steps >= EVERY
    assert numbers(cancelled["records"]) == numbers(reference[:steps])


def test_scancel_ends_every_rank_with_the_one_line_message(cancelled: dict[str, Any]) -> None:
    assert (cancelled["state"]["JobState"], cancelled["state"]["ExitCode"]) == ("CANCELLED", "0:15")
    checkpoint = named_checkpoint(cancelled["ends"][0]["output"])
    assert checkpoint.name == f"step_{cancelled['checkpoints'][-1]:08d}"  # the newest complete checkpoint
    # slurm signals every rank; one whose peer has already stopped may see the closed connection before its own
    # SIGTERM is handled, and names that instead
    check_stopped(cancelled["ends"], [0, 1, 2, 3], checkpoint, ("received SIGTERM", *PEER_GONE))
    assert any("stopped: received SIGTERM" in end["output"] for end in cancelled["ends"].values())


def test_resubmitted_job_resumes_exactly(
    cancelled: dict[str, Any], preempted: dict[str, Any], reference: list[dict[str, Any]]
) -> None:
    [(path, step)] = resumed_from(preempted["ends"][0]["output"])
    assert step == cancelled["checkpoints"][-1] and path.name == f"step_{step:08d}"
    rows = preempted["records"]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) > step
    assert rows[:step] == cancelled["records"][:step]  # steps before the checkpoint kept, not re-run
    assert numbers(rows) == numbers(reference[: len(rows)])


def test_preempted_job_is_requeued_and_resumes_exactly(
    preempted: dict[str, Any], node_failed: dict[str, Any], reference: list[dict[str, Any]]
) -> None:
    checkpoint = named_checkpoint(preempted["ends"][0]["output"])
    assert checkpoint.name == f"step_{preempted['checkpoints'][-1]:08d}"
    check_stopped(preempted["ends"], [0, 1, 2, 3], checkpoint, ("received SIGTERM", *PEER_GONE))
    assert any("stopped: received SIGTERM" in end["output"] for end in preempted["ends"].values())
    assert "DUE TO PREEMPTION" in preempted["output"]
    assert preempted["state"]["Restarts"] == "1"  # requeued by slurm, not resubmitted
    step = preempted["checkpoints"][-1]
    runs = resumed_from(node_failed["output"])  # the job's output: both runs, both nodes (rank 0's may be killed)
    assert len(runs) == 2 and runs[1] == (checkpoint, step), runs
    rows = node_failed["records"]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) > step
    assert rows[:step] == preempted["records"][:step]
    assert numbers(rows) == numbers(reference[: len(rows)])  # every step of the chain of 2-node runs


def test_node_failure_stops_the_other_node_cleanly(node_failed: dict[str, Any]) -> None:
    state = node_failed["state"]
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0", state
    ends = node_failed["ends"]
    survivors = sorted(ends)
    assert len(survivors) == 2 and all(ends[r]["node"] != node_failed["failed_node"] for r in survivors), ends
    checkpoint = named_checkpoint(ends[survivors[0]]["output"])
    assert checkpoint.name == f"step_{node_failed['checkpoints'][-1]:08d}"
    # the dead peer's connections closed (gloo: "Connection closed by peer", "Read error ... Connection reset by
    # peer"), or srun --kill-on-bad-exit's SIGTERM was handled first
    check_stopped(ends, survivors, checkpoint, ("received SIGTERM", *PEER_GONE))
