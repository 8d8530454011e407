"""A real slurm cluster and two real network hosts on this one machine, for the cluster tests (and for trying a
recipe by hand: ``tests/cluster/local_cluster.py``). Both need root and Debian's packages (``slurmctld``, ``slurmd``,
``slurm-client``, ``munge``, ``iproute2``, ``util-linux``).

``SlurmCluster``: a munge daemon, ``slurmctld`` and two ``slurmd`` "nodes" (slurm 22.05), every file (key, sockets,
config, state, spool, logs) in one directory of their own, on ports chosen free; nothing under ``/etc`` is
written (``SLURM_CONF`` and ``AuthInfo=socket=...`` point at that directory). The nodes' names resolve to
127.0.0.1 for the jobs, as a real cluster's names do, without editing ``/etc/hosts``: each ``slurmd`` runs in a
mount namespace of its own where a copy of ``/etc/hosts`` with one more line is bind-mounted over it, and the
jobs it starts inherit that namespace.

``TwoHosts``: two network namespaces joined by a veth pair (``testbed/hosts.py``, which the ring overlap
benchmark uses too), each end with its own address in a private /24; each "host" also has its own hostname (a UTS
namespace) and an ``/etc/hosts`` naming both (a mount namespace), so that the rendezvous and gloo find each host's
veth address by name as they would on two machines. Nothing else is attached to those namespaces, so their traffic
cannot leave them.

Both are context managers that stop everything they started, even when the body fails: daemons, every job
process (found by a marker in its environment), namespaces and links, and their directory.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from testbed.hosts import MARKER, NetworkHosts, Started, in_mount_namespace, kill_marked, run, which

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "iproute2"]
COMMANDS = ["munged", "munge", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo"]
COMMANDS += ["ip", "unshare", "mount"]


def unavailable() -> str | None:
    """Why the cluster suite cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (daemons, namespaces): run it with `make test-cluster` as root"
    missing = [name for name in COMMANDS if shutil.which(name, path=os.environ["PATH"] + ":/usr/sbin:/sbin") is None]
    if missing:
        return f"missing {', '.join(missing)}: `make test-cluster` installs {' '.join(PACKAGES)} with apt-get"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something true; that value, or an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s")
        time.sleep(interval)


class SlurmCluster(Started):
    """munged, slurmctld and two slurmd nodes named ``<prefix>1`` and ``<prefix>2``, all files under ``root``.

    ``start()`` leaves the daemons running (in sessions of their own) and writes ``root/cluster.json``;
    ``stop()`` (also from another process, given the same ``root``) cancels every job, stops the daemons, kills any
    process still marked as this cluster's, and removes ``root`` when ``remove``. As a context manager it does both.
    """

    def __init__(self, root: Path, cpus_per_node: int = 2, prefix: str | None = None) -> None:
        self.root = Path(root)
        self.cpus = cpus_per_node
        self.prefix = prefix or f"lct{secrets.token_hex(2)}n"
        self.nodes = [f"{self.prefix}1", f"{self.prefix}2"]
        self.conf = self.root / "slurm.conf"
        self.marker = str(self.root)

    @classmethod
    def attach(cls, root: Path) -> SlurmCluster:
        """The cluster that ``start()`` left running in ``root`` (to stop it from another process)."""
        state = json.loads((Path(root) / "cluster.json").read_text())
        return cls(root, prefix=state["prefix"])

    # environment for slurm commands (sbatch, squeue, ...) and for the jobs they submit
    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), MARKER: self.marker}

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged requires every directory above its socket to be searchable by all
        (self.root / "state").mkdir()
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        hosts = self.root / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text().rstrip("\n") + f"\n127.0.0.1 {' '.join(self.nodes)}\n")
        ports = [free_port() for _ in range(3)]
        self.conf.write_text(self.config(ports))
        munge_socket = self.root / "munge.socket"
        self.daemon(
            "munged",
            [which("munged"), "--foreground", f"--key-file={key}", f"--socket={munge_socket}"]
            + [f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log"]
            + [f"--seed-file={self.root}/munged.seed"],
        )
        wait_until(munge_socket.exists, 20, "munged's socket")
        self.daemon("slurmctld", [which("slurmctld"), "-D", "-f", str(self.conf)])
        wait_until(lambda: self.scontrol_ok(), 30, "slurmctld answering")
        for node in self.nodes:
            self.daemon(node, in_mount_namespace(hosts, [which("slurmd"), "-D", "-N", node, "-f", str(self.conf)]))
        wait_until(lambda: self.idle_nodes() == self.nodes, 60, f"nodes {self.nodes} idle")

    def config(self, ports: list[int]) -> str:
        root, host = self.root, socket.gethostname()
        lines = [
            f"ClusterName={self.prefix}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge.socket",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",  # the nodes are as configured, whatever this machine has
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SchedulerParameters=sched_interval=2",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "MinJobAge=3600",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool-%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd-%n.log",
            f"PlugStackConfig={root}/plugstack.conf",
        ]
        (root / "plugstack.conf").write_text("")
        for node, port in zip(self.nodes, ports[1:]):
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                "RealMemory=1000 State=UNKNOWN"
            )
        # jobs run in "debug"; a job in "urgent" preempts them: they are requeued (SIGTERM, then SIGKILL after
        # KillWait), as on clusters that preempt low-priority jobs
        nodes = ",".join(self.nodes)
        lines.append(f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1")
        lines.append(f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2")
        return "\n".join(lines) + "\n"

    def daemon(self, name: str, command: list[str]) -> None:
        """Start a daemon in a session of its own (it outlives this process), its output in ``<name>.out``, its pid
        in ``cluster.json``."""
        log = (self.root / f"{name}.out").open("w")
        env = {**self.env, "PATH": os.environ["PATH"] + ":/usr/sbin:/sbin"}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        state = self.root / "cluster.json"
        pids = json.loads(state.read_text())["pids"] if state.exists() else {}
        pids[name] = process.pid
        record = {"pids": pids, "nodes": self.nodes, "prefix": self.prefix, "conf": str(self.conf)}
        state.write_text(json.dumps(record, indent=1))

    def scontrol_ok(self) -> bool:
        result = subprocess.run([which("scontrol"), "ping"], env=self.env, capture_output=True, text=True)
        return result.returncode == 0 and "UP" in result.stdout

    def idle_nodes(self) -> list[str]:
        out = run([which("sinfo"), "-h", "-N", "-o", "%N %t"], env=self.env)
        return sorted({node for node, state in (line.split() for line in out.splitlines()) if state == "idle"})

    def sbatch(self, args: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        """Submit; returns the job id."""
        result = subprocess.run(
            [which("sbatch"), "--parsable", *args],
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = run([which("scontrol"), "show", "job", "-o", str(job_id)], env=self.env)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def steps(self, job_id: int) -> list[str]:
        """The job's running steps (none once it has ended)."""
        result = subprocess.run(
            [which("squeue"), "-h", "-s", "-j", str(job_id), "-o", "%i"], env=self.env, capture_output=True, text=True
        )
        return result.stdout.split() if result.returncode == 0 else []

    def wait_job(self, job_id: int, states: Sequence[str], timeout: float) -> dict[str, str]:
        """Wait until the job is in one of ``states`` (e.g. COMPLETED, FAILED, CANCELLED); returns its record."""
        return wait_until(
            lambda: (job := self.job(job_id))["JobState"] in states and job,
            timeout,
            f"job {job_id} in {'/'.join(states)} (now {self.job(job_id)['JobState']})",
            interval=0.5,
        )

    def scontrol(self, *args: str) -> str:
        return run([which("scontrol"), *args], env=self.env)

    def scancel(self, *args: str) -> str:
        return run([which("scancel"), *args], env=self.env)

    def stop(self, remove: bool = True) -> None:
        state = self.root / "cluster.json"
        pids = json.loads(state.read_text())["pids"] if state.exists() else {}
        if pids.get("slurmctld") and self.scontrol_ok():
            jobs = subprocess.run([which("squeue"), "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
            if jobs.stdout.split():
                subprocess.run([which("scancel"), *jobs.stdout.split()], env=self.env, capture_output=True)
            try:
                wait_until(lambda: not run([which("squeue"), "-h"], env=self.env).strip(), 60, "no jobs left")
            except (AssertionError, RuntimeError):
                pass  # killed below
        for name in [*self.nodes, "slurmctld", "munged"]:  # the nodes first, then the controller, then munge
            try:
                daemon = psutil.Process(pids[name])
                if daemon.environ().get(MARKER) != self.marker:
                    continue  # gone, and its pid taken by another process
                daemon.terminate()
                daemon.wait(15)
            except (KeyError, psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
            except psutil.TimeoutExpired:
                daemon.kill()
        kill_marked(self.marker)  # job steps, slurmstepd and anything else this cluster started
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


class TwoHosts(NetworkHosts):
    """Network namespaces ``<prefix>a`` and ``<prefix>b`` joined by a veth pair: "hosts" ``<prefix>-a`` at
    ``10.X.Y.1`` and ``<prefix>-b`` at ``10.X.Y.2``, each with its own hostname and ``/etc/hosts``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, ("a", "b"))

    def set_link(self, up: bool) -> None:
        """Bring host a's end of the link down (no packet passes either way; the connections stay open) or up."""
        run([which("ip"), "-n", self.namespaces["a"], "link", "set", self.links["a"], "up" if up else "down"])

    def bytes_over_link(self) -> int:
        """Bytes host a received on its end of the link so far."""
        stats = Path(f"/sys/class/net/{self.links['a']}/statistics/rx_bytes")  # only visible inside the namespace
        out = run([which("ip"), "netns", "exec", self.namespaces["a"], "cat", str(stats)])
        return int(out)
