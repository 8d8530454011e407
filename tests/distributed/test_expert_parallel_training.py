"""Expert parallelism in the trainer: a mixture of experts with its experts spread over ``parallel.ep`` ranks trains
exactly like the plain single-process transformers model, resumes exactly from a checkpoint, and exports every
expert.

One spawned gloo group of 4 ranks runs (``STEPS`` steps, the tiny fp32 model of
``tests/helpers/reference_training.py`` with 4 experts, top 2, ``model.router_aux_loss_coef`` 0.1):

- ``qwen3_moe`` on dp 2 × ring 2 with ``parallel.ep=2`` (two EP groups, each expert FSDP-sharded over the 2 ranks
  holding it), ``grad_accum`` 2, full activation checkpointing (the all-to-alls run again in the backward);
- ``mixtral`` on ring 2 × Ulysses 2 with ``parallel.ep=4`` (one expert per rank: a row's tokens reach every rank),
  the chunked MLP (8 tokens a chunk, each chunk's all-to-alls recomputed in the backward), then its export;
- the hybrids (4 layers: three gated delta layers, then a gated full-attention layer; a shared expert beside the
  routed ones): ``qwen3_next`` on dp 2 × ring 2 with ``parallel.ep=2``, ``qwen3_5_moe_text`` on ring 2 × Ulysses 2
  with ``parallel.ep=4`` (the gated delta layers' summaries all-gathered over the ring while the experts' tokens
  travel over the EP group);
- the first case stopped after 2 steps (a checkpoint at step 2) and resumed to ``STEPS``.

The reference and tolerances are ``test_moe_parity.py``'s: first step's loss within 1e-5 relative and every
gradient (the experts' gathered whole) within 1e-5 absolute + 1e-4 relative; every step's loss within 1e-5 relative
and pre-clipping gradient norm within 1e-3 relative; the resumed steps equal the uninterrupted run's exactly. The
export holds all 4 experts of every layer and loads in transformers.
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

STEPS = 4
COEF = 0.1
EXPERTS = ("model.num_experts=4", "model.experts_per_token=2", f"model.router_aux_loss_coef={COEF}")
# case -> (model overrides, parallel overrides, batch_size, grad_accum, dp)
CASES = {
    "qwen3_moe-dp2-ring2-ep2": (
        ("model.family=qwen3_moe",),
        ("parallel.dp=2", "parallel.ring=2", "parallel.ep=2", "parallel.activation_checkpointing=full"),
        1,
        2,
        2,
    ),
    "mixtral-ring2-ulysses2-ep4": (
        ("model.family=mixtral",),
        ("parallel.ring=2", "parallel.ulysses=2", "parallel.ep=4", "parallel.mlp_chunk_tokens=8"),
        1,
        1,
        1,
    ),
    "qwen3_next-dp2-ring2-ep2": (
        ("model.family=qwen3_next", "model.num_layers=4"),
        ("parallel.dp=2", "parallel.ring=2", "parallel.ep=2"),
        1,
        1,
        2,
    ),
    "qwen3_5_moe_text-ring2-ulysses2-ep4": (
        ("model.family=qwen3_5_moe_text", "model.num_layers=4"),
        ("parallel.ring=2", "parallel.ulysses=2", "parallel.ep=4"),
        1,
        1,
        1,
    ),
}
RESUMED, EXPORTED = "qwen3_moe-dp2-ring2-ep2", "mixtral-ring2-ulysses2-ep4"


def job(workdir: str, case: str, *, run: str | None = None, steps: int = STEPS) -> JobConfig:
    model, parallel, batch_size, grad_accum, _ = CASES[case]
    cfg = job_config(
        workdir,
        f"{workdir}/run_{run or case}",
        steps=steps,
        batch_size=batch_size,
        grad_accum=grad_accum,
        parallel=parallel,
        model=(*EXPERTS, *model),
    )
    cfg.checkpoint.export_hf = case == EXPORTED and run is None
    return cfg


@functools.cache
def results_for(workdir: str) -> dict:
    return run_distributed(cases_then_resumed, 4, case_configs(job, workdir, CASES, RESUMED))[0]


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_step_and_curve_match_single_process_model(case: str, parity_workdir: str) -> None:
    model, _, batch_size, grad_accum, dp = CASES[case]
    expected = reference(
        parity_workdir, steps=STEPS, dp=dp, batch_size=batch_size, grad_accum=grad_accum, model=(*EXPERTS, *model)
    )
    result = results_for(parity_workdir)[case]
    assert_first_step_matches(result, expected)
    assert_curve_matches(result, expected, STEPS)


def test_expert_parallel_resumes_exactly(parity_workdir: str) -> None:
    results = results_for(parity_workdir)
    (losses, norms, _), (full_losses, full_norms, _) = results["resumed"], results[RESUMED]
    assert losses == full_losses[2:] and norms == full_norms[2:]


def test_expert_parallel_export_holds_every_expert(parity_workdir: str) -> None:
    from transformers import AutoModelForCausalLM

    results_for(parity_workdir)
    model = AutoModelForCausalLM.from_pretrained(f"{parity_workdir}/run_{EXPORTED}/hf")
    for layer in model.model.layers:
        assert layer.mlp.experts.gate_up_proj.shape[0] == layer.mlp.experts.down_proj.shape[0] == 4
        assert len({tuple(expert.flatten()[:4].tolist()) for expert in layer.mlp.experts.gate_up_proj}) == 4
