"""A hybrid linear-attention model (random-init ``qwen3_5_text``: three gated delta layers, then a gated
full-attention layer) trained by the ``Trainer`` on 4 ranks like the plain single-process model
(``reference_training.py``: each document piece run alone), in the settings the other parity tests leave out:
pipeline stages cutting between the two kinds of layer (pp 2 x ring 2, 1F1B, full activation checkpointing),
dp 2 x ring 2 with accumulation, and LoRA on the linear layers' projections on ring 2 x Ulysses 2; and the dp 2 x
ring 2 case stopped after 2 steps (a checkpoint at step 2: the linear layers' ``A_log``, ``dt_bias`` and convolution
FSDP-sharded with their AdamW states, each dp rank's loader position) and resumed to ``STEPS``.

One spawn of 4 ranks runs the three cases for ``STEPS`` steps, then the resumed run. Tolerances (fp32), the trainer
parity tests': first step loss within 1e-5 relative and every gradient within 1e-5 absolute + 1e-4 relative; every
loss within 1e-5 relative and every gradient norm within 1e-3 relative; the resumed steps' losses and gradient norms
equal the uninterrupted run's exactly (on CPU, fp32 and gloo, resuming is bitwise deterministic).
"""

from __future__ import annotations

import functools

import pytest

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from tests.helpers.reference_training import (
    assert_curve_matches,
    assert_first_step_matches,
    case_configs,
    cases_then_resumed,
    job_config,
    reference,
)

STEPS = 4  # past the resume at step 2; enough rows that most hold several documents (the reference checks it)
LAYERS = 4
HYBRID = ("model.family=qwen3_5_text",)
# case -> (parallel overrides, model overrides, dp, data.batch_size, train.grad_accum)
CASES = {
    "pp2-ring2-1F1B": (
        ("parallel.pp=2", "parallel.ring=2", "parallel.pp_schedule=1F1B", "parallel.activation_checkpointing=full"),
        HYBRID,
        1,
        1,
        2,
    ),
    "dp2-ring2-accum2": (("parallel.dp=2", "parallel.ring=2"), HYBRID, 2, 1, 2),
    "lora-ring2-ulysses2": (
        ("parallel.ring=2", "parallel.ulysses=2"),
        (*HYBRID, "model.lora.rank=4", "model.lora.alpha=32"),
        1,
        1,
        1,
    ),
}
RESUMED = "dp2-ring2-accum2"  # stopped at step 2 and resumed


def job(workdir: str, case: str, *, run: str | None = None, steps: int = STEPS) -> JobConfig:
    parallel, model, _, batch_size, grad_accum = CASES[case]
    return job_config(
        workdir,
        f"{workdir}/run_{run or case}",
        steps=steps,
        num_layers=LAYERS,
        batch_size=batch_size,
        grad_accum=grad_accum,
        parallel=parallel,
        model=model,
    )


@functools.cache
def results_for(workdir: str) -> dict:
    return run_distributed(cases_then_resumed, 4, case_configs(job, workdir, CASES, RESUMED))[0]


@pytest.mark.parametrize("case", CASES)
def test_hybrid_trains_like_the_single_process_model(case: str, parity_workdir: str) -> None:
    _, model, dp, batch_size, grad_accum = CASES[case]
    expected = reference(
        parity_workdir,
        steps=STEPS,
        dp=dp,
        batch_size=batch_size,
        grad_accum=grad_accum,
        num_layers=LAYERS,
        model=model,
    )
    result = results_for(parity_workdir)[case]
    assert_first_step_matches(result, expected)
    assert_curve_matches(result, expected, STEPS)


def test_hybrid_resume_continues_exactly(parity_workdir: str) -> None:
    results = results_for(parity_workdir)
    (losses, norms, _), (full_losses, full_norms, _) = results["resumed"], results[RESUMED]
    assert losses == full_losses[2:] and norms == full_norms[2:]
