"""gpt-oss and Gemma 3 train exactly like the plain single-process transformers model in the parallel layouts the
published-checkpoint test (``test_published_checkpoints.py``: 1 process, ring 2 × Ulysses 2, expert parallelism)
does not cover. One spawned gloo group of 4 ranks runs every case (``STEPS`` steps, the tiny fp32 model of
``tests/helpers/reference_training.py``, random init):

- ``gemma3_text`` on pp 2 × ring 2 (1F1B, accumulation 2), 6 layers (five local, one global: transformers' own
  pattern), a window of 8 on the local layers, their RoPE base 10,000 and the global layer's 1,000,000 scaled
  linearly x8 (``model.rope_theta``, ``model.rope_scaling`` set the global layers'): each stage computes both
  rotary embeddings and gives each layer its own;
- ``gpt_oss`` on dp 2 × ring 2 with accumulation 2 and 2 rows a micro-batch, windows of 8 on every other layer,
  the router's load-balancing loss (coefficient 0.1): the sinks' gradient summed over the ring and dp ranks;
- ``gpt_oss`` on ring 4 with accumulation 2 (its documents crossing the pieces);
- ``gpt_oss`` with LoRA adapters (rank 4) on its attention projections and on its experts (peft's
  ``target_parameters``: ``experts.gate_up_proj``, ``experts.down_proj``, stored ``[E, in, out]``) on ring 2 ×
  Ulysses 2;
- the ``gpt_oss`` dp 2 × ring 2 case and the ``gemma3_text`` pipeline case each stopped after 2 steps (a
  checkpoint at step 2: the sharded weights, the optimizer's moments, each dp rank's loader position) and resumed
  to ``STEPS``.

Tolerances as ``test_trainer_parity.py``: first step's loss within 1e-5 relative and every gradient (the sinks'
included) within 1e-5 absolute + 1e-4 relative; every step's loss within 1e-5 relative and pre-clipping gradient
norm within 1e-3 relative; the resumed steps' losses and norms equal the uninterrupted run's exactly (tolerance
0: on CPU, fp32 and gloo, resuming is bitwise deterministic).
"""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from tests.helpers.reference_training import (
    GPT_OSS,
    assert_curve_matches,
    assert_first_step_matches,
    job_config,
    reference,
    resumed_case,
    resumed_configs,
    train_case,
)

STEPS = 4
GEMMA3 = (
    "model.family=gemma3_text",
    "model.sliding_window=8",
    "model.rope_theta=1000000",
    "model.rope_scaling.type=linear",
    "model.rope_scaling.factor=8",
)
# case -> (model overrides, parallel overrides, layers, batch_size, grad_accum, dp)
CASES = {
    "gemma3_text-pp2-ring2": (GEMMA3, ("parallel.pp=2", "parallel.ring=2"), 6, 1, 2, 1),
    "gpt_oss-dp2-ring2-accum": (GPT_OSS, ("parallel.dp=2", "parallel.ring=2"), 2, 2, 2, 2),
    "gpt_oss-ring4": (GPT_OSS, ("parallel.ring=4",), 2, 1, 2, 1),
    "gpt_oss-lora-ring2-ulysses2": (
        (*GPT_OSS, "model.lora.rank=4", "model.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]"),
        ("parallel.ring=2", "parallel.ulysses=2"),
        2,
        1,
        1,  # the adapters' gradient norm, averaged over fewer tokens, is large enough for clipping to act
        1,
    ),
}
RESUMED = ("gpt_oss-dp2-ring2-accum", "gemma3_text-pp2-ring2")


def job(workdir: str, case: str, *, run: str | None = None, steps: int = STEPS) -> JobConfig:
    model, parallel, layers, batch_size, grad_accum, _ = CASES[case]
    return job_config(
        workdir,
        f"{workdir}/run_{run or case}",
        steps=steps,
        num_layers=layers,
        batch_size=batch_size,
        grad_accum=grad_accum,
        parallel=parallel,
        model=model,
    )


def sink_window_world(configs: dict, resumed: dict) -> dict | None:
    """Every case, then each of ``RESUMED`` again as the run ``resumed_<case>``, stopped at step 2 and resumed."""
    results = {case: train_case(cfg) for case, cfg in configs.items()}
    results.update({name: resumed_case(pair) for name, pair in resumed.items()})
    return results if dist.get_rank() == 0 else None


@functools.cache
def results_for(workdir: str) -> dict:
    """The configs made here, once, and handed to the ranks."""
    configs = {case: job(workdir, case) for case in CASES}
    resumed = {f"resumed_{case}": resumed_configs(job, workdir, case, f"resumed_{case}") for case in RESUMED}
    return run_distributed(sink_window_world, 4, configs, resumed)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_step_and_curve_match_single_process_model(case: str, parity_workdir: str) -> None:
    model, _, layers, batch_size, grad_accum, dp = CASES[case]
    result = results_for(parity_workdir)[case]
    expected = reference(
        parity_workdir, steps=STEPS, dp=dp, batch_size=batch_size, grad_accum=grad_accum, num_layers=layers, model=model
    )
    assert_first_step_matches(result, expected)
    assert_curve_matches(result, expected, STEPS)


@pytest.mark.parametrize("case", RESUMED)
def test_resume_continues_exactly(case: str, parity_workdir: str) -> None:
    results = results_for(parity_workdir)
    (losses, norms, _), (full_losses, full_norms, _) = results[f"resumed_{case}"], results[case]
    assert losses == full_losses[2:] and norms == full_norms[2:]
