"""The training objective: what a step minimizes, from each row's final hidden states and the LM head.

The trainer calls an objective through one narrow interface, in this order every step:

1. ``step_counts(micro_batches)``: counts taken on the host from this rank's micro-batches of the step, moved to the
   device and summed over the objective's group in one all-reduce. ``counts[0]`` is what the step's loss is a mean
   over, named by ``counted`` (e.g. "trained token"); 0 means nothing to train (the trainer then skips the update).
   An objective may also compute there, before any forward of the policy in the step, what its rows need, and add
   it to each micro-batch as a field of its own (the preference objective's reference log-probs).
2. ``loss(hidden, weight, row, counts)`` for each row: ``hidden`` ``[1, S_local, H]`` (this rank's part of the row,
   after the final norm), ``weight`` the LM head ``[vocab, H]``, ``row`` the row's fields named in ``fields``
   (``[1, S_local]``, on the device; a field the batch holds as a per-row host list, such as ``pair_counts``, as
   that row's item, or with a pipeline stacked: ``lctrain.parallel.pipeline.step_inputs``). Returns this rank's
   differentiable share of the step's loss, which the trainer back-propagates, and detached fp64 sums for the report
   (``[report_size]``). The shares add up over the rows and every rank to the step's loss (FSDP sums the gradients
   over dp_cp); the trainer sums the report sums the same way.
3. ``report(counts, sums)``: the step's counts and summed report sums, read back to the host, as metrics.

Whatever an objective needs beyond the LM head's inputs stays inside it: its own fields of a row, its own reductions
inside ``loss`` (per-sequence sums over the context-parallel group, say), its own terms added to the share (taken
from the model by hooks) and reported through the sums. The trainer does not branch on the objective.

The step's totals travel as a ``StepTotals`` value from the forward-backward to the optimizer step and the report.
With a pipeline, ``loss`` runs inside the last stage's forward (its head), as each row reaches it; the other stages
report zeros of the same size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.config.schema import ObjectiveConfig
from lctrain.data.packing import IGNORE_INDEX
from lctrain.parallel.mesh import JobMesh
from lctrain.train.loss import chunked_cross_entropy, chunked_cross_entropy_by_group
from lctrain.train.preference import PreferenceLoss
from lctrain.train.reference import Reference

Batch = dict[str, Any]


@dataclass
class StepTotals:
    """One step's totals on the device, returned by ``Trainer.forward_backward``."""

    loss: Tensor  # this rank's share of the step's loss (a scalar; summed over every rank: the step's loss)
    counts: Tensor  # int64 [n]: the objective's step counts, already summed over its group (``step_counts``)
    sums: Tensor  # fp64 [m]: this rank's report sums over the step's rows (to be summed over every rank)

    @property
    def trained(self) -> Tensor:
        """A device bool: the step had something to train."""
        return self.counts[0] > 0


class TokenMeanLoss:
    """The language-modelling loss: the cross-entropy summed over the step's trained tokens (labels not
    ``IGNORE_INDEX``) divided by their number over ``group`` (dp_cp) and the step's micro-batches, so that the step's
    loss is the token mean over the global batch on any mesh. A rank without a trained token adds 0, never 0/0.

    With several ``sources`` (their names, in the order of the rows' ``sources`` ids) the counts are
    ``[trained tokens, then per source]`` and the report sums each source's token losses, from the same chunks as the
    loss: ``loss/<name>`` (that source's token mean) and ``tokens/<name>``."""

    counted = "trained token"  # what counts[0] counts, in words

    def __init__(self, sources: Sequence[str], *, group: dist.ProcessGroup, device: torch.device, chunk_tokens: int):
        self.sources = list(sources) if len(sources) > 1 else []
        self.group, self.device, self.chunk_tokens = group, device, chunk_tokens
        self.fields = ("labels", "sources") if self.sources else ("labels",)
        self.report_size = len(self.sources)

    def step_counts(self, micro_batches: Sequence[Batch]) -> Tensor:
        """int64 ``[1 + len(sources)]`` on the device: the step's trained tokens (then per source), over ``group``."""
        masks = [batch["labels"] != IGNORE_INDEX for batch in micro_batches]
        counts = [sum(mask.sum() for mask in masks).view(1)]
        if self.sources:
            sources = [batch["sources"][mask].long() for batch, mask in zip(micro_batches, masks)]
            counts.append(sum(torch.bincount(s, minlength=len(self.sources)) for s in sources))
        # queued behind the device's work, not waiting for it
        step_counts = torch.cat(counts).to(self.device, non_blocking=True)
        dist.all_reduce(step_counts, group=self.group)
        return step_counts

    def loss(self, hidden: Tensor, weight: Tensor, row: Batch, counts: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's share of the step's loss from one row (its token-summed loss over the step's trained tokens
        ``counts[0]``; without any, the sum is 0 and so is the share) and the row's loss sums per source (fp64
        ``[len(sources)]``, detached; empty with one source)."""
        tokens = counts[0].clamp(min=1)
        if not self.sources:
            total = chunked_cross_entropy(hidden, weight, row["labels"], chunk_tokens=self.chunk_tokens)[0]
            return total / tokens, counts.new_zeros(0, dtype=torch.float64)
        total, sums, _ = chunked_cross_entropy_by_group(
            hidden, weight, row["labels"], row["sources"], len(self.sources), chunk_tokens=self.chunk_tokens
        )
        return total / tokens, sums

    def report(self, counts: Sequence[float], sums: Sequence[float]) -> dict[str, float | None]:
        """With several sources, ``loss/<name>`` (None for a source without a trained token) and ``tokens/<name>``;
        else nothing."""
        result: dict[str, float | None] = {}
        for index, name in enumerate(self.sources):
            count = counts[1 + index]
            result[f"loss/{name}"] = sums[index] / count if count else None
            result[f"tokens/{name}"] = int(count)
        return result


Objective = TokenMeanLoss | PreferenceLoss


def build_objective(
    objective: ObjectiveConfig,
    sources: Sequence[str],
    *,
    mesh: JobMesh,
    device: torch.device,
    chunk_tokens: int,
    reference: Reference | None,
    last_stage: bool,
) -> Objective:
    """The objective of ``objective.name`` over the rows' ``sources``, its sums reduced over ``mesh``'s groups:
    ``TokenMeanLoss``, or ``PreferenceLoss`` with its ``reference`` (``lctrain.train.reference.build_reference``;
    ``last_stage``: this rank runs the model's last pipeline stage, or the whole model). ``chunk_tokens``:
    ``train.loss_chunk_tokens``."""
    if objective.name == "lm":
        return TokenMeanLoss(sources, group=mesh.dp_cp, device=device, chunk_tokens=chunk_tokens)
    return PreferenceLoss(
        objective,
        sources,
        group=mesh.dp_cp,
        cp_group=mesh.cp,
        device=device,
        chunk_tokens=chunk_tokens,
        reference=reference,
        last_stage=last_stage,
    )
