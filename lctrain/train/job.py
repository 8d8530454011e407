"""A training job built once, in one straight line: what ``lctrain.build.build_job`` builds for every command (the
device, the dtypes, the prepared model, the mesh and its groups, the model on it; when training, the pipeline's
training schedule and the frozen reference model), the model's FLOPs per token, then the training parts, each from
its own config section and what was built before it:

    the data (this rank's rows; the validation rows) -> the objective (with its reference's forward, the router's
    load-balancing loss of a mixture of experts, the precomputed reference log-probs) -> the optimizer and its
    schedule -> the checkpoints -> the step meter (time, tokens/s, MFU, memory) -> the ruler suite (ruler.every)

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
from lctrain.families import model_flops_per_token
from lctrain.train.forward import Batch, forward_only
from lctrain.train.meter import StepMeter, peak_flops
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
    per_token = model_flops_per_token(job.prepared.config, model.num_params, cfg.data.seq_len)
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer_path(cfg))
    loader = PackedLoader(data, dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp, place=mesh.place)
    validator = Validator(
        data, cfg.train, place=mesh.place, dp_rank=mesh.dp_rank, dp=mesh.dims.dp, group=mesh.dp_cp, device=device
    )

    rows = cfg.step_rows  # with a pipeline, the step's micro-batches
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
        job.reference = None  # the log-probs replace the reference model: its memory goes with it
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
    peak = peak_flops(device, cfg.train.peak_tflops)
    tokens = cfg.data.seq_len * rows * mesh.dims.dp
    meter = StepMeter(device, tokens=tokens, per_token=per_token, peak=peak, devices=mesh.dims.world_size)
    suite = training_suite(job)
    return TrainingJob(job, loader, validator, objective, optimizer, scheduler, checkpointer, meter, suite)


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
