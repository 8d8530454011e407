"""The reference model of the preference losses (``objective.reference``) and its precomputed log-probs
(``objective.precompute_reference``).

- ``initial`` with LoRA: the policy itself with its adapters disabled for the reference pass (no second copy; with a
  pipeline, a forward-only schedule of its own over the policy's stage modules);
- ``initial`` without LoRA: a frozen copy of the initial weights, which the job built like the policy
  (``lctrain.build.build_job``: the same patched attention, mesh, pipeline stages, FSDP sharding and
  ``parallel.cpu_offload``), in eval mode, without gradients or optimizer state;
- ``path``: the weights of a Hugging Face directory, built the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import Tensor

from lctrain.build import BuiltModel, Job
from lctrain.config.schema import ObjectiveConfig
from lctrain.parallel.pipeline import StageHead
from lctrain.train.forward import Batch, RowsForward


class Reference:
    """The reference model's forward over a step's rows (``lctrain.train.forward``: the whole model, or a
    forward-only pipeline schedule) with a head, through the reference weights while ``active()`` holds (the
    policy's own with its adapters disabled, or a frozen model of its own)."""

    def __init__(self, forward: RowsForward, active: Callable[[], AbstractContextManager] = contextlib.nullcontext):
        self.forward, self.active = forward, active

    @torch.no_grad()
    def __call__(self, micro_batches: Sequence[Batch], fields: Sequence[str], head: StageHead) -> Tensor | None:
        """The heads' outputs ``[rows, width]`` (None off a pipeline's last stage), without gradients."""
        with self.active():
            return self.forward(micro_batches, fields, head)


class ReferenceCache:
    """The reference's log-probs of the pairs a run trains and validates on (``objective.precompute_reference``), by
    pair id (the rows' ``pair_ids``): computed in one pass before training, saved with the run (one file per dp rank:
    the pairs of its rows), looked up at each step. ``identity`` names the reference they come from; a file of another
    reference, or a pair not in the file, is refused."""

    def __init__(self, path: Path, identity: str, logps: dict[int, tuple[float, float]] | None = None):
        self.path, self.identity = path, identity
        self.logps: dict[int, tuple[float, float]] = logps or {}

    @classmethod
    def load(cls, path: Path, identity: str) -> ReferenceCache | None:
        """The cache saved at ``path``, or None when there is none."""
        if not path.is_file():
            return None
        saved = torch.load(path, weights_only=True)
        if saved["identity"] != identity:
            raise ValueError(
                f"{path} holds the reference log-probs of {saved['identity']}, not of this job's reference "
                f"({identity}): delete it to compute them again (objective.precompute_reference=true)"
            )
        return cls(path, identity, saved["logps"])

    def add(self, pair_ids: Tensor, logps: Tensor) -> None:
        """A row's pairs ``[K]`` and their reference log-probs ``[2K]`` (chosen, rejected, chosen, ...)."""
        for pair, chosen, rejected in zip(pair_ids.tolist(), logps[0::2].tolist(), logps[1::2].tolist()):
            self.logps[pair] = (chosen, rejected)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        torch.save({"identity": self.identity, "logps": self.logps}, partial)
        partial.replace(self.path)  # never a half-written cache

    def lookup(self, pair_ids: Tensor, device: torch.device) -> Tensor:
        """The reference log-probs ``[2K]`` (chosen, rejected, chosen, ...) of a row's ``pair_ids`` ``[K]``."""
        missing = [pair for pair in pair_ids.tolist() if pair not in self.logps]
        if missing:
            raise ValueError(
                f"pair {missing[0]} has no reference log-probs in {self.path}, which was computed for other data: "
                f"delete it to compute them again (objective.precompute_reference=true)"
            )
        logps = torch.tensor([self.logps[pair] for pair in pair_ids.tolist()], dtype=torch.float64)
        return logps.reshape(-1).to(device)


def adapters_disabled(model: torch.nn.Module) -> Callable[[], AbstractContextManager]:
    """A context factory: inside, every peft adapter of ``model`` (LoRA layers and trained copies) is off, so the
    model computes its frozen base (the reference of a LoRA job, without a second copy of the weights)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]

    # the flag the layers' forward reads: peft's enable_adapters(False) would also clear the adapters' requires_grad,
    # which FSDP2 reads once, at the first forward (when that is the reference's, the adapters would never train)
    @contextlib.contextmanager
    def disabled() -> Iterator[None]:
        for layer in layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in layers:
                layer._disable_adapters = False

    return disabled


def build_reference(
    objective: ObjectiveConfig,
    job: Job,
    policy_forward: Callable[[], RowsForward],
    forward_only: Callable[[BuiltModel], RowsForward],
) -> Reference | None:
    """The reference model of ``objective`` for the policy ``job.model`` (a ``lctrain.build.Job``), or None when no
    loss needs one: the job's frozen reference model (``job.reference``) run by ``forward_only``; without one (LoRA
    and ``objective.reference=initial``), the policy's own forward (``policy_forward()``) with its adapters
    disabled."""
    if not objective.needs_reference:
        return None
    if job.reference is None:
        return Reference(policy_forward(), adapters_disabled(job.model.model))
    return Reference(forward_only(job.reference))
