"""Pipeline parallelism (``parallel.pp`` > 1, every schedule) composed with FSDP and USP attention trains exactly
like the plain single-process Hugging Face model.

Each case builds a ``Trainer`` on a spawned gloo group for one (pp, dp, ring, ulysses) mesh and schedule and runs
``train()`` for ``STEPS`` steps; the first step's full gradients of every stage are captured before its optimizer
step. The reference (``reference_training.py``) is the plain model over the same rows, with the same init, AdamW,
schedule and clipping. The model has 2 layers per pipeline rank (so with 2 stages per rank each stage still has
one layer). A step has as many rows (pipeline micro-batches) as pipeline ranks, 1 × 2 for pp=2 and 2 × 2 for pp=4
(data.batch_size × train.grad_accum), the fewest 1F1B allows; DualPipeV needs one per stage, 2 × 2. The model is
a random-init Llama, except in two cases: a Mistral with a sliding window of 5 on every layer (ring 2), and a Qwen3
checkpoint (q/k norms) loaded with ``model.path``, layer 0 full and layers 1-3 windowed (``max_window_layers=1``;
Ulysses 2, one layer per stage), so per-layer windows go through the replayed decoder loop (without the windows
the first-step loss moves by 1e-3 relative).
Tolerances (fp32), as for the pp=1 parity test:

- first step: loss within 1e-5 relative; every parameter's full gradient within 1e-5 absolute + 1e-4 relative;
- ``STEPS`` steps: every loss within 1e-5 relative, every pre-clipping gradient norm (over all stages) within 1e-3
  relative (torch's fp32 norm kernel differs between full tensors and shards by up to ~2e-4).

Observed on CPU (torch 2.13, every case): first-step losses within 1.6e-7 relative and gradients within 5.2e-8
absolute; over 4 steps (the optimizer's moments carried from step to step, clipping acting), losses within 1.6e-7
relative and gradient norms within 3.1e-5 relative.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lctrain.config import JobConfig
from lctrain.data import load_tokenizer
from lctrain.families import layer_windows
from lctrain.testing import run_distributed
from tests.helpers.reference_training import (
    assert_curve_matches,
    assert_first_step_matches,
    job_config,
    reference,
    world_job,
)

STEPS = 4
MESHES = [(2, 1, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (2, 2, 1, 1), (2, 1, 2, 2), (4, 1, 2, 1)]  # (pp, dp, ring, ulysses)
CORE_SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)]  # (schedule, stages per rank)
AC_MODES = ["none", "full", "selective"]
# the model of a case: model.* overrides (random init Llama unless named); QWEN3_CHECKPOINT is replaced by the path
# of a small Qwen3 checkpoint written into the work directory (qwen3_checkpoint)
QWEN3_CHECKPOINT = "<qwen3 checkpoint>"
MODELS = {
    "llama": (),
    "mistral_window": ("model.family=mistral", "model.sliding_window=5"),  # a window of 5 on every layer
    "qwen3_window": ("model=hf", f"model.path={QWEN3_CHECKPOINT}"),  # q/k norms; layer 0 full, layers 1-3 windowed
}
# (pp, dp, ring, ulysses, schedule, stages_per_rank, activation checkpointing, split points, model)
Case = tuple[int, int, int, int, str, int, str, tuple[str, ...], str]
CASES: list[Case] = [
    (*mesh, schedule, stages, AC_MODES[(i + j) % 3], (), "llama")
    for i, mesh in enumerate(MESHES)
    for j, (schedule, stages) in enumerate(CORE_SCHEDULES)
] + [
    # the other schedules torch provides, once each, and named (unbalanced) split points
    (2, 1, 1, 1, "LoopedBFS", 2, "none", (), "llama"),
    (2, 1, 2, 1, "InterleavedZeroBubble", 2, "full", (), "llama"),
    (2, 2, 1, 1, "ZBVZeroBubble", 2, "none", (), "llama"),
    (2, 1, 1, 2, "DualPipeV", 2, "selective", (), "llama"),
    (2, 1, 1, 1, "1F1B", 1, "none", ("model.layers.1",), "llama"),
    # other families: per-layer sliding windows and Qwen3's attention through the replayed decoder loop
    (2, 1, 2, 1, "1F1B", 1, "full", (), "mistral_window"),
    (2, 1, 1, 2, "Interleaved1F1B", 2, "none", (), "qwen3_window"),
]
WINDOW = 5


def world(case: Case) -> int:
    pp, dp, ring, ulysses = case[:4]
    return pp * dp * ring * ulysses


def num_layers(case: Case) -> int:
    return 2 * case[0]


def batch_size_and_grad_accum(case: Case) -> tuple[int, int]:
    microbatches = case[0] * (2 if case[4] == "DualPipeV" else 1)
    return microbatches // 2, 2


def qwen3_checkpoint(workdir: str) -> str:
    """A Qwen3 checkpoint of the parity sizes (4 layers, head_dim 16), written once into ``workdir``: seeded random
    weights, the embedded tokenizer, and a sliding window of 5 on layers 1-3 (``max_window_layers=1``)."""
    path = Path(workdir) / "qwen3_window"
    if not (path / "config.json").is_file():
        tokenizer = load_tokenizer(None)
        config = AutoConfig.for_model(
            "qwen3",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=len(tokenizer),
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
        assert layer_windows(config) == [None, WINDOW, WINDOW, WINDOW]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def model_overrides(case: Case, workdir: str) -> tuple[str, ...]:
    overrides = MODELS[case[8]]
    if any(QWEN3_CHECKPOINT in item for item in overrides):
        return tuple(item.replace(QWEN3_CHECKPOINT, qwen3_checkpoint(workdir)) for item in overrides)
    return overrides


def job(case: Case, workdir: str) -> JobConfig:
    pp, dp, ring, ulysses, schedule, stages, ac, split_points, _ = case
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
        model=model_overrides(case, workdir),
    )


def case_id(case: Case) -> str:
    pp, dp, ring, ulysses, schedule, stages, ac, split_points, model = case
    split = f"-split{'_'.join(p.rsplit('.', 1)[1] for p in split_points)}" if split_points else ""
    family = "" if model == "llama" else f"-{model}"
    return f"pp{pp}-dp{dp}-ring{ring}-ulysses{ulysses}-{schedule}-v{stages}-ac_{ac}{split}{family}"


@functools.cache
def results_for(world_size: int, workdir: str) -> dict[Case, tuple]:
    configs = {case: job(case, workdir) for case in CASES if world(case) == world_size}
    return run_distributed(world_job, world_size, configs)[0]


def reference_for(case: Case, workdir: str) -> tuple[list[float], list[float], dict]:
    batch_size, grad_accum = batch_size_and_grad_accum(case)
    return reference(
        workdir,
        steps=STEPS,
        dp=case[1],
        batch_size=batch_size,
        grad_accum=grad_accum,
        num_layers=num_layers(case),
        model=model_overrides(case, workdir),
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_first_step_matches_single_process_model(case: Case, parity_workdir: str) -> None:
    assert_first_step_matches(results_for(world(case), parity_workdir)[case], reference_for(case, parity_workdir))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_curve_matches_single_process_model(case: Case, parity_workdir: str) -> None:
    assert_curve_matches(results_for(world(case), parity_workdir)[case], reference_for(case, parity_workdir), STEPS)
