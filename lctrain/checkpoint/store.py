"""``Checkpointer``: save and load (model, optimizer, per-rank extras) as ``<run_dir>/checkpoints/step_XXXXXXXX/``
(the package docstring describes the whole design)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lctrain.checkpoint.checksums import check_share, write_manifest
from lctrain.checkpoint.compat import check_matches
from lctrain.checkpoint.errors import all_gather, config_hint, first_line, fix_hint, raise_first
from lctrain.checkpoint.safe_read import SafeReader, WeightsOnlyLoadPlanner

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# one key per parameter (its Hugging Face name) for the optimizer state and hyperparameters too, so each pipeline
# stage saves its own keys and any pp degree loads them (nested param_groups would keep only one rank's)
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# the trained parameters only: a LoRA job's frozen base is not saved (it is rebuilt from model.path or the seeded
# init); in full fine-tuning every parameter is trained
_MODEL_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# loading leaves the frozen parameters as they are (load_state_dict's strict would miss them); the keys of the
# trained ones were compared with the checkpoint's before (check_matches)
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint directory ``step_XXXXXXXX``."""
    match = _STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (step_XXXXXXXX)")
    return int(match.group(1))


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
        self._verified: dict[Path, frozenset[str]] = {}  # checkpoint -> the files its manifest lists

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
            "model": get_model_state_dict(model, options=_MODEL_OPTIONS),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
        }
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(extra, tmp / f"rank_{rank:05d}.pt")
        dist.barrier()
        write_manifest(tmp)
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

    def verify(self, path: str | Path) -> frozenset[str]:
        """Check every file of the checkpoint ``path`` against its ``checksums.json`` (once per checkpoint; returns
        the files it lists). Collective: every rank calls it with the same path, and every rank raises the same
        ``ValueError`` (a corrupted file or manifest) or ``FileNotFoundError`` (a missing file or manifest)."""
        path = _complete(path)
        key = path.resolve()
        if key not in self._verified:
            files, problems = check_share(path)
            raise_first(all_gather(problems))
            self._verified[key] = files
        return self._verified[key]

    def read_extra(self, path: str | Path, rank: int) -> dict[str, Any]:
        """The extras that ``rank`` saved in the checkpoint ``path``. Collective: every rank calls it with the same
        path (``rank`` may differ), and if any rank cannot read its file, every rank raises that error."""
        path = _complete(path)
        files = self.verify(path)
        extra_file = path / f"rank_{rank:05d}.pt"
        extra, problems = None, []
        if extra_file.name not in files:
            message = f"{extra_file} is missing: the checkpoint {path} is incomplete or damaged"
            problems.append(((dist.get_rank(),), "FileNotFoundError", message))
        else:
            try:
                extra = torch.load(extra_file, weights_only=True)
            except Exception as error:
                message = (
                    f"{extra_file} cannot be read as a checkpoint's extras ({first_line(error)}): the checkpoint "
                    f"{path} is damaged or was not written by lctrain; {fix_hint(path)}"
                )
                problems.append(((dist.get_rank(),), "ValueError", message))
        raise_first(all_gather(problems))
        return extra

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load ``path`` into the model and optimizer: any FSDP layout and any pipeline split (names are the
        Hugging Face ones), so the mesh may differ from the one that saved it. Every rank calls it; a damaged
        checkpoint or one of another model raises the same error on every rank."""
        path = _complete(path)
        files = self.verify(path)
        state = {
            "model": get_model_state_dict(model, options=_MODEL_OPTIONS),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
        }
        check_matches(path, files, state)
        try:
            dcp.load(state, storage_reader=SafeReader(path), planner=WeightsOnlyLoadPlanner())
        except CheckpointException as error:  # a BaseException, raised on every rank
            rank, (exc, _) = min(error.failures.items(), key=lambda item: item[0])
            raise ValueError(
                f"{path} could not be loaded (rank {rank}: {type(exc).__name__}: {first_line(exc)}): the checkpoint "
                f"is damaged, or does not match this model (the model.* settings must match the run that saved "
                f"it{config_hint(path)})"
            ) from None
        set_model_state_dict(model, state["model"], options=_LOAD_OPTIONS)
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)


def _complete(path: str | Path) -> Path:
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no .metadata): pass a step_XXXXXXXX directory, or "
            f"checkpoint.resume=auto to take the latest complete one"
        )
    return path
