"""Checkpoints as users have them train exactly: every family's tiny model made by transformers and written by its
default ``save_pretrained`` (the published layout: Qwen3-MoE's ``mlp.experts.N.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.N.w1.weight``, gpt-oss's fused experts with their biases; Qwen3-MoE's sharded over 3
files with an index), and the per-expert mixtures' checkpoints in transformers' fused layout
(``save_original_format=False``), given as ``model.path``. gpt-oss's sliding layers have a window of 8 tokens and
its attention sinks: their gradients are among those compared.

Cases (``STEPS`` steps each, the parity tests' corpus and settings, ``model.router_aux_loss_coef`` 0.1 on the
mixtures of experts): on one process, every mixture of experts in each of its layouts; on 4 processes, every family
on ring 2 × Ulysses 2, and every mixture of experts on dp 2 × ring 2 with expert parallelism (``parallel.ep=2``) from
each of its layouts (with accumulation 2). The reference is the
plain single-process model whose weights transformers' own ``from_pretrained`` read from the same directory
(``tests/helpers/reference_training.py``), over the same rows; the tolerances are trainer parity's: first step's
loss within 1e-5 relative and every gradient within 1e-5 absolute + 1e-4 relative, every step's loss within 1e-5
relative and pre-clipping gradient norm within 1e-3 relative.

Two runs export: Mixtral with expert parallelism from the published layout exports the published layout (the same
tensor names and shapes as the ``save_pretrained`` directory it started from), the same from the fused layout with
``checkpoint.export_layout=fused`` the fused one; both load with ``from_pretrained`` to the same logits (the same
start and training), which the untrained model does not give.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from tests.helpers.checkpoints import FAMILIES, MOE_FAMILIES, PER_EXPERT_FAMILIES, hf_model, layouts, save_checkpoint
from tests.helpers.reference_training import assert_curve_matches, assert_first_step_matches, reference, world_job

STEPS = 3
COEF = 0.1
CONTEXT = ("parallel.ring=2", "parallel.ulysses=2")
EXPERT_PARALLEL = ("parallel.dp=2", "parallel.ring=2", "parallel.ep=2")
# world size -> case -> (family, checkpoint layout, parallel overrides)
CASES = {
    1: {f"{family}-{layout}": (family, layout, ()) for family in MOE_FAMILIES for layout in layouts(family)},
    4: {
        **{f"{family}-published": (family, "published", CONTEXT) for family in FAMILIES},
        **{f"{family}-published-ep2": (family, "published", EXPERT_PARALLEL) for family in MOE_FAMILIES},
        **{f"{family}-fused-ep2": (family, "fused", EXPERT_PARALLEL) for family in PER_EXPERT_FAMILIES},
    },
}
EXPORTS = {"mixtral-published-ep2": "published", "mixtral-fused-ep2": "fused"}


def checkpoint_dir(workdir: str, family: str, layout: str) -> str:
    return f"{workdir}/checkpoint_{family}_{layout}"


@functools.cache
def write_checkpoints(workdir: str) -> None:
    """Each family's checkpoint in the layouts the cases read, from one model per family."""
    for family in FAMILIES:
        model = hf_model(family)
        for layout in layouts(family):
            shards = 3 if (family, layout) == ("qwen3_moe", "published") else 1
            save_checkpoint(model, Path(checkpoint_dir(workdir, family, layout)), layout=layout, shards=shards)


def model_overrides(workdir: str, family: str, layout: str) -> tuple[str, ...]:
    coef = (f"model.router_aux_loss_coef={COEF}",) if family in MOE_FAMILIES else ()
    return (f"model.path={checkpoint_dir(workdir, family, layout)}", *coef)


def grad_accum(parallel: tuple[str, ...]) -> int:
    """Accumulation 2 with dp 2 (the reference wants most of the step's rows to hold several documents)."""
    return 2 if parallel == EXPERT_PARALLEL else 1


def job(workdir: str, world: int, case: str) -> JobConfig:
    from tests.helpers.reference_training import job_config

    family, layout, parallel = CASES[world][case]
    cfg = job_config(
        workdir,
        f"{workdir}/run_{world}_{case}",
        steps=STEPS,
        grad_accum=grad_accum(parallel),
        parallel=parallel,
        model=model_overrides(workdir, family, layout),
    )
    if case in EXPORTS and world == 4:
        cfg.checkpoint.export_hf = True
        cfg.checkpoint.export_layout = EXPORTS[case]
    return cfg


@functools.cache
def results_for(workdir: str, world: int) -> dict:
    write_checkpoints(workdir)
    configs = {case: job(workdir, world, case) for case in CASES[world]}
    return run_distributed(world_job, world, configs)[0]


@pytest.mark.parametrize("world,case", [(world, case) for world, cases in CASES.items() for case in cases])
def test_a_saved_checkpoint_trains_like_the_model_transformers_loads(
    world: int, case: str, parity_workdir: str
) -> None:
    family, layout, parallel = CASES[world][case]
    result = results_for(parity_workdir, world)[case]
    expected = reference(
        parity_workdir,
        steps=STEPS,
        dp=2 if parallel == EXPERT_PARALLEL else 1,
        batch_size=1,
        grad_accum=grad_accum(parallel),
        model=model_overrides(parity_workdir, family, layout),
    )
    assert_first_step_matches(result, expected)
    assert_curve_matches(result, expected, STEPS)


def test_the_export_has_the_layout_asked_for_and_the_trained_logits(parity_workdir: str) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lctrain.models.layouts import checkpoint_files

    results_for(parity_workdir, 1)
    results_for(parity_workdir, 4)

    def shapes(directory: str) -> dict[str, tuple[int, ...]]:
        found = {}
        for name, file in checkpoint_files(directory).items():
            with safe_open(file, "pt") as f:
                found[name] = tuple(f.get_slice(name).get_shape())
        return found

    untrained = AutoModelForCausalLM.from_pretrained(checkpoint_dir(parity_workdir, "mixtral", "published")).eval()
    input_ids = torch.randint(0, untrained.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    with torch.no_grad():
        for case, layout in EXPORTS.items():
            exported = f"{parity_workdir}/run_4_{case}/hf"
            assert shapes(exported) == shapes(checkpoint_dir(parity_workdir, "mixtral", layout)), case
            logits[case] = AutoModelForCausalLM.from_pretrained(exported).eval()(input_ids).logits
        before = untrained(input_ids).logits
    # one model in two layouts, trained the same way: the same weights, whichever layout holds them
    torch.testing.assert_close(logits["mixtral-published-ep2"], logits["mixtral-fused-ep2"], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(logits["mixtral-published-ep2"], before, atol=1e-3)
