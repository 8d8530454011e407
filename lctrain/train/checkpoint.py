"""Distributed checkpoints: ``<run_dir>/checkpoints/step_XXXXXXXX/``, written atomically.

Model and optimizer state go through ``torch.distributed.checkpoint`` (each rank writes its shards; loading works
for any FSDP layout). What differs per rank (data loader position, RNG states) and the small plain state (step,
scheduler, the mesh) go to ``rank_XXXXX.pt``, read back with ``weights_only=True``. Everything is written into
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
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# one key per parameter (its Hugging Face name) for the optimizer state and hyperparameters too, so each pipeline
# stage saves its own keys and any pp degree loads them (nested param_groups would keep only one rank's)
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
        }
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(extra, tmp / f"rank_{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            if final.exists():  # the same step from an earlier run in this directory (checkpoint.resume=none)
                shutil.rmtree(final)
            tmp.rename(final)
            for old in complete_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old)
        dist.barrier()
        return final

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def read_extra(self, path: str | Path, rank: int) -> dict[str, Any]:
        """The extras that ``rank`` saved in the checkpoint ``path``."""
        path = _complete(path)
        extra_file = path / f"rank_{rank:05d}.pt"
        if not extra_file.is_file():
            raise FileNotFoundError(f"{extra_file} is missing: the checkpoint {path} is incomplete or damaged")
        return torch.load(extra_file, weights_only=True)

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load ``path`` into the model and optimizer: any FSDP layout and any pipeline split (names are the
        Hugging Face ones), so the mesh may differ from the one that saved it."""
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
        }
        dcp.load(state, checkpoint_id=str(_complete(path)))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)


def _complete(path: str | Path) -> Path:
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no .metadata): pass a step_XXXXXXXX directory, or "
            f"checkpoint.resume=auto to take the latest complete one"
        )
    return path
