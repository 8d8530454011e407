"""Building a job, the one way ``train`` and ``eval`` both use, in dependency order: the prepared model (no process
group: the tokenizer, the transformers config after the ``model.*`` settings, every check of the job against that
model, and where the weights come from, the reference model's too), then ``build_job``: the device, the dtypes
(``Precision``, resolved once), the mesh and its groups (``lctrain.parallel.mesh.JobMesh``), the model on it and,
when training, the pipeline's training schedule and the preference objective's frozen reference model. The training
and evaluation jobs add their own parts to this ``Job`` (``lctrain.train.job``, ``lctrain.eval.evaluator``).

``build_model`` puts a model on the job's mesh, applying parallelism in one fixed order:

    empty model (meta) -> LoRA adapters (model.lora) -> USP attention -> experts (a mixture of experts: lctrain's
    experts implementation, spread over parallel.ep ranks) -> pipeline stages -> chunked MLP
    -> activation checkpointing (training) -> FSDP over dp_cp, the experts over the ranks holding the same ones
    (parameters in host memory with parallel.cpu_offload) -> weights, one full tensor at a time
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from lctrain.config import JobConfig, ParallelConfig, check_model_job
from lctrain.data import load_tokenizer
from lctrain.models import (
    LoraConfig,
    build_empty_model,
    materialize,
    model_config,
    patch_attention,
    random_init_source,
    safetensors_source,
)
from lctrain.models.hf import TensorSource
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.models.lora import adapter_source, apply_lora
from lctrain.models.moe import Routers, RouterTotals, model_routers
from lctrain.parallel.activation_checkpointing import apply_activation_checkpointing
from lctrain.parallel.chunked_mlp import apply_chunked_mlp
from lctrain.parallel.expert import apply_expert_parallel, expert_kernel, experts_modules
from lctrain.parallel.fsdp import apply_fsdp
from lctrain.parallel.mesh import JobMesh
from lctrain.parallel.pipeline import PipelineStageModule, Schedule, apply_pipeline, build_schedule, merge_stages
from lctrain.rules import stage_layers
from lctrain.runtime import Precision, resolve_device


def tokenizer_path(cfg: JobConfig) -> str | None:
    """``data.tokenizer``, else the fine-tuned checkpoint's own (``model.path``), else None (the embedded one)."""
    return cfg.data.tokenizer or cfg.model.path


@dataclass
class PreparedModel:
    """What a job knows about its model before any process group exists."""

    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig  # the transformers config, with the job's model.* settings applied
    # full tensors by Hugging Face name: the checkpoint's, or a seeded random init; and the adapters' initial values
    source: TensorSource
    # the decoder layers of each pipeline stage (parallel.pp × pp_stages_per_rank of them, cut at
    # parallel.pp_split_points, else balanced: lctrain.rules.stage_layers); [] when parallel.pp = 1
    stage_layers: list[range]
    routers: Routers | None  # a mixture of experts' routers: layers, experts, loss weight; None for a dense model
    # the weights of the preference objective's frozen reference model: the initial ones (objective.reference=initial
    # without LoRA) or objective.reference_path's; None when the objective builds none (no reference, or the LoRA
    # policy with its adapters disabled)
    reference: TensorSource | None


def prepare_model(cfg: JobConfig, world_size: int) -> PreparedModel:
    """The tokenizer, the model config, the weight sources (the model's, its reference's) and the pipeline's
    stages, with the job checked against them (``check_job``). Raises ``ValueError`` or ``FileNotFoundError``
    naming the setting; reads no weight."""
    path = tokenizer_path(cfg)
    tokenizer = load_tokenizer(path)
    config = model_config(cfg.model, len(tokenizer))
    if config.vocab_size < len(tokenizer):
        raise ValueError(
            f"the tokenizer ({path}) has {len(tokenizer)} tokens but the model {cfg.model.path} only "
            f"{config.vocab_size} embeddings: use the model's own tokenizer"
        )
    check_model_job(cfg, world_size, config, len(tokenizer))
    if cfg.model.path is not None:
        source = safetensors_source(cfg.model.path, config)  # fails now if the weights cannot make the model
    else:
        source = random_init_source(config, cfg.train.seed)
    source = adapter_source(source, cfg.train.seed)
    objective, reference = cfg.objective, None
    if objective.reference == "path" and objective.needs_reference:
        reference = safetensors_source(objective.reference_path, config, "objective.reference_path")
    elif objective.needs_reference and not cfg.model.lora.rank:
        reference = source  # the initial weights (without adapters: the reference is built without LoRA)
    routers = model_routers(config)
    par, layers = cfg.parallel, []
    if par.pp > 1:  # checked by check_job (check_pipeline)
        layers = stage_layers(config.num_hidden_layers, par.pp * par.pp_stages_per_rank, par.pp_split_points)
    return PreparedModel(tokenizer, config, source, layers, routers, reference)


@dataclass
class BuiltModel:
    # the model (with pp > 1: this rank's stage modules merged under Hugging Face names, for the optimizer, clipping,
    # checkpoints and export)
    model: nn.Module
    stages: list[PipelineStageModule]  # this rank's pipeline stages, in order; [] when pp = 1
    num_params: int  # of the whole model (tied weights once)
    hidden_states: FinalHiddenStates | None  # the whole model's forward (its final hidden states); None with stages
    # training a mixture of experts: the whole model's router totals of a row, for the router's load-balancing loss
    # (with stages, each stage's carry instead: None); None for a dense or a frozen model
    router_totals: RouterTotals | None


def build_model(
    prepared: PreparedModel,
    weights: TensorSource,
    mesh: JobMesh,
    device: torch.device,
    precision: Precision,
    *,
    parallel: ParallelConfig,
    lora: LoraConfig,
    training: bool,
) -> BuiltModel:
    """The model of ``prepared.config`` with ``weights`` (``prepared.source``, or its reference's) on ``mesh``, built
    in the order of the module docstring from the job's ``parallel`` section and ``model.lora``. With
    ``parallel.pp > 1``, this rank's stage modules are in ``stages`` (for ``build_schedule``). ``training=False``: no
    activation checkpointing, modules in eval mode."""
    model = build_empty_model(prepared.config)
    num_params = sum(p.numel() for p in model.parameters())
    # first, on the empty model: peft's LoRA layers and trained copies; every later step sees ordinary modules
    apply_lora(model, lora)
    patch_attention(
        model,
        ulysses_group=mesh.group("ulysses"),
        ring_group=mesh.group("ring"),
        layout=parallel.layout,
        kernel=parallel.attention_kernel,
        device=device,
        dtype=precision.param,
    )
    # as torchtitan: experts placed before the pipeline cuts the model and FSDP shards what each rank holds
    experts_mesh = mesh.experts_mesh() if parallel.ep > 1 else None
    if experts_modules(model):
        ep_mesh = None if experts_mesh is None else experts_mesh["ep"]
        apply_expert_parallel(model, ep_mesh, expert_kernel(device, precision.param))
    if parallel.pp > 1:
        stages = apply_pipeline(
            model,
            mesh.sub_mesh("pp"),
            prepared.stage_layers,
            schedule=parallel.pp_schedule,
            stages_per_rank=parallel.pp_stages_per_rank,
        )
        parts: list[nn.Module] = list(stages)
    else:
        stages, parts = [], [model]
    for part in parts:
        apply_chunked_mlp(part.model.layers, parallel.mlp_chunk_tokens)
        if training:
            apply_activation_checkpointing(
                part.model.layers,
                parallel.activation_checkpointing,
                parallel.ac_every,
                offload=parallel.activation_offload,
            )
        apply_fsdp(
            part,
            mesh.sub_mesh("dp_cp"),
            param_dtype=precision.param,
            reduce_dtype=precision.reduce,
            # a training pipeline keeps its stages gathered over the step's micro-batches; a frozen model (a reference)
            # runs forward only, each layer gathered for its own forward
            reshard_after_forward=parallel.pp == 1 or not training,
            cpu_offload=parallel.cpu_offload,
            experts_mesh=None if experts_mesh is None else experts_mesh["efsdp"],
        )
        materialize(part, weights, device, params_device=torch.device("cpu") if parallel.cpu_offload else None)
        part.train(training)
    hidden_states = None if stages else FinalHiddenStates(model)
    totals = None
    routers = prepared.routers
    if training and routers is not None:  # the routers' statistics of each row (lctrain.train.router_loss)
        for stage in stages:  # passed along by the stages, beside the hidden states
            stage.carry = RouterTotals(stage, routers.layers, routers.num_experts, device, start=stage)
        totals = None if stages else RouterTotals(model, routers.layers, routers.num_experts, device)
    return BuiltModel(merge_stages(stages) if stages else model, stages, num_params, hidden_states, totals)


@dataclass
class Job:
    """What every command builds first, in dependency order (module docstring)."""

    cfg: JobConfig
    prepared: PreparedModel
    device: torch.device
    precision: Precision
    mesh: JobMesh
    model: BuiltModel
    # training with pipeline stages: the schedule of a step's rows (``cfg.step_rows`` micro-batches)
    schedule: Schedule | None
    # training a preference objective with prepared.reference: its frozen reference model, built like the model (the
    # same attention, mesh, stages, sharding and cpu_offload) without LoRA, in eval mode, without gradients
    reference: BuiltModel | None


def build_job(cfg: JobConfig, *, training: bool) -> Job:
    """The job of ``cfg`` on an initialized default process group, in the order of the module docstring:
    ``training=False`` builds the model without activation checkpointing, in eval mode, and nothing else."""
    prepared = prepare_model(cfg, dist.get_world_size())
    device = resolve_device(cfg.train.device)
    precision = Precision.resolve(cfg.parallel, device)
    mesh = JobMesh.build(cfg.parallel.dims(), device.type)
    torch.manual_seed(cfg.train.seed)
    model = build_model(
        prepared,
        prepared.source,
        mesh,
        device,
        precision,
        parallel=cfg.parallel,
        lora=cfg.model.lora,
        training=training,
    )
    schedule = reference = None
    if training and model.stages:
        schedule = build_schedule(
            model.stages,
            mesh.sub_mesh("pp"),
            schedule=cfg.parallel.pp_schedule,
            microbatches=cfg.step_rows,
            device=device,
            training=True,
        )
    if training and prepared.reference is not None:
        reference = build_model(
            prepared,
            prepared.reference,
            mesh,
            device,
            precision,
            parallel=cfg.parallel,
            lora=LoraConfig(),
            training=False,
        )
        reference.model.requires_grad_(False)
    return Job(cfg, prepared, device, precision, mesh, model, schedule, reference)
