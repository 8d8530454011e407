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

from lctrain.rules import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, stage_layers

# (final hidden states [1, S_local, hidden], LM head weight [vocab, hidden], labels [1, S_local]) -> summed loss
StageLoss = Callable[[Tensor, Tensor, Tensor], Tensor]


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
    forward runs them (attention is whatever implementation the model was patched with).

    The decoder layers of every family lctrain runs (``lctrain.models.families``: Llama, Mistral, Qwen2, Qwen3) take
    the same call, and each layer's sliding window lives in its own attention module (Qwen) or the config (Mistral),
    so the windows need no mask here: the model's forward would only build masks, which USP attention does not
    take."""

    def __init__(
        self,
        model: PreTrainedModel,
        layers: Sequence[int],
        *,
        stage_index: int,
        num_stages: int,
        loss: StageLoss,
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
        self.loss = loss

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
        return self.loss(self.model.norm(hidden), self.lm_head.weight, labels)


def apply_pipeline(
    model: PreTrainedModel,
    pp_mesh: DeviceMesh,
    *,
    schedule: str,
    stages_per_rank: int = 1,
    split_points: Sequence[str] = (),
    loss: StageLoss,
) -> list[PipelineStageModule]:
    """Split ``model`` into ``pp × stages_per_rank`` stages and return this rank's stage modules, in stage order.

    Call ``check_pipeline`` first. Then apply activation checkpointing and FSDP to each stage module, and
    ``merge_stages`` for the one module the optimizer and checkpoints see.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    layers = stage_layers(len(model.model.layers), pp * stages_per_rank, split_points)
    return [
        PipelineStageModule(model, layers[index], stage_index=index, num_stages=len(layers), loss=loss)
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

    ``loss_fn(loss_sum, target)`` turns the last stage's output into the loss to backpropagate, ``target`` being
    the micro-batch's part of ``schedule.step(target=...)``: the trainer passes the step's global token count once
    per row, so the loss is already divided by it and the schedule does not scale the gradients.
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
