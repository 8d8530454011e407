"""Mixtures of experts (``qwen3_moe``, ``mixtral``) train exactly like the plain single-process transformers model,
router load-balancing loss included, under context parallelism, data parallelism with accumulation, pipeline
stages and LoRA; a resumed run continues exactly.

One spawned gloo group of 4 ranks runs every case (``STEPS`` steps, the tiny fp32 model of
``tests/helpers/reference_training.py`` with 4 experts, top 2, ``model.router_aux_loss_coef`` 0.1: large enough that
the auxiliary term's gradient shows in every router and expert weight):

- ``qwen3_moe`` on ring 2 × Ulysses 2, ``grad_accum`` 2, full activation checkpointing: each row's router statistics
  come from 4 ranks and the routers run again in the backward;
- ``mixtral`` on dp 2 × ring 2, 2 rows a micro-batch, ``grad_accum`` 2, selective checkpointing and the chunked MLP
  (8 tokens a chunk: each chunk calls the router, the chunks are recomputed in the backward);
- ``qwen3_moe`` on pp 2 × ring 2 (1F1B): each stage adds its layer's router statistics to the totals it passes on
  beside the hidden states, the last stage's loss pools them and its gradient reaches the first stage's router back
  through them;
- ``mixtral`` on pp 2 × dp 2 (GPipe), ``grad_accum`` 2, ``train.router_aux_scope=global``: the step's counts from a
  forward-only pipeline run of its rows first;
- ``qwen3_moe`` on dp 2 × ring 2, 2 rows a micro-batch, ``grad_accum`` 2, ``train.router_aux_scope=global``: one
  load-balancing loss over the step's 8 rows (counts from a no-grad forward of them first);
- ``mixtral`` with LoRA adapters on the attention projections, dp 2 × ring 2;
- the first case stopped after 2 steps (a checkpoint at step 2) and resumed to ``STEPS``.

The reference (``reference_training.py``): the LM loss of every document piece of the same rows plus ``coef`` times
the mean over the rows of transformers' ``load_balancing_loss_func`` on each whole row's router logits (global: the
function on all of the step's rows at once). Tolerances as
``test_trainer_parity.py``: first step's loss within 1e-5 relative and every gradient within 1e-5 absolute + 1e-4
relative; every step's loss within 1e-5 relative and pre-clipping gradient norm within 1e-3 relative. The step's
reported ``lm_loss + coef · aux_loss`` is its ``loss`` (1e-6 relative), each layer's expert load lies in
``[0, 1]`` with min ≤ 1/E ≤ max; the resumed steps' losses and norms equal the uninterrupted run's exactly.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

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

STEPS = 4
COEF = 0.1
EXPERTS = ("model.num_experts=4", "model.experts_per_token=2")
# case -> (model overrides, parallel overrides, batch_size, grad_accum, dp)
CASES = {
    "qwen3_moe-ring2-ulysses2": (
        ("model.family=qwen3_moe", f"model.router_aux_loss_coef={COEF}"),
        ("parallel.ring=2", "parallel.ulysses=2", "parallel.activation_checkpointing=full"),
        1,
        2,
        1,
    ),
    "mixtral-dp2-ring2-chunked": (
        ("model.family=mixtral", f"model.router_aux_loss_coef={COEF}"),
        (
            "parallel.dp=2",
            "parallel.ring=2",
            "parallel.activation_checkpointing=selective",
            "parallel.mlp_chunk_tokens=8",
        ),
        2,
        2,
        2,
    ),
    "qwen3_moe-pp2-ring2": (
        ("model.family=qwen3_moe", f"model.router_aux_loss_coef={COEF}"),
        ("parallel.pp=2", "parallel.ring=2"),
        1,
        2,
        1,
    ),
    "mixtral-pp2-dp2-global": (
        ("model.family=mixtral", f"model.router_aux_loss_coef={COEF}", "train.router_aux_scope=global"),
        ("parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=GPipe"),
        1,
        2,
        2,
    ),
    "qwen3_moe-dp2-ring2-global": (
        ("model.family=qwen3_moe", f"model.router_aux_loss_coef={COEF}", "train.router_aux_scope=global"),
        ("parallel.dp=2", "parallel.ring=2", "parallel.activation_checkpointing=full"),
        2,
        2,
        2,
    ),
    "mixtral-lora-dp2-ring2": (
        ("model.family=mixtral", f"model.router_aux_loss_coef={COEF}", "model.lora.rank=4"),
        ("parallel.dp=2", "parallel.ring=2"),
        1,
        1,
        2,
    ),
}
RESUMED = "qwen3_moe-ring2-ulysses2"


def job(workdir: str, case: str, *, run: str | None = None, steps: int = STEPS) -> JobConfig:
    model, parallel, batch_size, grad_accum, _ = CASES[case]
    return job_config(
        workdir,
        f"{workdir}/run_{run or case}",
        steps=steps,
        batch_size=batch_size,
        grad_accum=grad_accum,
        parallel=parallel,
        model=(*EXPERTS, *model),
    )


@functools.cache
def results_for(workdir: str) -> dict:
    """Every case, then the resumed run: 2 steps with a checkpoint, then on to ``STEPS`` from it (the configs made
    here, once)."""
    return run_distributed(cases_then_resumed, 4, case_configs(job, workdir, CASES, RESUMED))[0]


def reference_for(workdir: str, case: str) -> tuple:
    model, _, batch_size, grad_accum, dp = CASES[case]
    return reference(
        workdir, steps=STEPS, dp=dp, batch_size=batch_size, grad_accum=grad_accum, model=(*EXPERTS, *model)
    )


@pytest.mark.parametrize("case", list(CASES))
def test_moe_step_and_curve_match_single_process_model(case: str, parity_workdir: str) -> None:
    result, expected = results_for(parity_workdir)[case], reference_for(parity_workdir, case)
    assert_first_step_matches(result, expected)
    assert_curve_matches(result, expected, STEPS)


@pytest.mark.parametrize("case", list(CASES))
def test_lm_and_aux_losses_are_reported_apart_with_the_expert_load(case: str, parity_workdir: str) -> None:
    results_for(parity_workdir)
    records = Path(f"{parity_workdir}/run_{case}/metrics.jsonl").read_text().splitlines()
    for record in map(json.loads, records):
        if "loss" not in record:
            continue
        total = record["lm_loss"] + COEF * record["aux_loss"]
        assert abs(total - record["loss"]) <= 1e-6 * record["loss"], record
        for layer in range(2):
            low, high = record[f"expert_load_min/{layer}"], record[f"expert_load_max/{layer}"]
            assert 0 <= low <= 1 / 4 <= high <= 1, record


def test_resume_continues_exactly(parity_workdir: str) -> None:
    results = results_for(parity_workdir)
    (losses, norms, _), (full_losses, full_norms, _) = results["resumed"], results[RESUMED]
    assert losses == full_losses[2:] and norms == full_norms[2:]
