"""The process a command runs in: device and dtypes, logging, the default process group, SIGTERM and failures.

``train`` and ``eval`` both go through ``run_command``, which gives every job the same behaviour:

1. the config is composed and checked before any process group exists: a bad config, a bad setting for this world
   size or a missing file ends the process with one line (``lctrain: ...``) and exit status 1, having written
   nothing;
2. the default process group is set up (torchrun's environment, or a group of one for a plain ``python`` run);
3. the job runs. A ``ValueError`` or ``FileNotFoundError`` it raises ends every rank with one line and exit status
   1. When a peer dies or hangs (a failed collective) or SIGTERM arrives (the launcher stopping the job, ``scancel``,
   preemption), every surviving rank ends with exit status 1 and one line saying so and, for training, naming the
   last complete checkpoint to resume from. A second SIGTERM, or one that arrives while the job is already ending,
   changes nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from lctrain.config import JobConfig, ParallelConfig, load_config

logger = logging.getLogger("lctrain")
# a rank but rank 0 that finds a bad config waits this long before its line and exit (``_exit_before_group``): the
# ranks reach the check within a second or two of each other, even on a loaded machine
OTHER_RANKS_WAIT_S = 5.0


def resolve_device(name: str) -> torch.device:
    """``train.device``: ``cuda`` (this process's ``LOCAL_RANK`` GPU), ``cpu``, or ``auto`` (CUDA when available)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but CUDA is not available: set train.device=cpu (or auto)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``parallel.param_dtype`` / ``reduce_dtype``: a torch dtype name, or ``auto`` = bf16 on CUDA, fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass(frozen=True)
class Precision:
    """The job's dtypes, resolved once for its device (``parallel.param_dtype``, ``parallel.reduce_dtype``)."""

    param: torch.dtype  # parameters and compute
    reduce: torch.dtype  # the gradients' reduce-scatter

    @classmethod
    def resolve(cls, parallel: ParallelConfig, device: torch.device) -> Precision:
        return cls(resolve_dtype(parallel.param_dtype, device), resolve_dtype(parallel.reduce_dtype, device))


class _ProgressBarSafeHandler(logging.Handler):
    """Writes records with ``tqdm.write``, so log lines and rank 0's progress bar share the terminal cleanly."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging must never raise)
            self.handleError(record)


def setup_logging(rank: int) -> None:
    """One rank-aware logger: rank 0 prints INFO, the others only warnings and errors, each line prefixed with the
    rank."""
    handler = _ProgressBarSafeHandler()
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(handlers=[handler], force=True)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def world_size_from_env() -> int:
    """The number of processes the launcher started (torchrun's ``WORLD_SIZE``; 1 for a plain ``python`` run)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def process_group_backend(device: torch.device, *, host_collectives: bool = False) -> str:
    """gloo on CPU; NCCL on CUDA, with gloo beside it for tensors in host memory when ``host_collectives``
    (``parallel.cpu_offload``: the gradients, and so the gradient norm's reductions, are on the host)."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


def init_distributed(device: torch.device, timeout_s: float, *, host_collectives: bool = False) -> None:
    """The default process group (``process_group_backend``) from torchrun's environment, or a group of one for a
    plain ``python`` run. A collective that waits ``timeout_s`` for the other ranks raises instead of hanging."""
    if dist.is_initialized():
        return
    backend = process_group_backend(device, host_collectives=host_collectives)
    device_id = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        device_id = device
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device_id, timeout=timeout)
    else:
        dist.init_process_group(
            backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1, device_id=device_id, timeout=timeout
        )


class Terminated(BaseException):
    """SIGTERM reached this rank: the launcher stops every rank when one fails, or the job was cancelled. Like
    ``KeyboardInterrupt`` it is not an ``Exception``, so the ``except Exception`` of a logging handler, a checkpoint
    reader or a library does not swallow it wherever the signal happens to arrive."""


class _TerminateOnce:
    """The SIGTERM handler: raises ``Terminated`` in the job the first time, and does nothing afterwards or once the
    job is already ending. slurm signals every process of a step and torchrun forwards the signal too, so a rank
    can receive SIGTERM twice, the second time while the first is being handled."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, signum: int, frame: object) -> None:
        if self.armed:
            self.armed = False
            raise Terminated(f"received {signal.Signals(signum).name}")


def is_communication_failure(error: BaseException) -> bool:
    """A collective or transfer failed: a peer process died (its connections closed), a peer hung past
    ``train.timeout_s``, or the network failed. gloo raises these as plain ``RuntimeError`` naming gloo."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


def rank_error(error: BaseException, rank: int) -> BaseException:
    """What stopped ``rank``: ``error`` itself, or inside a checkpoint's save or load (DCP gathers every rank's error
    into one ``CheckpointException``, SIGTERM's ``Terminated`` among them) this rank's own error, else the first."""
    if isinstance(error, CheckpointException) and error.failures:
        return (error.failures.get(rank) or next(iter(error.failures.values())))[0]
    return error


def first_sentence(error: BaseException) -> str:
    """``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1970. This is ...`` ->
    ``Connection closed by peer [127.0.0.1]:1970``."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.split(". ")[0].splitlines()[0] if text else type(error).__name__


def _exit_before_group(message: str) -> None:
    """Exit status 1 with one line. Before the process group every rank finds the same problem in the same config:
    rank 0 prints it and exits at once, the others print it only after ``OTHER_RANKS_WAIT_S``. The launcher stops
    every rank as soon as one exits, so the line comes once, from rank 0, and still comes (from another rank) when
    rank 0 is the slowest to get there."""
    if int(os.environ.get("RANK", 0)) != 0:
        time.sleep(OTHER_RANKS_WAIT_S)
    print(f"lctrain: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _exit_from_job(message: str) -> None:
    """Exit status 1 with one line from this rank (every rank: the launcher may stop the others as soon as one
    exits)."""
    logger.error("lctrain: %s", message)
    raise SystemExit(1)


def load_config_or_exit(overrides: Sequence[str]) -> JobConfig:
    """The job's config; a bad one ends the process with one line and exit status 1 (``_exit_before_group``)."""
    try:
        return load_config(overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        _exit_before_group(f"bad config: {error}")


def run_command(
    overrides: Sequence[str],
    *,
    check: Callable[[JobConfig, int], object],
    job: Callable[[JobConfig], object],
    checkpoints: Callable[[JobConfig], Path | None] | None = None,
) -> None:
    """Run a command as the module docstring says. ``check(cfg, world_size)`` validates the job before any process
    group exists (raising ``ValueError`` or ``FileNotFoundError``); ``job(cfg)`` runs it on the default process
    group; ``checkpoints(cfg)`` names the last complete checkpoint for the message after a failure (training)."""
    cfg = load_config_or_exit(overrides)
    try:
        check(cfg, world_size_from_env())
    except (ValueError, FileNotFoundError) as error:
        _exit_before_group(str(error))
    sigterm = _TerminateOnce()
    signal.signal(signal.SIGTERM, sigterm)
    init_distributed(resolve_device(cfg.train.device), cfg.train.timeout_s, host_collectives=cfg.parallel.cpu_offload)
    setup_logging(dist.get_rank())
    try:
        job(cfg)
        sigterm.armed = False
    except (ValueError, FileNotFoundError) as error:
        sigterm.armed = False  # the launcher stops the other ranks now: their SIGTERM is no news here
        _exit_from_job(str(error))
    except (Terminated, CheckpointException, Exception) as error:
        sigterm.armed = False
        error = rank_error(error, dist.get_rank())
        if not (isinstance(error, Terminated) or is_communication_failure(error)):
            raise
        if isinstance(error, Terminated):
            cause = "the launcher stopped this rank (another rank failed, or the job was cancelled or preempted)"
        else:
            cause = "another rank has failed (see the first failure in the launcher's report) or the network did"
        resume = "relaunch the same command"
        if checkpoints is not None:
            latest = checkpoints(cfg)
            resume = f"Last complete checkpoint: {latest or 'none'}; relaunch the same command (checkpoint.resume=auto)"
            resume += " to continue from it"
        _exit_from_job(f"rank {dist.get_rank()} stopped: {first_sentence(error)}. Probably {cause}. {resume}.")
    finally:
        dist.destroy_process_group()
