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


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # in this child only: one thread per rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def start_method() -> str:
    """``fork`` where the platform has it and this process holds neither a process group nor CUDA (a forked child
    would inherit them broken); else ``spawn``. Spawning re-imports torch and transformers in every rank (about 29 s
    for 4 ranks on 2 CPU cores); a forked rank starts with what this process imported (0.2 s)."""
    if "fork" in mp.get_all_start_methods() and not dist.is_initialized() and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` new single-threaded processes (``start_method()``) in one gloo group
    (TCP on loopback); return each rank's result.

    ``fn`` must be importable (module level) and its result picklable. An exception on any rank fails the call
    with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        worker_args = (world_size, _free_port(), fn, args, out_dir)
        mp.start_processes(_worker, args=worker_args, nprocs=world_size, join=True, start_method=start_method())
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results
