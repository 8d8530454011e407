"""Pipeline parallelism over the ``pp`` mesh axis, with ``torch.distributed.pipelining`` schedules.

``apply_pipeline`` splits a Hugging Face Llama-style causal LM into stages without touching its classes. A stage
is a ``PipelineStageModule`` that holds some of the model's own submodules under their Hugging Face names: the
first stage ``model.embed_tokens``, every stage its ``model.layers.<i>`` (global index) and ``model.rotary_emb``
(RoPE is computed wherever layers run; per layer type where the family has RoPE per layer type, as Gemma 3's local
and global layers), the last stage ``model.norm`` and ``lm_head``. Parameter names, and so
random init, checkpoints and export, are the same for every pp degree.

Stages are balanced by layer count unless split points are named. With ``stages_per_rank`` > 1 (interleaved and
looped schedules) rank ``r`` of the pp group holds stages ``r, r + pp, ...``; the V-shaped schedules (ZBVZeroBubble,
DualPipeV) give it stages ``r`` and ``2·pp - 1 - r``.

One pipeline micro-batch is one packed row (``[1, S_local]`` tokens): rows carry their own document bounds (and shared
prefixes), which travel beside the activations as keyword arguments (every stage gets them from its own data
loader), as do the fields the last stage's ``head`` reads (``step_inputs``). The head is a keyword argument too, so
that one set of stage modules serves a training schedule and a forward-only one (a preference objective's
reference pass through the same weights with their adapters off).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class
from transformers import PreTrainedModel

from lctrain.families import FAMILIES
from lctrain.rules import SINGLE_STAGE_SCHEDULES, V_SCHEDULES

# (final hidden states after the norm [1, S_local, hidden], LM head weight [vocab, hidden], the row's fields) -> the
# last stage's output for the row
StageHead = Callable[[Tensor, Tensor, dict[str, Any]], Tensor]
Schedule = PipelineScheduleSingle | PipelineScheduleMulti


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """The stage indices pp rank ``pp_rank`` holds (module docstring)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + pp * k for k in range(stages_per_rank)]


class ModelParts(nn.Module):
    """Parts of a Hugging Face causal LM under their Hugging Face names (the modules are shared, not copied).

    ``model.layers`` is a ``ModuleDict`` keyed by global layer index, so ``model.layers.5.mlp.up_proj.weight``
    keeps its name. Absent parts (``embed_tokens`` off the first stage, ``norm`` and ``lm_head`` off the last) are
    not attributes at all.
    """

    def __init__(
        self,
        layers: dict[str, nn.Module],
        rotary_emb: nn.Module,
        *,
        embed_tokens: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ):
        super().__init__()
        self.model = nn.Module()
        if embed_tokens is not None:
            self.model.embed_tokens = embed_tokens
        self.model.layers = nn.ModuleDict(layers)
        self.model.rotary_emb = rotary_emb
        if norm is not None:
            self.model.norm = norm
            self.lm_head = lm_head


class PipelineStageModule(ModelParts):
    """One pipeline stage: ``[embed_tokens] -> layers -> [norm -> head]``, as the Hugging Face model's forward runs
    them (attention is whatever implementation the model was patched with).

    The decoder layers of every family lctrain runs (``lctrain.families``) take the same call, and each
    layer's sliding window lives in its own attention module (Qwen) or the config (Mistral), so the windows need no
    mask here: the model's forward would only build masks, which USP attention does not take."""

    def __init__(self, model: PreTrainedModel, layers: Sequence[int], *, stage_index: int, num_stages: int):
        first, last = stage_index == 0, stage_index == num_stages - 1
        super().__init__(
            {str(index): model.model.layers[index] for index in layers},
            model.model.rotary_emb,
            embed_tokens=model.model.embed_tokens if first else None,
            norm=model.model.norm if last else None,
            lm_head=model.lm_head if last else None,
        )
        self.stage_index, self.num_stages = stage_index, num_stages
        self.first, self.last = first, last
        # with RoPE per layer type (Gemma 3: local and global layers' bases), each layer's type; else None
        per_type = FAMILIES[model.config.model_type].rope_per_layer_type
        self.layer_types = {str(i): model.config.layer_types[i] for i in layers} if per_type else None
        # a tensor the stages pass along beside the hidden states, each adding what its layers computed of the row
        # (a mixture of experts' router totals, ``lctrain.models.moe.RouterTotals``); the last stage's head gets it
        # as the row's ``carried``
        self.carry: Callable[[Tensor | None], Tensor] | None = None

    def forward(
        self,
        x: Tensor,
        *carried: Tensor,
        position_ids: Tensor,
        cu_seqlens: Tensor,
        doc_prefix: Tensor | None,
        head: StageHead,
        row: dict[str, Any],
    ) -> Tensor:
        """First stage: ``x`` = token ids ``[1, S_local]``; others: hidden states ``[1, S_local, hidden]``.

        ``position_ids`` ``[1, S_local]`` (global positions of this rank's tokens), ``cu_seqlens`` ``[1, D]`` the
        row's document bounds padded with -1, ``doc_prefix`` ``[1, D']`` (``D' >= D - 1``, or None: no document has
        one) each document's shared prefix (-1: none), cut to the row's documents here; ``row`` the row's fields for
        the last stage's ``head``; ``carried`` (with a ``carry``, after the first stage) what the stage before
        passed on. Returns the hidden states for the next stage (and with a ``carry`` what it passes on), or on the
        last stage what ``head`` makes of the final normed hidden states.
        """
        hidden = self.model.embed_tokens(x) if self.first else x
        if self.layer_types is None:
            rope = self.model.rotary_emb(hidden, position_ids=position_ids)
            position_embeddings = dict.fromkeys(self.model.layers, rope)
        else:
            kinds = {kind: self.model.rotary_emb(hidden, position_ids, kind) for kind in set(self.layer_types.values())}
            position_embeddings = {index: kinds[kind] for index, kind in self.layer_types.items()}
        bounds = cu_seqlens[0]
        bounds = bounds[bounds >= 0]
        prefixes = None if doc_prefix is None else doc_prefix[0, : len(bounds) - 1]
        for index, layer in self.model.layers.items():
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=position_embeddings[index],
                cu_seq_lens_q=bounds,
                doc_prefix=prefixes,
            )
        if self.carry is not None:
            passed_on = self.carry(carried[0] if carried else None)
            if not self.last:
                return hidden, passed_on
            row = {**row, "carried": passed_on}
        if not self.last:
            return hidden
        return head(self.model.norm(hidden), self.lm_head.weight, row)


def step_inputs(micro_batches: Sequence[dict[str, Any]], fields: Sequence[str], device: torch.device) -> dict[str, Any]:
    """A step's rows as a schedule's inputs, one row per pipeline micro-batch (``schedule.step(input_ids,
    **inputs, head=...)``): ``input_ids`` and ``position_ids`` ``[rows, S_local]`` on ``device``; the document
    bounds ``cu_seqlens`` and the shared prefixes ``doc_prefix`` (None without) padded with -1 on the host, where the
    attention plans its blocks; ``row``: the batch ``fields`` the head reads, per-token ones ``[rows, S_local]`` on
    ``device``, per-row lists (one item a row) stacked: ints as a host ``[rows]`` tensor, tensors padded to
    ``[rows, longest]`` (each row's item is then a prefix of its padded one).
    """

    def pad(tensors: Sequence[Tensor]) -> Tensor:
        return torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True, padding_value=-1)

    def rows(key: str) -> list[Any]:
        return [item for batch in micro_batches for item in batch[key]]

    def stacked(key: str) -> Tensor:
        if not isinstance(micro_batches[0][key], list):
            return torch.cat([batch[key] for batch in micro_batches]).to(device, non_blocking=True)
        items = rows(key)
        return pad(items) if isinstance(items[0], Tensor) else torch.tensor(items, dtype=torch.int64)

    return {
        "input_ids": stacked("input_ids"),
        "position_ids": stacked("position_ids"),
        "cu_seqlens": pad(rows("cu_seqlens")),
        "doc_prefix": pad(rows("doc_prefix")) if "doc_prefix" in micro_batches[0] else None,
        "row": {key: stacked(key) for key in fields},
    }


def apply_pipeline(
    model: PreTrainedModel, pp_mesh: DeviceMesh, layers: Sequence[range], *, schedule: str, stages_per_rank: int = 1
) -> list[PipelineStageModule]:
    """Split ``model`` into the stages of ``layers`` (each stage's decoder layers: ``lctrain.rules.stage_layers``
    for ``pp × stages_per_rank`` stages) and return this rank's stage modules, in stage order.

    Call ``check_pipeline`` first. Then apply activation checkpointing and FSDP to each stage module, and
    ``merge_stages`` for the one module the optimizer and checkpoints see.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    return [
        PipelineStageModule(model, layers[index], stage_index=index, num_stages=len(layers))
        for index in sorted(rank_stages(pp_rank, pp, stages_per_rank, schedule))
    ]


def merge_stages(stages: Sequence[PipelineStageModule]) -> ModelParts:
    """This rank's stages as one module with Hugging Face names (parameters shared): for the optimizer, gradient
    clipping, checkpoints and export."""
    first, last = stages[0], stages[-1]
    return ModelParts(
        {key: layer for stage in stages for key, layer in stage.model.layers.items()},
        first.model.rotary_emb,
        embed_tokens=first.model.embed_tokens if first.first else None,
        norm=last.model.norm if last.last else None,
        lm_head=last.lm_head if last.last else None,
    )


def row_share(output: Tensor, target: Tensor) -> Tensor:
    """A training schedule's ``loss_fn``: the last stage's head returns, per row, ``[its share of the step's loss,
    then its report sums]`` (already divided by the step's counts, so the schedule scales nothing); the share is
    back-propagated. ``target`` (``schedule.step`` needs one per micro-batch) is not read."""
    return output[:1].sum()  # a tensor of its own: the schedule detaches the loss in place, which a view refuses


def build_schedule(
    stages: Sequence[PipelineStageModule],
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    microbatches: int,
    device: torch.device,
    training: bool,
) -> Schedule:
    """The ``torch.distributed.pipelining`` schedule over this rank's (already sharded) stage modules, for
    ``microbatches`` rows a run.

    ``training``: ``schedule.step`` back-propagates element 0 of each row's head output (``row_share``); otherwise
    the schedule has no loss and runs forward only (``schedule.eval``). A training and a forward-only schedule may
    share stage modules: each keeps its own mode (a schedule switched between the two would infer its stages'
    metadata again at every switch).
    """
    pipeline_stages = [
        PipelineStage(module, module.stage_index, module.num_stages, device, group=pp_mesh.get_group())
        for module in stages
    ]
    schedule_class = get_schedule_class(schedule)
    return schedule_class(
        pipeline_stages[0] if schedule in SINGLE_STAGE_SCHEDULES else pipeline_stages,
        n_microbatches=microbatches,
        loss_fn=row_share if training else None,
        scale_grads=False,
    )
