"""Two "hosts" with their own addresses (``tests/cluster/harness.py``: two network namespaces joined by a veth
pair, each with its own hostname), each running ``scripts/launch.sh`` with ``NNODES=2`` and the c10d rendezvous on
host a's name: gloo connects the ranks over the veth link, not loopback.

- The job trains with the losses of the one-node run; its traffic crossed the link (byte counter).
- The link is cut (``ip link set ... down``) once a checkpoint is complete: every rank on both hosts stops within
  ``train.timeout_s`` (plus slack) with exit status 1 and lctrain's one-line message naming that checkpoint.
- The link comes back and the same command is launched again on both hosts: it resumes from that checkpoint and
  every step equals the uninterrupted run's (tolerance 0).
- A host that never joins: host a alone, with ``RDZV_TIMEOUT=10``, fails within a bounded time with launch.sh's
  line naming the rendezvous and what to check, before any rank starts.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.harness import TwoHosts, free_port
from tests.cluster.training import (
    JOB_TIMEOUT_S,
    PEER_GONE,
    REPO,
    STEPS,
    TIMEOUT_S,
    check_stopped,
    complete_checkpoints,
    job_env,
    numbers,
    overrides,
    records,
    wait_for_checkpoint_after,
)
from tests.helpers.jobs import kill_job, rank_ends

RDZV_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> TwoHosts:
    with TwoHosts(tmp_path_factory.mktemp("hosts")) as both:
        yield both


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobs")


def launch(hosts: TwoHosts, work: Path, corpus: Path, name: str, host: str, port: int, **env: str) -> subprocess.Popen:
    """``NNODES=2 NPROC_PER_NODE=2 MASTER_ADDR=<host a> scripts/launch.sh <job>`` on ``host``."""
    environment = job_env(work, name, NNODES="2", NPROC_PER_NODE="2", MASTER_ADDR=hosts.hostnames["a"])
    environment |= {"MASTER_PORT": str(port), "RDZV_ID": f"{name}-{port}", **env}
    command = ["bash", "scripts/launch.sh", *overrides(work / "run", corpus)]
    return hosts.popen(host, command, work / f"{name}-{host}.log", environment, REPO)


def wait_all(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs.values():
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))


@pytest.fixture(scope="module")
def link_cut(hosts: TwoHosts, work: Path, corpus: Path) -> dict[str, Any]:
    """The job on both hosts; the link is cut as soon as its first checkpoint is complete. Returns how its ranks
    ended once all four have (the launchers are then stopped: host b's torchrun, cut off from the rendezvous store
    on host a, would wait minutes for it)."""
    port = free_port()
    procs = {host: launch(hosts, work, corpus, "cut", host, port) for host in "ab"}
    try:
        alive = lambda: all(proc.poll() is None for proc in procs.values())  # noqa: E731
        checkpoint = wait_for_checkpoint_after(work / "run", 0, alive, "the two-host job")
        traffic = hosts.bytes_over_link()
        hosts.set_link(up=False)
        cut_at = time.time()
        exits = work / "cut" / "exits"
        deadline = time.monotonic() + TIMEOUT_S + 90
        while len(list(exits.glob("rank_*.json"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        ends = rank_ends(exits)
        try:
            procs["a"].wait(timeout=60)  # host a's torchrun reports its failed ranks and exits
        except subprocess.TimeoutExpired:
            pass
        launcher_a = procs["a"].returncode
    finally:
        for proc in procs.values():
            kill_job(proc)
        hosts.set_link(up=True)
    return {
        "checkpoint": checkpoint,
        "checkpoints": complete_checkpoints(work / "run"),
        "ends": ends,
        "seconds": {rank: end["time"] - cut_at for rank, end in ends.items()},
        "traffic": traffic,
        "records": records(work / "run"),
        "launcher_a": launcher_a,
        "log_a": (work / "cut-a.log").read_text(),
    }


@pytest.fixture(scope="module")
def relaunched(hosts: TwoHosts, work: Path, corpus: Path, link_cut: dict[str, Any]) -> dict[str, Any]:
    """The same command on both hosts again, with the link back up: it runs to the end."""
    port = free_port()
    procs = {host: launch(hosts, work, corpus, "again", host, port) for host in "ab"}
    try:
        wait_all(procs, JOB_TIMEOUT_S)
    finally:
        for proc in procs.values():
            kill_job(proc)
    logs = {host: (work / f"again-{host}.log").read_text() for host in "ab"}
    assert [procs[h].returncode for h in "ab"] == [0, 0], logs["a"][-3000:] + logs["b"][-3000:]
    return {"ends": rank_ends(work / "again" / "exits"), "records": records(work / "run")}


def test_two_hosts_train_as_one_node_over_the_link(
    link_cut: dict[str, Any], reference: list[dict[str, Any]], hosts: TwoHosts
) -> None:
    nodes = {rank: end["node"] for rank, end in link_cut["ends"].items()}
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3] and set(nodes.values()) == set(hosts.hostnames.values())
    assert "mesh pp=1 dp=1 ring=2 ulysses=2" in link_cut["ends"][0]["output"]
    assert link_cut["traffic"] > 1_000_000  # the ring's transfers crossed the veth link (bytes host a received)
    steps = len(link_cut["records"])
    assert steps >= link_cut["checkpoint"]
    assert numbers(link_cut["records"]) == numbers(reference[:steps])


def test_cut_link_stops_every_rank_on_both_hosts(link_cut: dict[str, Any], work: Path) -> None:
    checkpoint = work / "run" / "checkpoints" / f"step_{link_cut['checkpoints'][-1]:08d}"
    check_stopped(link_cut["ends"], [0, 1, 2, 3], checkpoint, PEER_GONE)
    assert max(link_cut["seconds"].values()) < TIMEOUT_S + 60, link_cut["seconds"]
    assert link_cut["launcher_a"] == 1, link_cut["log_a"][-3000:]
    print(f"ranks stopped {sorted(round(s, 1) for s in link_cut['seconds'].values())} s after the cut")


def test_relaunch_after_the_link_is_back_resumes_exactly(
    link_cut: dict[str, Any], relaunched: dict[str, Any], reference: list[dict[str, Any]], work: Path
) -> None:
    step = link_cut["checkpoints"][-1]
    checkpoint = work / "run" / "checkpoints" / f"step_{step:08d}"
    assert f"resumed from {checkpoint} at step {step}" in relaunched["ends"][0]["output"]
    assert {end["status"] for end in relaunched["ends"].values()} == {0} and sorted(relaunched["ends"]) == [0, 1, 2, 3]
    rows = relaunched["records"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[:step] == link_cut["records"][:step]
    assert numbers(rows) == numbers(reference)


def test_host_that_never_joins_fails_the_rendezvous_in_bounded_time(hosts: TwoHosts, work: Path, corpus: Path) -> None:
    started = time.monotonic()
    proc = launch(hosts, work, corpus, "alone", "a", free_port(), RDZV_TIMEOUT=str(RDZV_TIMEOUT_S))
    try:
        proc.wait(timeout=RDZV_TIMEOUT_S + 120)
    finally:
        kill_job(proc)
    seconds = time.monotonic() - started
    log = (work / "alone-a.log").read_text()
    assert proc.returncode == 1, log[-3000:]
    assert re.search(
        rf"lctrain launch: the rendezvous at {hosts.hostnames['a']}:\d+ \(id alone-\d+\) failed "
        rf"\(RendezvousTimeoutError\): every node must run scripts/launch.sh with the same NNODES=2, .* within "
        rf"RDZV_TIMEOUT={RDZV_TIMEOUT_S} s of the first",
        log,
    ), log[-3000:]
    assert not (work / "alone" / "exits").exists() or not list((work / "alone" / "exits").iterdir())  # no rank ran
    assert seconds < RDZV_TIMEOUT_S + 120
    print(f"the lone host failed {seconds:.1f} s after it started (RDZV_TIMEOUT={RDZV_TIMEOUT_S})")
