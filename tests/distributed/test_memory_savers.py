"""The memory savers in the ``Trainer`` train like the plain single-process Hugging Face model: chunked MLP +
activation offload + activation checkpointing on a spawned gloo group, first step's loss and full gradients against
``reference_training.py``'s reference, with the tolerances of ``test_trainer_parity.py`` (loss 1e-5 relative,
gradients 1e-5 absolute + 1e-4 relative), and the losses and gradient norms of the next steps (1e-5 and 1e-3
relative).

The cases run on one world-2 group, one after the other: ring 2, Ulysses 2, and pipeline parallelism (pp 2, the
savers applied to each stage's layers); and FSDP2's CPU offload (``parallel.cpu_offload``) with ring 2 and with
pp 2 (GPipe). The MLP chunks do not divide the local sequence (64 tokens over 2 ranks = 32 per rank: chunks of 12,
12, 8; or 7; pp 2: 64 tokens, chunks of 12 … 4). On CPU the offload hooks keep the
tensors where they are (``lctrain/parallel/activation_checkpointing.py``), so what this checks is that the
wrappers compose with USP attention, FSDP2, pipeline stages and the chunked loss, not that memory moves. The same
holds for ``CPUOffloadPolicy`` on a CPU device: its code runs (host shards, gradients moved to them, the optimizer on
them, gloo), its device-memory saving only on a GPU.
"""

from __future__ import annotations

import functools

import pytest

from lctrain.testing import run_distributed
from tests.helpers.reference_training import (
    assert_curve_matches,
    assert_first_step_matches,
    job_config,
    reference,
    world_job,
)

WORLD = 2
STEPS = 3  # the reference needs a few steps' rows to see a document continued across rows
# name: (batch_size, grad_accum, num_layers, parallel overrides)
CASES = {
    "ring2-full-offload-mlp12": (
        1,
        1,
        2,
        ["parallel.ring=2", "parallel.activation_checkpointing=full", "parallel.activation_offload=true"],
    ),
    "ulysses2-selective-offload-mlp7-bs2-ga2": (
        2,
        2,
        2,
        [
            "parallel.ulysses=2",
            "parallel.activation_checkpointing=selective",
            "parallel.activation_offload=true",
            "parallel.mlp_chunk_tokens=7",
        ],
    ),
    # pipeline stages (stage.model.layers, a dict): 2 layers per stage, 2 × 2 rows = 4 micro-batches of 1F1B
    "pp2-1F1B-full-offload-mlp12-bs2-ga2": (
        2,
        2,
        4,
        ["parallel.pp=2", "parallel.activation_checkpointing=full", "parallel.activation_offload=true"],
    ),
    "ring2-cpu-offload-mlp12": (1, 1, 2, ["parallel.ring=2", "parallel.cpu_offload=true"]),
    "pp2-GPipe-cpu-offload-mlp12-bs2-ga2": (
        2,
        2,
        4,
        ["parallel.pp=2", "parallel.pp_schedule=GPipe", "parallel.cpu_offload=true"],
    ),
}


@functools.cache
def results(workdir: str) -> dict[str, tuple]:
    configs = {}
    for name, (batch_size, grad_accum, num_layers, parallel) in CASES.items():
        chunk = [] if any("mlp_chunk_tokens" in p for p in parallel) else ["parallel.mlp_chunk_tokens=12"]
        configs[name] = job_config(
            workdir,
            f"{workdir}/run_{name}",
            steps=STEPS,
            num_layers=num_layers,
            batch_size=batch_size,
            grad_accum=grad_accum,
            parallel=[*parallel, *chunk],
        )
    return run_distributed(world_job, WORLD, configs)[0]


@pytest.mark.parametrize("name", list(CASES))
def test_memory_savers_match_single_process_model(name: str, parity_workdir: str) -> None:
    batch_size, grad_accum, num_layers, _ = CASES[name]
    expected = reference(
        parity_workdir, steps=STEPS, dp=1, batch_size=batch_size, grad_accum=grad_accum, num_layers=num_layers
    )
    result = results(parity_workdir)[name]
    assert_first_step_matches(result, expected)
    assert_curve_matches(result, expected, STEPS)
