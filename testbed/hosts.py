"""Network "hosts" on this one machine: network namespaces with their own addresses, hostnames and ``/etc/hosts``,
joined by veth pairs, each link optionally rate-limited with ``tc``'s ``tbf`` qdisc. Needs root and Debian's
``iproute2`` and ``util-linux``. The cluster tests (``tests/cluster/harness.py``) and the ring overlap benchmark
(``bench_ring_overlap.py``) run their processes in them.

Two hosts are joined by one veth pair; more hosts each by a veth pair to a bridge in a namespace of its own (a
switch). Nothing else is attached to those namespaces, so their traffic cannot leave them. ``NetworkHosts`` is a
context manager that removes everything it made, even when the body fails: every process it started (found by a
marker in its environment), its namespaces and links (and with them their qdiscs), and its directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import psutil

MARKER = "LCTRAIN_LOCAL_CLUSTER"  # in the environment of every process a cluster or a host starts
COMMANDS = ["ip", "tc", "unshare", "mount"]
# burst: tens of KB, so that short transfers cannot pass at full speed and hide the limit; latency: the queue
TBF = ["burst", "32kb", "latency", "400ms"]


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    missing = [name for name in COMMANDS if shutil.which(name, path=os.environ["PATH"] + ":/usr/sbin:/sbin") is None]
    return f"missing {', '.join(missing)} (Debian's iproute2 and util-linux)" if missing else None


def which(name: str) -> str:
    path = shutil.which(name, path=os.environ["PATH"] + ":/usr/sbin:/sbin")
    assert path, name
    return path


def marked(marker: str) -> list[psutil.Process]:
    """The processes whose environment holds ``MARKER=marker``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(MARKER) == marker:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def alive(process: psutil.Process) -> bool:
    """Running (not gone, not a zombie waiting for its parent)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_marked(marker: str, timeout: float = 30) -> list[str]:
    """SIGKILL every process marked with ``marker`` and wait until they are gone; returns what was killed."""
    killed = []
    for process in marked(marker):
        try:
            killed.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
            process.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout
    while (left := [p for p in marked(marker) if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes survived SIGKILL: {left}"
    return killed


def limit_link(link: str, rate: str | None, prefix: Sequence[str] = ()) -> None:
    """What leaves through ``link`` leaves at most at ``rate`` (``tc``'s units, e.g. ``300mbit``: a ``tbf`` qdisc);
    None: at the link's speed (the qdisc removed). ``prefix`` runs ``tc`` elsewhere (``ip netns exec NS``); a
    process on a host limits its own link with none."""
    tc = [*prefix, which("tc"), "qdisc"]
    if rate is None:
        subprocess.run([*tc, "del", "dev", link, "root"], capture_output=True)  # fails when there is none: fine
    else:
        run([*tc, "replace", "dev", link, "root", "tbf", "rate", rate, *TBF])


def run(command: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60) -> str:
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr or result.stdout}")
    return result.stdout


def in_mount_namespace(hosts: Path, command: Sequence[str], hostname: str | None = None) -> list[str]:
    """``command`` run in a new mount namespace (and UTS namespace, with ``hostname``) where ``hosts`` is
    ``/etc/hosts``; the real one is not touched."""
    script = f'mount --bind "$0" /etc/hosts && {f"hostname {hostname} && " if hostname else ""}exec "$@"'
    return [which("unshare"), "--mount", *(["--uts"] if hostname else []), "sh", "-c", script, str(hosts), *command]


StartedT = TypeVar("StartedT", bound="Started")


class Started:
    """A context manager for a subclass's ``start()`` and ``stop()``: ``start()`` on entry (and ``stop()`` if the start
    fails part way), ``stop()`` on exit."""

    def __enter__(self: StartedT) -> StartedT:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NetworkHosts(Started):
    """One network namespace per name of ``names``: host ``n`` is namespace ``<prefix><n>`` with link
    ``<prefix>v<n>`` at ``10.X.Y.<i + 1>`` (the i-th name), hostname ``<prefix>-<n>`` and an ``/etc/hosts`` naming
    every host."""

    def __init__(self, root: Path, names: Sequence[str]) -> None:
        self.root = Path(root)
        self.names = list(names)
        self.prefix = f"lct{secrets.token_hex(3)}"  # namespaces and links: at most 15 characters
        subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
        self.namespaces = {n: f"{self.prefix}{n}" for n in self.names}
        self.links = {n: f"{self.prefix}v{n}" for n in self.names}
        self.hostnames = {n: f"{self.prefix}-{n}" for n in self.names}
        self.addresses = {n: f"{subnet}.{i + 1}" for i, n in enumerate(self.names)}
        self.switch = f"{self.prefix}sw"  # the bridge's namespace, for more than two hosts
        self.marker = f"{self.root}:{self.prefix}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", *(f"{self.addresses[n]} {self.hostnames[n]}" for n in self.names)]
        (self.root / "hosts").write_text("\n".join(lines) + "\n")
        ip = which("ip")
        for name in self.names:
            run([ip, "netns", "add", self.namespaces[name]])
        if len(self.names) == 2:
            first, second = self.names
            run([ip, "link", "add", self.links[first], "type", "veth", "peer", "name", self.links[second]])
        else:
            run([ip, "netns", "add", self.switch])
            bridge = ["-n", self.switch, "link"]
            run([ip, *bridge, "add", "br0", "type", "bridge"])
            run([ip, *bridge, "set", "br0", "up"])
            for index, name in enumerate(self.names):
                port = f"{self.prefix}p{index}"
                run([ip, "link", "add", self.links[name], "type", "veth", "peer", "name", port])
                run([ip, "link", "set", port, "netns", self.switch])
                run([ip, *bridge, "set", port, "master", "br0"])
                run([ip, *bridge, "set", port, "up"])
        for name in self.names:
            namespace, link = self.namespaces[name], self.links[name]
            run([ip, "link", "set", link, "netns", namespace])
            run([ip, "-n", namespace, "addr", "add", f"{self.addresses[name]}/24", "dev", link])
            run([ip, "-n", namespace, "link", "set", "lo", "up"])
            run([ip, "-n", namespace, "link", "set", link, "up"])

    def command(self, name: str, command: Sequence[str]) -> list[str]:
        """``command`` as run on host ``name``: in its network namespace, with its hostname and ``/etc/hosts``."""
        wrapped = [which("ip"), "netns", "exec", self.namespaces[name]]
        return wrapped + in_mount_namespace(self.root / "hosts", command, hostname=self.hostnames[name])

    def popen(self, name: str, command: Sequence[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """Run ``command`` on host ``name`` in a session of its own, output to ``log``."""
        with log.open("w") as out:
            return subprocess.Popen(
                self.command(name, command),
                cwd=cwd,
                env={**env, MARKER: self.marker},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def limit(self, name: str, rate: str | None) -> None:
        """What host ``name`` sends leaves at most at ``rate`` (``limit_link``)."""
        limit_link(self.links[name], rate, [which("ip"), "netns", "exec", self.namespaces[name]])

    def stop(self) -> None:
        kill_marked(self.marker)
        ip = which("ip")
        for namespace in [*self.namespaces.values(), self.switch]:
            subprocess.run([ip, "netns", "delete", namespace], capture_output=True)  # deletes its links
        for link in self.links.values():
            subprocess.run([ip, "link", "delete", link], capture_output=True)  # if it never moved
        shutil.rmtree(self.root, ignore_errors=True)
