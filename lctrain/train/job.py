"""A training job built once, in one straight line: what ``lctrain.build.build_job`` builds for every command (the
device, the dtypes, the prepared model, the mesh and its groups, the model on it), then the training parts, each from
its own config section and what was built before it:

    the data (this rank's rows; the validation rows) -> the model's forward (the whole model's final hidden states,
    or the pipeline's training schedule) -> the objective (with its reference model, the router's load-balancing
    loss of a mixture of experts, the precomputed reference log-probs) -> the optimizer and its schedule -> the
    checkpoints -> the ruler suite (ruler.every) -> the step meter (FLOPs, time, memory)

``Trainer`` (``lctrain.train.trainer``) receives the ``TrainingJob`` and only runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lctrain.build import Job, build_job, tokenizer_path
from lctrain.checkpoint import Checkpointer
from lctrain.config import JobConfig
from lctrain.data import DataConfig, PackedLoader
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.train.forward import Batch, Schedule, forward_only, pipeline_schedule
from lctrain.train.meter import StepMeter, model_flops_per_token, peak_flops
from lctrain.train.objective import Objective, build_objective
from lctrain.train.optim import build_optimizer, build_scheduler
from lctrain.train.preference import PreferenceLoss
from lctrain.train.reference import ReferenceCache, build_reference
from lctrain.train.router_loss import with_router_loss
from lctrain.train.ruler_suite import TrainingSuite, training_suite
from lctrain.train.validate import Validator


@dataclass
class TrainingJob:
    """Everything a training run needs, built by ``build_training_job``."""

    base: Job
    loader: PackedLoader  # this rank's micro-batches
    validator: Validator
    hidden_states: FinalHiddenStates | None  # the whole model's forward; None with pipeline stages
    schedule: Schedule | None  # the pipeline's training schedule; None without stages
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpointer: Checkpointer
    meter: StepMeter  # each step's time, tokens/s, MFU and peak memory
    suite: TrainingSuite | None  # the ruler suite every ruler.every steps; None when never


def build_training_job(cfg: JobConfig) -> TrainingJob:
    """The job of ``cfg`` (one stage of ``train.stages``) on an initialized default process group, in the order of
    the module docstring."""
    job = build_job(cfg, training=True)
    mesh, device, model = job.mesh, job.device, job.model
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer_path(cfg))
    loader = PackedLoader(data, dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp, place=mesh.place)
    validator = Validator(
        data, cfg.train, place=mesh.place, dp_rank=mesh.dp_rank, dp=mesh.dims.dp, group=mesh.dp_cp, device=device
    )

    rows = cfg.data.batch_size * cfg.train.grad_accum  # a step's rows: with a pipeline, its micro-batches
    hidden_states = model.hidden_states
    schedule = None
    if model.stages:
        schedule = pipeline_schedule(model, job, rows, training=True)

    # one forward-only run of the policy, shared by the LoRA reference and the router's global counts
    policy_forward = functools.cache(lambda: forward_only(model, job, rows))
    objective = build_objective(
        cfg.objective,
        loader.names,
        mesh=mesh,
        device=device,
        chunk_tokens=cfg.train.loss_chunk_tokens,
        reference=build_reference(
            cfg.objective, job, policy_forward, functools.partial(forward_only, job=job, rows=rows)
        ),
        last_stage=not model.stages or model.stages[-1].last,
    )
    if cfg.objective.precompute_reference and isinstance(objective, PreferenceLoss) and objective.reference is not None:
        _precomputed_reference(objective, cfg, mesh.dp_rank, _run_steps(data, job, validator))
    # a mixture of experts adds its routers' load-balancing loss (its statistics over each row's cp ranks, or over
    # the step's rows from a forward-only run of them first: train.router_aux_scope)
    global_scope = cfg.train.router_aux_scope == "global"
    objective = with_router_loss(
        objective,
        job.prepared.routers,
        model.router_totals,
        group=mesh.dp_cp,
        cp_group=mesh.cp,
        scope=cfg.train.router_aux_scope,
        forward=policy_forward() if global_scope else None,
    )
    optimizer = build_optimizer(model.model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    checkpointer = Checkpointer(Path(cfg.train.run_dir) / "checkpoints", keep=cfg.checkpoint.keep)
    suite = training_suite(job)
    peak = peak_flops(device, cfg.train.peak_tflops)
    meter = StepMeter(
        device,
        tokens=cfg.data.seq_len * rows * mesh.dims.dp,
        per_token=model_flops_per_token(job.prepared.config, model.num_params, cfg.data.seq_len),
        peak=peak,
        devices=mesh.dims.world_size,
    )
    return TrainingJob(
        job, loader, validator, hidden_states, schedule, objective, optimizer, scheduler, checkpointer, meter, suite
    )


def _run_steps(data: DataConfig, job: Job, validator: Validator) -> Iterator[Sequence[Batch]]:
    """This rank's micro-batches of every step of the run, from the start (a loader of its own), then the validation
    rows one at a time: what a precomputed reference covers."""
    cfg, mesh = job.cfg, job.mesh
    loader = iter(PackedLoader(data, dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp, place=mesh.place))
    steps = ([next(loader) for _ in range(cfg.train.grad_accum)] for _ in range(cfg.train.steps))
    return itertools.chain(steps, ([row] for row in validator.rows))


def _precomputed_reference(objective: Objective, cfg: JobConfig, dp_rank: int, steps: Iterator) -> None:
    """``objective.precompute_reference``: the reference's log-probs of ``steps`` from
    ``<run_dir>/reference_logps/dp<rank>.pt``, computed and saved there first when it is not there yet."""
    path = Path(cfg.train.run_dir) / "reference_logps" / f"dp{dp_rank}.pt"
    source = cfg.objective.reference_path or cfg.model.path or f"the random init of seed {cfg.train.seed}"
    identity = f"objective.reference={cfg.objective.reference} ({source})"
    cache = ReferenceCache.load(path, identity)
    if cache is None:
        objective.precompute_reference(steps, ReferenceCache(path, identity))
    else:
        objective.use_cache(cache)
