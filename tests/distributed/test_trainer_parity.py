"""The ``Trainer`` (USP attention, activation checkpointing, FSDP2 over dp × ring × ulysses, chunked loss) trains
exactly like the plain single-process Hugging Face model.

Each case builds a ``Trainer`` on a spawned gloo group for one (dp, ring, ulysses) mesh and runs ``train()`` for
``STEPS`` steps (the first step's full gradients are captured just before its optimizer step). The reference, in
the pytest process, is the plain model over the same rows (``reference_training.py``: every document piece as a
sequence of its own, same init, AdamW, schedule and clipping); the data has rows of several documents and
documents continued across rows, and the reference asserts both. Tolerances (fp32):

- first step, before the optimizer step: loss within 1e-5 relative; every parameter's full gradient within
  1e-5 absolute + 1e-4 relative;
- ``STEPS`` steps: every step's loss within 1e-5 relative; every step's pre-clipping gradient norm within 1e-3
  relative. The norm is looser because torch's fp32 norm kernel on CPU is itself off by up to ~2e-4 relative on
  the LM head's gradient (large, with mostly tiny entries), differently for the full tensor (reference) and for
  the shards (trainer); the trainer's norm was the closer one to the exact (float64) norm where checked.

Observed on CPU (torch 2.13, 1 thread per process): first-step losses within 1.1e-7 relative and gradients within
3e-8 absolute (at most 0.2 % of the tolerance); over 20 steps, losses within 4e-7 relative and gradient norms
within 8e-5 relative.
"""

from __future__ import annotations

import functools

import pytest

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from tests.helpers.reference_training import (
    assert_curve_matches,
    assert_first_step_matches,
    job_config,
    reference,
    world_job,
)

STEPS = 20
# (world, dp, ring, ulysses, batch_size, grad_accum, activation_checkpointing, layout)
CASES = [
    (2, 1, 2, 1, 2, 2, "full", "zigzag"),
    (2, 1, 1, 2, 1, 1, "none", "zigzag"),
    (4, 1, 2, 2, 1, 2, "selective", "zigzag"),
    (4, 2, 2, 1, 2, 1, "none", "contiguous"),
    (4, 2, 1, 2, 1, 2, "full", "zigzag"),
    (8, 1, 4, 2, 1, 1, "selective", "zigzag"),
    (8, 2, 2, 2, 1, 1, "full", "zigzag"),
]
Case = tuple[int, int, int, int, int, int, str, str]


def job(case: Case, workdir: str) -> JobConfig:
    _, dp, ring, ulysses, batch_size, grad_accum, ac, layout = case
    return job_config(
        workdir,
        f"{workdir}/run_{'_'.join(map(str, case))}",
        steps=STEPS,
        batch_size=batch_size,
        grad_accum=grad_accum,
        parallel=[
            f"parallel.dp={dp}",
            f"parallel.ring={ring}",
            f"parallel.ulysses={ulysses}",
            f"parallel.layout={layout}",
            f"parallel.activation_checkpointing={ac}",
        ],
    )


@functools.cache
def results_for(world: int, workdir: str) -> dict[Case, tuple]:
    configs = {case: job(case, workdir) for case in CASES if case[0] == world}
    return run_distributed(world_job, world, configs)[0]


def reference_for(case: Case, workdir: str) -> tuple[list[float], list[float], dict]:
    _, dp, _, _, batch_size, grad_accum, _, _ = case
    return reference(workdir, steps=STEPS, dp=dp, batch_size=batch_size, grad_accum=grad_accum)


def case_id(case: Case) -> str:
    world, dp, ring, ulysses, batch_size, grad_accum, ac, layout = case
    return f"dp{dp}-ring{ring}-ulysses{ulysses}-bs{batch_size}-ga{grad_accum}-ac_{ac}-{layout}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_first_step_matches_single_process_model(case: Case, parity_workdir: str) -> None:
    assert_first_step_matches(results_for(case[0], parity_workdir)[case], reference_for(case, parity_workdir))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_curve_matches_single_process_model(case: Case, parity_workdir: str) -> None:
    assert_curve_matches(results_for(case[0], parity_workdir)[case], reference_for(case, parity_workdir), STEPS)
