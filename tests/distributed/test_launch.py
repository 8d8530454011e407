"""The launchers: ``scripts/launch.sh`` (torchrun on one node or many, c10d rendezvous) and
``scripts/slurm/train.sbatch`` (one ``launch.sh`` per node under ``srun``), tested on this one machine.

- The slurm script renders the right per-node commands without slurm: stand-ins for ``scontrol``, ``srun`` and
  ``torchrun`` on ``PATH`` record what they are given (``srun`` runs its command once per node, as slurm does with
  one task per node). Checked: the rendezvous host is the first node of the allocation, every node gets the same
  torchrun line (node count, processes per node from ``--gpus-per-node``, c10d endpoint, the job id as rendezvous
  id) and the recipe and overrides arrive unchanged (spaces and brackets included); ``srun`` starts one task per
  node and stops the job when one fails.
- ``launch.sh`` on one node uses ``--standalone``, and refuses ``NNODES > 1`` without ``MASTER_ADDR``; it sets
  ``PYTORCH_CUDA_ALLOC_CONF`` to lctrain's default (``lctrain.cli.ALLOCATOR_SETTINGS``, which the script repeats for
  the processes torchrun starts) unless either allocator variable is set.
- Two real ``launch.sh`` runs with ``NNODES=2`` (two processes each) on loopback form one 4-rank job that trains
  the tiny recipe (ring 2 × ulysses 2, each Ulysses pair inside one "node"): its losses and gradient norms equal a
  4-process ``--standalone`` run's exactly (same ranks, same mesh, CPU fp32 gloo: bitwise deterministic).
- A rank that hangs (SIGSTOP) does not hang the others: with ``train.timeout_s=20`` they stop with lctrain's
  message (the timed-out transfer and the last complete checkpoint) within the timeout plus start-up slack.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lctrain.cli import ALLOCATOR_SETTINGS
from testbed.corpus import corpus_overrides, write_corpus
from tests.helpers.jobs import TINY, kill_job, rank_ends, recording_env, wait_for_checkpoint, workers_by_rank

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)  # torchrun lives next to the interpreter running the tests

# stand-ins for slurm's and torch's commands; each records its arguments as JSON in $RENDER_DIR
FAKE_SCONTROL = """
import json, os, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
json.dump(sys.argv[3:], open(os.path.join(os.environ["RENDER_DIR"], "scontrol.json"), "w"))
print("gpu-a17\\ngpu-b03")
"""
FAKE_SRUN = """
import json, os, subprocess, sys
args = sys.argv[1:]
first = next(i for i, a in enumerate(args) if not a.startswith("-"))
json.dump(args[:first], open(os.path.join(os.environ["RENDER_DIR"], "srun.json"), "w"))
for node in range(int(os.environ["SLURM_JOB_NUM_NODES"])):
    env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}
    subprocess.run(args[first:], env=env, check=True)
"""
FAKE_TORCHRUN = """
import json, os, sys
out = os.path.join(os.environ["RENDER_DIR"], "torchrun_" + os.environ.get("SLURM_NODEID", "local") + ".json")
json.dump(sys.argv[1:], open(out, "w"))
allocator = {name: os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
json.dump(allocator, open(out.replace(".json", "_allocator.json"), "w"))
"""


def fake_bin(directory: Path) -> dict[str, str]:
    """Write the stand-ins into ``directory``; returns an environment with them first on ``PATH``."""
    directory.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("torchrun", FAKE_TORCHRUN)):
        path = directory / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}", "RENDER_DIR": str(directory)}


def recorded(directory: Path, name: str) -> list[str]:
    return json.loads((directory / f"{name}.json").read_text())


def test_slurm_script_renders_one_torchrun_per_node(tmp_path: Path) -> None:
    env = fake_bin(tmp_path / "bin")
    env |= {"SLURM_JOB_NODELIST": "gpu-a17,gpu-b03", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242"}
    env |= {"SLURM_GPUS_ON_NODE": "8"}
    args = ["recipe=tiny_cpu", "data.paths=['/data/my corpus/*.jsonl']", "parallel.ring=2", "parallel.ulysses=8"]
    result = subprocess.run(
        ["bash", "scripts/slurm/train.sbatch", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    bin_dir = tmp_path / "bin"
    assert recorded(bin_dir, "scontrol") == ["gpu-a17,gpu-b03"]
    assert recorded(bin_dir, "srun") == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    expected = ["--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend", "c10d"]
    expected += ["--rdzv-endpoint", "gpu-a17:29500", "--rdzv-id", "4242", "--rdzv-conf", "join_timeout=600"]
    expected += ["-m", "lctrain", "train", *args]
    assert recorded(bin_dir, "torchrun_0") == expected
    assert recorded(bin_dir, "torchrun_1") == expected
    header = [line for line in (REPO / "scripts/slurm/train.sbatch").read_text().splitlines() if line[:7] == "#SBATCH"]
    assert "#SBATCH --ntasks-per-node=1" in header  # one torchrun per node, which starts the node's ranks


def test_slurm_script_without_gpus_asks_for_the_process_count(tmp_path: Path) -> None:
    env = fake_bin(tmp_path / "bin")
    env |= {"SLURM_JOB_NODELIST": "cpu[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "7"}
    env.pop("SLURM_GPUS_ON_NODE", None)
    env.pop("NPROC_PER_NODE", None)
    result = subprocess.run(["bash", "scripts/slurm/train.sbatch"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "request --gpus-per-node or set NPROC_PER_NODE" in result.stderr
    env["NPROC_PER_NODE"] = "16"
    subprocess.run(["bash", "scripts/slurm/train.sbatch"], cwd=REPO, env=env, check=True, capture_output=True)
    assert recorded(tmp_path / "bin", "torchrun_1")[:4] == ["--nproc-per-node", "16", "--nnodes", "2"]


def test_launch_on_one_node_is_standalone(tmp_path: Path) -> None:
    env = fake_bin(tmp_path / "bin") | {"NPROC_PER_NODE": "4"}
    env.pop("NNODES", None)
    subprocess.run(["bash", "scripts/launch.sh", "recipe=tiny_cpu"], cwd=REPO, env=env, check=True)
    assert recorded(tmp_path / "bin", "torchrun_local") == [
        "--nproc-per-node",
        "4",
        "--standalone",
        "-m",
        "lctrain",
        "train",
        "recipe=tiny_cpu",
    ]


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ({}, {"PYTORCH_CUDA_ALLOC_CONF": ALLOCATOR_SETTINGS, "PYTORCH_ALLOC_CONF": None}),  # lctrain's own default
        ({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": None}),
        (
            {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"},
            {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"},
        ),
    ],
    ids=["unset", "user-empty", "user-new-name"],
)
def test_launch_sets_expandable_segments_unless_the_user_set_the_allocator(
    tmp_path: Path, user: dict, expected: dict
) -> None:
    env = fake_bin(tmp_path / "bin") | {"NPROC_PER_NODE": "1"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "NNODES"):
        env.pop(name, None)
    subprocess.run(["bash", "scripts/launch.sh"], cwd=REPO, env=env | user, check=True)
    assert recorded(tmp_path / "bin", "torchrun_local_allocator") == expected


def test_launch_on_several_nodes_needs_the_rendezvous_host(tmp_path: Path) -> None:
    env = fake_bin(tmp_path / "bin") | {"NNODES": "2"}
    env.pop("MASTER_ADDR", None)
    result = subprocess.run(["bash", "scripts/launch.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode != 0 and "NNODES=2 needs MASTER_ADDR" in result.stderr


def test_launch_names_a_rendezvous_that_never_completes(tmp_path: Path) -> None:
    """One node of two starts, the other never does: after ``RDZV_TIMEOUT`` seconds torchrun gives up (with a bare
    ``RendezvousTimeoutError`` traceback) and ``launch.sh`` adds one line naming the rendezvous and what to check."""
    port = free_port()
    log = tmp_path / "node.log"
    env = {"NNODES": "2", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env |= {"RDZV_TIMEOUT": "3", "TMPDIR": str(tmp_path)}
    proc = launch(log, env, ["recipe=tiny_cpu"])
    try:
        proc.wait(timeout=120)
    finally:
        kill_job(proc)
    text = log.read_text()
    assert proc.returncode == 1, text[-4000:]
    assert (
        f"lctrain launch: the rendezvous at 127.0.0.1:{port} (id lctrain-127.0.0.1-{port}) failed "
        "(RendezvousTimeoutError): every node must run scripts/launch.sh with the same NNODES=2, MASTER_ADDR, "
        f"MASTER_PORT and RDZV_ID, and reach 127.0.0.1:{port}, within RDZV_TIMEOUT=3 s of the first"
    ) in text, text[-4000:]
    assert "[rank" not in text  # no rank started
    assert not list(tmp_path.glob("lctrain-launch.*"))  # launch.sh removed its error file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(log: Path, env_extra: dict[str, str], overrides: list[str]) -> subprocess.Popen:
    """``scripts/launch.sh`` with the venv's torchrun first on ``PATH``, in its own session, output to ``log``."""
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", **env_extra}
    with log.open("w") as out:
        return subprocess.Popen(
            ["bash", "scripts/launch.sh", *overrides],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_ok(proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    try:
        proc.wait(timeout=timeout)
    finally:
        kill_job(proc)
    assert proc.returncode == 0, log.read_text()[-4000:]


def metrics(run_dir: Path) -> list[tuple[float, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(record["loss"], record["grad_norm"]) for record in map(json.loads, lines)]


def test_two_nodes_on_loopback_train_as_one_job(tmp_path: Path) -> None:
    corpus = corpus_overrides(write_corpus(tmp_path / "corpus.jsonl"))
    overrides = [*TINY, *corpus, "train.steps=6"]
    port = free_port()
    nodes_env = {"NNODES": "2", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    nodes_env["RDZV_ID"] = f"test-{port}"
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [launch(log, nodes_env, [*overrides, f"train.run_dir={tmp_path / 'two_nodes'}"]) for log in logs]
    try:
        for node, log in zip(nodes, logs):
            wait_ok(node, log)
    finally:
        for node in nodes:
            kill_job(node)
    text = "".join(log.read_text() for log in logs)
    assert "mesh pp=1 dp=1 ring=2 ulysses=2" in text  # one job of 4 ranks, not two of 2

    log = tmp_path / "standalone.log"
    standalone = launch(log, {"NPROC_PER_NODE": "4", "NNODES": "1"}, [*overrides, f"train.run_dir={tmp_path / 'one'}"])
    wait_ok(standalone, log)
    two_nodes, one_node = metrics(tmp_path / "two_nodes"), metrics(tmp_path / "one")
    assert len(two_nodes) == 6
    assert two_nodes == one_node


def test_a_hung_rank_stops_the_others_after_the_timeout(tmp_path: Path) -> None:
    corpus = corpus_overrides(write_corpus(tmp_path / "corpus.jsonl"))
    run_dir = tmp_path / "run"
    timeout_s = 20
    overrides = [
        *TINY,
        *corpus,
        "parallel.ring=1",
        "parallel.ulysses=1",
        "parallel.dp=2",
        "train.steps=100000",
        "checkpoint.every=2",
    ]
    overrides += [f"train.timeout_s={timeout_s}", f"train.run_dir={run_dir}"]
    log = tmp_path / "job.log"
    proc = launch(log, {"NPROC_PER_NODE": "2", "NNODES": "1"}, overrides)
    try:
        wait_for_checkpoint(proc, run_dir / "checkpoints" / "step_00000002", log)
        workers = workers_by_rank(proc)
        workers[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        gone, _ = psutil.wait_procs([workers[0]], timeout=timeout_s + 30)
        waited = time.monotonic() - stopped_at
    finally:
        kill_job(proc)
    assert gone, f"rank 0 still running {timeout_s + 30} s after rank 1 hung"
    text = log.read_text()
    assert "lctrain: rank 0 stopped: Timed out waiting" in text, text[-4000:]
    assert re.search(f"Last complete checkpoint: {run_dir / 'checkpoints'}/step_\\d{{8}};", text)
    assert "checkpoint.resume=auto" in text
    assert waited >= timeout_s - 1, waited  # it waited for the hung rank as configured, not less
    print(f"rank 0 ended {waited:.1f} s after rank 1 hung (train.timeout_s={timeout_s})")


def test_sigterm_stops_every_rank_with_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    """What ``scancel`` or a preemption does: SIGTERM to torchrun, which passes it on to its workers."""
    corpus = corpus_overrides(write_corpus(tmp_path / "corpus.jsonl"))
    run_dir = tmp_path / "run"
    overrides = [*TINY, *corpus, "parallel.ring=1", "parallel.ulysses=1", "parallel.dp=2", "train.steps=100000"]
    overrides += ["checkpoint.every=2", f"train.run_dir={run_dir}"]
    log = tmp_path / "job.log"
    proc = launch(log, {"NPROC_PER_NODE": "2", "NNODES": "1"}, overrides)
    try:
        wait_for_checkpoint(proc, run_dir / "checkpoints" / "step_00000002", log)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        kill_job(proc)
    text = log.read_text()
    assert proc.returncode == 1  # torchrun: its workers exited with status 1
    stopped = re.findall(r"lctrain: rank (\d) stopped: ([^.]*)\. .*Last complete checkpoint: (\S+);", text)
    assert sorted(rank for rank, _, _ in stopped) == ["0", "1"], text[-4000:]
    assert {reason for _, reason, _ in stopped} == {"received SIGTERM"}  # every rank, not a peer's failure
    assert not re.search(r'File ".*/lctrain/', text), text[-4000:]  # no traceback from a rank (torchrun prints its own)
    assert all(Path(path).parent == run_dir / "checkpoints" for _, _, path in stopped)


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_again_during_shutdown_changes_nothing(tmp_path: Path) -> None:
    """What ``scancel`` does under slurm: SIGTERM to every process of the job step at once (torchrun, and each
    worker directly), then torchrun passes it on to the workers again; here each worker also gets more SIGTERMs
    every few milliseconds while it stops. Every rank still ends with status 1 and the one-line message, and no
    traceback (a second SIGTERM used to raise again inside the first one's handling)."""
    corpus = corpus_overrides(write_corpus(tmp_path / "corpus.jsonl"))
    run_dir = tmp_path / "run"
    overrides = [*TINY, *corpus, "parallel.ring=1", "parallel.ulysses=1", "parallel.dp=2", "train.steps=100000"]
    overrides += ["checkpoint.every=2", f"train.run_dir={run_dir}"]
    log, exits = tmp_path / "job.log", tmp_path / "exits"
    proc = launch(log, {"NPROC_PER_NODE": "2", "NNODES": "1", **recording_env(exits, tmp_path / "logs")}, overrides)
    try:
        wait_for_checkpoint(proc, run_dir / "checkpoints" / "step_00000002", log)
        workers = list(workers_by_rank(proc).values())
        for process in [psutil.Process(proc.pid), *workers]:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(running(worker) for worker in workers):
            for worker in workers:
                try:
                    worker.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.002)
        proc.wait(timeout=60)
    finally:
        kill_job(proc)
    ends = rank_ends(exits)
    assert sorted(ends) == [0, 1], log.read_text()[-4000:]
    for rank, end in ends.items():
        assert "Traceback" not in end["output"], end["output"][-4000:]
        assert (end["status"], end["uncaught"]) == (1, None), end
        stopped = re.findall(rf"lctrain: rank {rank} stopped: (.*)", end["output"])
        assert len(stopped) == 1 and stopped[0].startswith("received SIGTERM. "), end["output"][-4000:]
        assert f"Last complete checkpoint: {run_dir / 'checkpoints'}/step_" in stopped[0]


def test_sigterm_while_stopping_after_a_peer_died_changes_nothing(tmp_path: Path) -> None:
    """What a node failure does under slurm: a peer dies, the survivor's collective fails at once and it stops with
    the one-line message, and meanwhile the launchers (``srun --kill-on-bad-exit``, torchrun) send it SIGTERM. Here
    rank 1 is SIGKILLed and rank 0 gets SIGTERMs every few milliseconds from the moment it prints its message until
    it is gone: it still ends with status 1, that one message, and no traceback (a SIGTERM used to raise in its exit
    hooks)."""
    corpus = corpus_overrides(write_corpus(tmp_path / "corpus.jsonl"))
    run_dir = tmp_path / "run"
    overrides = [*TINY, *corpus, "parallel.ring=1", "parallel.ulysses=1", "parallel.dp=2", "train.steps=100000"]
    overrides += ["checkpoint.every=2", f"train.run_dir={run_dir}"]
    log, exits, logs = tmp_path / "job.log", tmp_path / "exits", tmp_path / "logs"
    proc = launch(log, {"NPROC_PER_NODE": "2", "NNODES": "1", **recording_env(exits, logs)}, overrides)
    try:
        wait_for_checkpoint(proc, run_dir / "checkpoints" / "step_00000002", log)
        workers = workers_by_rank(proc)
        workers[1].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
            "lctrain: rank 0 stopped" in path.read_text() for path in logs.glob("*/attempt_0/0/std*.log")
        ):
            time.sleep(0.001)
        while running(workers[0]):
            try:
                workers[0].send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.002)
        proc.wait(timeout=60)
    finally:
        kill_job(proc)
    ends = rank_ends(exits)
    assert sorted(ends) == [0], log.read_text()[-4000:]  # rank 1 was killed: it recorded nothing
    end = ends[0]
    assert "Traceback" not in end["output"], end["output"][-4000:]
    assert (end["status"], end["uncaught"]) == (1, None), end
    stopped = re.findall(r"lctrain: rank 0 stopped: (.*)", end["output"])
    assert len(stopped) == 1 and f"Last complete checkpoint: {run_dir / 'checkpoints'}/step_" in stopped[0], stopped
