"""``train.timeout_s`` bounds the waits on every process group of the mesh, not only on the default group.

Torch creates a device mesh's groups with its own default timeout (30 minutes for gloo, 10 for NCCL) unless it is
given options; ``JobMesh.build`` gives them the default group's. Found on two network hosts whose link
was cut: ranks blocked in a ring transfer (a subgroup) did not stop after ``train.timeout_s``.

4 spawned gloo ranks, default group created with a 10 s timeout (room for a slow start on a loaded machine), mesh
ring 2 × ulysses 2 (ring, Ulysses and the flattened ``cp``/``dp_cp`` groups). Rank 0 alone starts an all-reduce
on each of these groups at once; the other ranks do not take part (they wait, then exit after 120 s). Each
all-reduce must fail with gloo's ``Timed out waiting 10000ms``, not wait for the others to exit (``Connection
closed by peer``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lctrain.parallel.dims import ParallelDims
from lctrain.parallel.mesh import JobMesh
from lctrain.testing import start_method

GROUPS = ("ring", "ulysses", "cp", "dp_cp")
TIMEOUT_S = 10


def _worker(rank: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=timeout)
    mesh = JobMesh.build(ParallelDims(ring=2, ulysses=2), "cpu")
    groups = {"ring": mesh.group("ring"), "ulysses": mesh.group("ulysses"), "cp": mesh.cp, "dp_cp": mesh.dp_cp}
    done = Path(out) / "done"
    if rank != 0:
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    started = time.monotonic()
    works = {name: dist.all_reduce(torch.ones(4), group=groups[name], async_op=True) for name in GROUPS}
    results = {}
    for name, work in works.items():
        try:
            work.wait()
            results[name] = ["completed", time.monotonic() - started]
        except Exception as error:  # gloo raises RuntimeError or DistError
            results[name] = [str(error).split("] ", 1)[-1][:80], time.monotonic() - started]
    (Path(out) / "results.json").write_text(json.dumps(results))
    done.touch()
    os._exit(0)


def test_every_mesh_group_times_out_after_train_timeout(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, str(tmp_path)), nprocs=4, join=True, start_method=start_method())
    results = json.loads((tmp_path / "results.json").read_text())
    for name in GROUPS:
        message, seconds = results[name]
        assert message.startswith(f"Timed out waiting {TIMEOUT_S * 1000}ms"), (name, message, seconds)
        assert seconds < 90, (name, seconds)  # far below the others' 120 s: the timeout, not their exit
