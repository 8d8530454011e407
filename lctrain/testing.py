"""Run a function on a new group of gloo processes on CPU: the one helper tests and benchmarks use."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str, env: dict[str, str]
) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env, OMP_NUM_THREADS="1")  # in this child only: one thread per rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# what every rank of a test or benchmark imports, imported once by the fork server its ranks are forked from
FORK_SERVER_PRELOAD = ["torch", "transformers", "lctrain.train.trainer", "lctrain.eval.evaluator"]


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``. Ranks are forked from a server process started once,
    which imported only ``FORK_SERVER_PRELOAD``: a rank starts in 0.15 s (the first group of a process in about 6 s,
    the server's start), against 29 s to spawn 4 fresh interpreters that import torch and transformers (2 CPU cores).
    Not forked from the caller: a test process holds what earlier tests left, which a forked child inherits broken
    (a process group, CUDA, other libraries' threads: ranks forked from a pytest process that had run the unit suite
    first crashed with a segmentation fault, MLflow's OpenTelemetry exporter threads running in them)."""
    if "forkserver" in mp.get_all_start_methods():
        mp.set_forkserver_preload(FORK_SERVER_PRELOAD)  # no effect once the server runs
        return "forkserver"
    return "spawn"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new single-threaded processes (``start_method()``, with this process's
    environment) in one gloo group (TCP on loopback); return each rank's result.

    ``fn`` must be importable (module level) and its result picklable. An exception on any rank fails the call
    with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        worker_args = (world_size, _free_port(), fn, args, out_dir, dict(os.environ))
        mp.start_processes(_worker, args=worker_args, nprocs=world_size, join=True, start_method=start_method())
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results
