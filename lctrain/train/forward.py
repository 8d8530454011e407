"""A model's forward over a step's rows, ending in a head: ``head(hidden, weight, row)`` gets a row's final (normed)
hidden states ``[1, S_local, H]``, the LM head's weight ``[vocab, H]`` and the row's fields (``row_fields``), and
returns a tensor for the row. The trainer's head is the objective's share of the loss; a preference objective's
reference pass has one of its own (each completion's log-prob).

- ``ModelForward``: the whole model, one row at a time (``FinalHiddenStates``);
- ``PipelineForward``: a forward-only pipeline schedule over every row of the step at once (``step_inputs``), whose
  heads run on the last stage; one schedule per row length, made at the first rows of that length (a schedule's
  stages keep the shapes of the first rows they run), never the training schedule (which keeps its own mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lctrain.build import BuiltModel, Job
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.parallel.mesh import JobMesh
from lctrain.parallel.pipeline import PipelineStageModule, Schedule, StageHead, build_schedule, step_inputs

Batch = dict[str, Any]


def row_fields(batch: Batch, row: int, keys: Sequence[str], device: torch.device) -> dict[str, Any]:
    """Row ``row`` of a micro-batch's fields ``keys``: per-token ones ``[1, S_local]`` on ``device`` (queued behind
    the device's work), per-row host lists (a row's pair count) as that row's item."""
    return {
        key: batch[key][row]
        if isinstance(batch[key], list)
        else batch[key][row : row + 1].to(device, non_blocking=True)
        for key in keys
    }


def model_hidden(hidden_states: FinalHiddenStates, batch: Batch, row: int, device: torch.device) -> Tensor:
    """The final hidden states ``[1, S_local, H]`` of one row of a micro-batch through ``hidden_states``."""
    rows = slice(row, row + 1)
    return hidden_states(
        batch["input_ids"][rows].to(device, non_blocking=True),
        batch["position_ids"][rows].to(device, non_blocking=True),
        batch["cu_seqlens"][row],  # on the host: the attention plans its blocks from it
        batch["doc_prefix"][row] if "doc_prefix" in batch else None,  # shared prefixes (preference pairs)
    )


class ModelForward:
    """``forward(micro_batches, fields, head)``: every row through the whole model (``hidden_states``) and ``head``;
    the heads' outputs (one width for every row) stacked ``[rows, width]``, rows in micro-batch order."""

    def __init__(self, hidden_states: FinalHiddenStates, device: torch.device):
        self.hidden_states, self.device = hidden_states, device

    def __call__(self, micro_batches: Sequence[Batch], fields: Sequence[str], head: StageHead) -> Tensor | None:
        outputs = []
        for batch in micro_batches:
            for row in range(batch["input_ids"].shape[0]):
                hidden = model_hidden(self.hidden_states, batch, row, self.device)
                # read after the forward: the LM head's full weight, which FSDP gathered for it
                weight = self.hidden_states.model.lm_head.weight
                outputs.append(head(hidden, weight, row_fields(batch, row, fields, self.device)))
        return torch.stack(outputs)


class PipelineForward:
    """The same through forward-only pipeline schedules (``parallel.pp_schedule``, ``build_schedule(training=False)``)
    over ``stages`` on ``mesh``'s pp ranks, whose micro-batches are the ``rows`` rows of a run; None off the last
    stage (which alone runs the heads)."""

    def __init__(
        self, stages: Sequence[PipelineStageModule], mesh: JobMesh, kind: str, rows: int, device: torch.device
    ):
        self.stages, self.mesh, self.kind, self.rows, self.device = stages, mesh, kind, rows, device
        self.schedules: dict[int, Schedule] = {}  # by row length

    def __call__(self, micro_batches: Sequence[Batch], fields: Sequence[str], head: StageHead) -> Tensor | None:
        inputs = step_inputs(micro_batches, fields, self.device)
        rows, length = inputs["input_ids"].shape
        if length not in self.schedules:
            pp = self.mesh.sub_mesh("pp")
            self.schedules[length] = build_schedule(
                self.stages, pp, schedule=self.kind, microbatches=self.rows, device=self.device, training=False
            )
        outputs = self.schedules[length].eval(inputs.pop("input_ids"), **inputs, head=head)
        return None if outputs is None else outputs.view(rows, -1)


RowsForward = Callable[[Sequence[Batch], Sequence[str], StageHead], Tensor | None]


def forward_only(built: BuiltModel, job: Job, rows: int) -> RowsForward:
    """A forward-only run of ``rows`` rows at a time (a step's) through ``built`` (``job.model`` or its reference):
    the whole model (its ``hidden_states``), or forward-only schedules of their own over its pipeline stages."""
    if built.stages:
        return PipelineForward(built.stages, job.mesh, job.cfg.parallel.pp_schedule, rows, job.device)
    return ModelForward(built.hidden_states, job.device)
