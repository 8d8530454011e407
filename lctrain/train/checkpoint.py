"""Distributed checkpoints: ``<run_dir>/checkpoints/step_XXXXXXXX/``, written atomically.

Model and optimizer state go through ``torch.distributed.checkpoint`` (each rank writes its shards; loading works
for any FSDP layout). What differs per rank (data loader position, RNG states) and the small plain state (step,
scheduler) go to ``rank_XXXXX.pt``, read back with ``weights_only=True``. Everything is written into
``step_XXXXXXXX.tmp``; once every rank is done, rank 0 renames it to ``step_XXXXXXXX``. A directory without the
``.tmp`` suffix is therefore complete, and a crash mid-save leaves only a ``.tmp`` directory, which is never resumed
from and is deleted by the next save.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


class Checkpointer:
    """Save and load (model, optimizer, per-rank extras) under ``root``, keeping the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int):
        self.root = Path(root)
        self.keep = keep

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Path:
        """Every rank calls this. ``extra`` is this rank's plain state (ints, floats, lists, dicts, tensors)."""
        rank = dist.get_rank()
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            for stale in self.root.glob("step_*.tmp"):
                shutil.rmtree(stale)  # a save that crashed before
            tmp.mkdir(parents=True)
        dist.barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(extra, tmp / f"rank_{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            tmp.rename(final)
            for old in complete_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old)
        dist.barrier()
        return final

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load ``path`` into the model and optimizer (any FSDP layout); return this rank's extras."""
        path = Path(path)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"{path} is not a complete checkpoint (no .metadata): pass a step_XXXXXXXX directory, or "
                f"checkpoint.resume=auto to take the latest complete one"
            )
        extra_file = path / f"rank_{dist.get_rank():05d}.pt"
        if not extra_file.is_file():
            raise FileNotFoundError(
                f"{extra_file} is missing: the checkpoint was written by a job with fewer ranks; resume with the "
                f"same world size"
            )
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        return torch.load(extra_file, weights_only=True)
