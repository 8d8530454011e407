"""Pipeline parallelism over the ``pp`` mesh axis, with ``torch.distributed.pipelining`` schedules.

``apply_pipeline`` splits a Hugging Face Llama-style causal LM into stages without touching its classes. A stage
is a ``PipelineStageModule`` that holds some of the model's own submodules under their Hugging Face names: the
first stage ``model.embed_tokens``, every stage its ``model.layers.<i>`` (global index) and ``model.rotary_emb``
(RoPE is computed wherever layers run), the last stage ``model.norm`` and ``lm_head``. Parameter names, and so
random init, checkpoints and export, are the same for every pp degree.

Stages are balanced by layer count unless split points are named. With ``stages_per_rank`` > 1 (interleaved and
looped schedules) rank ``r`` of the pp group holds stages ``r, r + pp, ...``; the V-shaped schedules (ZBVZeroBubble,
DualPipeV) give it stages ``r`` and ``2·pp - 1 - r``.

One pipeline micro-batch is one packed row (``[1, S_local]`` tokens): rows carry their own document bounds, which
travel beside the activations as keyword arguments (every stage gets them from its own data loader).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class
from transformers import PreTrainedModel

from lctrain.train.loss import chunked_cross_entropy

# schedules run here: one stage per rank, several (looped: rank r holds r, r + pp, ...), several in a V
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES
LAYER_PREFIX = "model.layers."


def check_pipeline(
    pp: int,
    schedule: str,
    stages_per_rank: int,
    split_points: Sequence[str],
    num_layers: int,
    microbatches: int,
    *,
    tied_embeddings: bool = False,
) -> None:
    """Raise one clear error for a pipeline that cannot run (before any process group work).

    ``microbatches`` is the number of rows per optimizer step (``data.batch_size × train.grad_accum``).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r} must be one of {SCHEDULES}")
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise ValueError(
            f"parallel.pp_schedule={schedule} runs one stage per rank, but parallel.pp_stages_per_rank="
            f"{stages_per_rank}: set it to 1, or choose an interleaved schedule ({', '.join(LOOPED_SCHEDULES)})"
        )
    if schedule in LOOPED_SCHEDULES and stages_per_rank < 2:
        raise ValueError(
            f"parallel.pp_schedule={schedule} interleaves several stages per rank: set parallel.pp_stages_per_rank "
            f">= 2 (it is {stages_per_rank})"
        )
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise ValueError(
            f"parallel.pp_schedule={schedule} runs exactly 2 stages per rank: set parallel.pp_stages_per_rank=2 "
            f"(it is {stages_per_rank})"
        )
    num_stages = pp * stages_per_rank
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages (parallel.pp={pp} x parallel.pp_stages_per_rank={stages_per_rank}) "
            f"but the model has only {num_layers} layers: every stage needs at least one layer; lower parallel.pp "
            f"or parallel.pp_stages_per_rank"
        )
    stage_layers(num_layers, num_stages, split_points)  # raises for bad split points
    if schedule in ("1F1B", "DualPipeV") and microbatches < num_stages:
        raise ValueError(
            f"parallel.pp_schedule={schedule} needs at least as many micro-batches as stages ({num_stages}), but a "
            f"step has {microbatches} (data.batch_size x train.grad_accum rows): raise data.batch_size or "
            f"train.grad_accum, or use GPipe"
        )
    rounds = max(1, microbatches // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % rounds:
        raise ValueError(
            f"parallel.pp_schedule={schedule} runs micro-batches in rounds of parallel.pp={pp}: a step's "
            f"{microbatches} micro-batches (data.batch_size x train.grad_accum rows) must be a multiple of "
            f"{rounds}; use a multiple of {pp}"
        )
    if tied_embeddings:
        raise ValueError(
            f"parallel.pp={pp} with tied input and output embeddings: the first stage holds the embeddings and the "
            f"last the LM head, which cannot share one tensor; set parallel.pp=1 (or untie them: "
            f"model.tie_word_embeddings=false)"
        )


def stage_layers(num_layers: int, num_stages: int, split_points: Sequence[str] = ()) -> list[range]:
    """The decoder layers of each stage. ``split_points`` name the first layer of every stage after the first
    (``["model.layers.6", "model.layers.12"]``); none = balanced by count (earlier stages take the remainder)."""
    if not split_points:
        sizes = [num_layers // num_stages + (stage < num_layers % num_stages) for stage in range(num_stages)]
        starts = [sum(sizes[:stage]) for stage in range(num_stages)]
    else:
        if len(split_points) != num_stages - 1:
            raise ValueError(
                f"parallel.pp_split_points has {len(split_points)} entries but {num_stages} stages need "
                f"{num_stages - 1}: name the first layer of every stage after the first, e.g. "
                f"[{LAYER_PREFIX}{num_layers // num_stages}, ...]"
            )
        starts = [0]
        for point in split_points:
            index = point.removeprefix(LAYER_PREFIX)
            if not point.startswith(LAYER_PREFIX) or not index.isdigit() or not 0 < int(index) < num_layers:
                raise ValueError(
                    f"parallel.pp_split_points entry {point!r} is not a decoder layer: use {LAYER_PREFIX}<i> with "
                    f"0 < i < {num_layers}"
                )
            if int(index) <= starts[-1]:
                raise ValueError(
                    f"parallel.pp_split_points {list(split_points)} must name increasing layers (every stage "
                    f"needs at least one layer)"
                )
            starts.append(int(index))
    return [range(start, end) for start, end in zip(starts, [*starts[1:], num_layers])]


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
    """One pipeline stage: ``[embed_tokens] -> layers -> [norm -> chunked loss]``, as the Hugging Face model's
    forward runs them (attention is whatever implementation the model was patched with)."""

    def __init__(
        self,
        model: PreTrainedModel,
        layers: Sequence[int],
        *,
        stage_index: int,
        num_stages: int,
        loss_chunk_tokens: int,
    ):
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
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(self, x: Tensor, *, position_ids: Tensor, cu_seqlens: Tensor, labels: Tensor) -> Tensor:
        """First stage: ``x`` = token ids ``[1, S_local]``; others: hidden states ``[1, S_local, hidden]``.

        ``position_ids`` ``[1, S_local]`` (global positions of this rank's tokens), ``cu_seqlens`` ``[1, D]`` the
        row's document bounds padded with -1, ``labels`` ``[1, S_local]``. Returns the hidden states for the next
        stage, or on the last stage the token-summed loss (a scalar).
        """
        hidden = self.model.embed_tokens(x) if self.first else x
        position_embeddings = self.model.rotary_emb(hidden, position_ids=position_ids)
        bounds = cu_seqlens[0]
        bounds = bounds[bounds >= 0]
        for layer in self.model.layers.values():
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                cu_seq_lens_q=bounds,
            )
        if not self.last:
            return hidden
        loss_sum, _ = chunked_cross_entropy(
            self.model.norm(hidden), self.lm_head.weight, labels, chunk_tokens=self.loss_chunk_tokens
        )
        return loss_sum


def apply_pipeline(
    model: PreTrainedModel,
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    stages_per_rank: int = 1,
    split_points: Sequence[str] = (),
    loss_chunk_tokens: int = 1024,
) -> list[PipelineStageModule]:
    """Split ``model`` into ``pp × stages_per_rank`` stages and return this rank's stage modules, in stage order.

    Call ``check_pipeline`` first. Then apply activation checkpointing and FSDP to each stage module, and
    ``merge_stages`` for the one module the optimizer and checkpoints see.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    layers = stage_layers(len(model.model.layers), pp * stages_per_rank, split_points)
    return [
        PipelineStageModule(
            model, layers[index], stage_index=index, num_stages=len(layers), loss_chunk_tokens=loss_chunk_tokens
        )
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


def build_schedule(
    stages: Sequence[PipelineStageModule],
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    microbatches: int,
    device: torch.device,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The ``torch.distributed.pipelining`` schedule over this rank's (already sharded) stage modules.

    ``loss_fn(loss_sum, labels)`` turns the last stage's output into the loss to backpropagate; gradients are not
    scaled by the schedule (the loss is already divided by the step's global token count).
    """
    pipeline_stages = [
        PipelineStage(module, module.stage_index, module.num_stages, device, group=pp_mesh.get_group())
        for module in stages
    ]
    schedule_class = get_schedule_class(schedule)
    return schedule_class(
        pipeline_stages[0] if schedule in SINGLE_STAGE_SCHEDULES else pipeline_stages,
        n_microbatches=microbatches,
        loss_fn=loss_fn,
        scale_grads=False,
    )
