"""Pipeline parallelism (``parallel.pp`` > 1, every schedule) composed with FSDP and USP attention trains exactly
like the plain single-process Hugging Face model.

Each case builds a ``Trainer`` on a spawned gloo group for one (pp, dp, ring, ulysses) mesh and schedule and runs
``train()`` for ``STEPS`` steps; the first step's full gradients of every stage are captured before its optimizer
step. The reference (``reference_training.py``) is the plain model over the same rows, with the same init, AdamW,
schedule and clipping. The model has 2 layers per pipeline rank (so with 2 stages per rank each stage still has
one layer). A step has as many rows (pipeline micro-batches) as pipeline ranks, 1 × 2 for pp=2 and 2 × 2 for pp=4
(data.batch_size × train.grad_accum), the fewest 1F1B allows; DualPipeV needs one per stage, 2 × 2.
Tolerances (fp32), as for the pp=1 parity test:

- first step: loss within 1e-5 relative; every parameter's full gradient within 1e-5 absolute + 1e-4 relative;
- ``STEPS`` steps: every loss within 1e-5 relative, every pre-clipping gradient norm (over all stages) within 1e-3
  relative (torch's fp32 norm kernel differs between full tensors and shards by up to ~2e-4).

Observed on CPU (torch 2.13, all 23 cases): first-step losses within 1.1e-7 relative and gradients within 4.8e-8
absolute; over 10 steps, losses within 2.3e-7 relative and gradient norms within 7e-5 relative.
"""

from __future__ import annotations

import functools

import pytest

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from tests.distributed.reference_training import (
    assert_curve_matches,
    assert_first_step_matches,
    job_config,
    reference,
    world_job,
)

STEPS = 10
MESHES = [(2, 1, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (2, 2, 1, 1), (2, 1, 2, 2), (4, 1, 2, 1)]  # (pp, dp, ring, ulysses)
CORE_SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)]  # (schedule, stages per rank)
AC_MODES = ["none", "full", "selective"]
# (pp, dp, ring, ulysses, schedule, stages_per_rank, activation checkpointing, split points)
Case = tuple[int, int, int, int, str, int, str, tuple[str, ...]]
CASES: list[Case] = [
    (*mesh, schedule, stages, AC_MODES[(i + j) % 3], ())
    for i, mesh in enumerate(MESHES)
    for j, (schedule, stages) in enumerate(CORE_SCHEDULES)
] + [
    # the other schedules torch provides, once each, and named (unbalanced) split points
    (2, 1, 1, 1, "LoopedBFS", 2, "none", ()),
    (2, 1, 2, 1, "InterleavedZeroBubble", 2, "full", ()),
    (2, 2, 1, 1, "ZBVZeroBubble", 2, "none", ()),
    (2, 1, 1, 2, "DualPipeV", 2, "selective", ()),
    (2, 1, 1, 1, "1F1B", 1, "none", ("model.layers.1",)),
]


def world(case: Case) -> int:
    pp, dp, ring, ulysses = case[:4]
    return pp * dp * ring * ulysses


def num_layers(case: Case) -> int:
    return 2 * case[0]


def batch_size_and_grad_accum(case: Case) -> tuple[int, int]:
    microbatches = case[0] * (2 if case[4] == "DualPipeV" else 1)
    return microbatches // 2, 2


def job(case: Case, workdir: str) -> JobConfig:
    pp, dp, ring, ulysses, schedule, stages, ac, split_points = case
    batch_size, grad_accum = batch_size_and_grad_accum(case)
    return job_config(
        workdir,
        f"{workdir}/run_{case_id(case)}",
        steps=STEPS,
        num_layers=num_layers(case),
        batch_size=batch_size,
        grad_accum=grad_accum,
        parallel=[
            f"parallel.pp={pp}",
            f"parallel.dp={dp}",
            f"parallel.ring={ring}",
            f"parallel.ulysses={ulysses}",
            f"parallel.pp_schedule={schedule}",
            f"parallel.pp_stages_per_rank={stages}",
            f"parallel.pp_split_points=[{','.join(split_points)}]",
            f"parallel.activation_checkpointing={ac}",
        ],
    )


def case_id(case: Case) -> str:
    pp, dp, ring, ulysses, schedule, stages, ac, split_points = case
    split = f"-split{'_'.join(p.rsplit('.', 1)[1] for p in split_points)}" if split_points else ""
    return f"pp{pp}-dp{dp}-ring{ring}-ulysses{ulysses}-{schedule}-v{stages}-ac_{ac}{split}"


@functools.cache
def results_for(world_size: int, workdir: str) -> dict[Case, tuple]:
    configs = {case: job(case, workdir) for case in CASES if world(case) == world_size}
    return run_distributed(world_job, world_size, configs)[0]


def reference_for(case: Case, workdir: str) -> tuple[list[float], list[float], dict]:
    batch_size, grad_accum = batch_size_and_grad_accum(case)
    return reference(
        workdir, steps=STEPS, dp=case[1], batch_size=batch_size, grad_accum=grad_accum, num_layers=num_layers(case)
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_first_step_matches_single_process_model(case: Case, parity_workdir: str) -> None:
    assert_first_step_matches(results_for(world(case), parity_workdir)[case], reference_for(case, parity_workdir))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_curve_matches_single_process_model(case: Case, parity_workdir: str) -> None:
    assert_curve_matches(results_for(world(case), parity_workdir)[case], reference_for(case, parity_workdir), STEPS)
