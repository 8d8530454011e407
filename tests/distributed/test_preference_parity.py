"""The preference objective through the ``Trainer`` on a spawned gloo group of 4 equals TRL's formulas on the plain
single-process model, each ``[prompt, answer]`` a sequence of its own (the unshared layout).

One spawn; each case builds a ``Trainer`` (the tiny fp32 model of ``tests/helpers/reference_training.py``, 64-token
rows packed by hand per the pair layout: ``tests/helpers/pairs.py``) and runs one forward-backward per loss
combination, without the optimizer step:

- ``ring2_ulysses2``: every loss type (``sigmoid``, ``ipo``, ``hinge``, ``robust``, ``simpo``, ``orpo``, and
  ``sigmoid`` + ``sft``) against a reference given by path (another seed: rewards are not zero); row 0's answers all
  lie in the row's second half, so two ranks' shards hold no completion token, and row 1's first pair lies wholly in
  ring rank 0 x Ulysses rank 0's shard (both checked here);
- ``dp2_ring2_accum2``: dp 2 x ring 2 with 2 accumulation micro-batches (4 rows, 8 pairs a step);
- ``lora``: LoRA (every ``lora_B`` set to 0.05) with the reference = the base with the adapters disabled;
- ``window``: a Mistral with a 6-token sliding window (counted in positions, through each answer's shared prompt);
- ``gpt_oss``: gpt-oss (attention sinks, an 8-token window on every other layer, 4 experts, top 2, no router
  load-balancing loss: lctrain refuses DPO with one) on ring 2 x Ulysses 2, the sinks folded once per query after the
  ring's merge, each answer's shared prompt counted in its softmax and its window;
- ``hybrid_ring2_ulysses2`` and ``hybrid_ring4``: the hybrids (``qwen3_5_text``, and ``qwen3_next`` with 4 experts,
  top 2, no router loss; three gated delta layers, then a full-attention layer) on ring 2 x Ulysses 2 and ring 4: each
  answer's gated delta state and convolution continue its shared prompt, the rejected answer's from the prompt's end
  (across the chosen answer, other pieces and ranks), as on the single-process model;
- ``unshared``: the same pairs packed with the prompt repeated for each answer, against the shared rows;
- ``initial``: the reference = the initial policy (a frozen copy): ``sigmoid`` gives ln 2 and zero rewards;
- ``pp2_ring2``: pp 2 x ring 2 (1F1B), the reference by path through a forward-only schedule of its own stages;
  ``pp2_precomputed`` the same with the reference's log-probs precomputed through it first and looked up;
- ``pp2_lora``: pp 2 x ring 2 with Interleaved1F1B (two stages a rank, 4 layers), 2 accumulation micro-batches and
  LoRA, the reference = the policy's own stages with the adapters disabled.

Tolerances (fp32): the loss within 1e-5 relative, TRL's metrics within 1e-5 relative (1e-6 absolute), every
parameter's full gradient within 1e-5 absolute + 1e-4 relative (the trainer parity tests' tolerances).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from lctrain.attention import SequencePlace
from lctrain.testing import run_distributed
from testbed.pairs import shard_rows
from tests.helpers.preference_training import (
    BETA,
    LABEL_SMOOTHING,
    LOSS_TYPES,
    base_model,
    expected_losses,
    other_model,
    packed_rows,
    preference_job,
    step_pairs,
    world_cases,
)

MESH = ["parallel.ring=2", "parallel.ulysses=2"]
PIPELINE = ["parallel.pp=2", "parallel.ring=2"]
OBJECTIVE = {"beta": BETA, "label_smoothing": LABEL_SMOOTHING}
GPT_OSS = (
    "model.family=gpt_oss",
    "model.sliding_window=8",
    "model.num_experts=4",
    "model.experts_per_token=2",
    "model.router_aux_loss_coef=0",
)
HYBRIDS = {
    "qwen3_5_text": ("model.family=qwen3_5_text", "model.num_layers=4"),
    "qwen3_next": (
        "model.family=qwen3_next",
        "model.num_layers=4",
        "model.num_experts=4",
        "model.experts_per_token=2",
        "model.router_aux_loss_coef=0",
    ),
}
# case -> (parallel, model overrides, rows a step, grad_accum, objective, loss types, adapters, shared)
CASES = {
    "ring2_ulysses2": (MESH, (), 2, 1, "path", LOSS_TYPES, False, True),
    "dp2_ring2_accum2": (
        ["parallel.dp=2", "parallel.ring=2"],
        (),
        4,
        2,
        "path",
        (["sigmoid"], ["ipo"], ["simpo"], ["sigmoid", "sft"]),
        False,
        True,
    ),
    "lora": (MESH, ("model.lora.rank=4",), 2, 1, "initial", (["sigmoid"], ["ipo"], ["orpo"]), True, True),
    "window": (MESH, ("model.family=mistral", "model.sliding_window=6"), 2, 1, "path", (["sigmoid"],), False, True),
    "gpt_oss": (MESH, GPT_OSS, 2, 1, "path", (["sigmoid"], ["ipo"]), False, True),
    # not ipo: its squared loss makes this random hybrid's gradients reach 20, where fp32 rounding exceeds 1e-5
    "hybrid_ring2_ulysses2": (MESH, HYBRIDS["qwen3_5_text"], 2, 1, "path", (["sigmoid"], ["simpo"]), False, True),
    "hybrid_ring4": (
        ["parallel.ring=4"],
        HYBRIDS["qwen3_next"],
        2,
        1,
        "path",
        (["sigmoid"], ["sigmoid", "sft"]),
        False,
        True,
    ),
    "unshared": (MESH, (), 2, 1, "path", (["sigmoid"], ["ipo"]), False, False),
    "initial": (MESH, (), 2, 1, "initial", (["sigmoid"],), False, True),
    "pp2_ring2": (PIPELINE, (), 2, 1, "path", (["sigmoid"], ["ipo"], ["simpo"], ["sigmoid", "sft"]), False, True),
    "pp2_precomputed": (PIPELINE, (), 2, 1, "path", (["sigmoid"], ["ipo"]), False, True),
    "pp2_lora": (
        [*PIPELINE, "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=2"],
        ("model.lora.rank=4", "model.num_layers=4"),
        2,
        2,
        "initial",
        (["sigmoid"], ["orpo"]),
        True,
        True,
    ),
}


PRECOMPUTED = {"pp2_precomputed"}  # the reference's log-probs precomputed through the pipeline, then looked up


def case_job(workdir: str, name: str):  # noqa: ANN201
    parallel, model, rows, accum, reference, _, _, _ = CASES[name]
    objective = dict(OBJECTIVE, reference=reference)
    if reference == "path":
        objective["reference_path"] = f"{workdir}/reference_{name}"
    dp = 2 if "parallel.dp=2" in parallel else 1
    return preference_job(
        workdir,
        f"{workdir}/run_{name}",
        objective=objective,
        parallel=parallel,
        model=model,
        batch_size=rows // (dp * accum),
        grad_accum=accum,
    )


def case_pairs(name: str) -> list:
    rows = CASES[name][2]
    return step_pairs(rows, fits_unshared=name in ("unshared", "window"))


@functools.cache
def references(workdir: str) -> dict:
    """The reference model of each case given by path, saved before the spawn."""
    found = {}
    for name in CASES:
        cfg = case_job(workdir, name)
        if cfg.objective.reference == "path":
            found[name] = other_model(cfg, Path(cfg.objective.reference_path))
    return found


@functools.cache
def results_for(workdir: str) -> dict:
    references(workdir)
    cases = {}
    for name, (_, _, _, _, _, types, adapters, shared) in CASES.items():
        rows = packed_rows(case_pairs(name), shared=shared)
        cases[name] = (case_job(workdir, name), rows, [list(t) for t in types], adapters, name in PRECOMPUTED)
    return run_distributed(world_cases, 4, cases)[0]


def assert_matches(result: tuple, expected: tuple, name: str) -> None:
    (loss, report, grads), (want_loss, want_metrics, want_grads) = result, expected
    assert math.isclose(loss, want_loss, rel_tol=1e-5), (name, loss, want_loss)
    for metric, value in want_metrics.items():
        assert math.isclose(report[metric], value, rel_tol=1e-5, abs_tol=1e-6), (name, metric, report[metric], value)
    assert grads.keys() == want_grads.keys()
    for key, grad in want_grads.items():
        torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{name} {k}: {m}")


@pytest.mark.parametrize("name", [n for n in CASES if n != "initial"])
def test_preference_losses_equal_trl_on_the_plain_model(name: str, parity_workdir: str) -> None:
    results = results_for(parity_workdir)
    cfg = case_job(parity_workdir, name)
    types = CASES[name][5]
    reference = references(parity_workdir).get(name) or base_model(cfg)  # lora: the base, adapters disabled
    pairs = [pair for row in case_pairs(name) for pair in row]
    expected = expected_losses(cfg, pairs, types, reference, adapters=CASES[name][6])
    for loss_type in types:
        assert_matches(results[name][tuple(loss_type)], expected[tuple(loss_type)], f"{name} {'+'.join(loss_type)}")
        assert results[name][tuple(loss_type)][1]["pairs"] == len(pairs)
        assert results[name][tuple(loss_type)][1]["rewards/margins"] != 0


def test_first_step_with_the_initial_policy_is_ln2(parity_workdir: str) -> None:
    loss, report, _ = results_for(parity_workdir)["initial"][("sigmoid",)]
    assert loss == pytest.approx(math.log(2), rel=1e-7)
    assert report["rewards/chosen"] == report["rewards/rejected"] == report["rewards/margins"] == 0.0


def test_the_rows_hold_an_empty_shard_and_a_pair_on_one_rank() -> None:
    rows = packed_rows(case_pairs("ring2_ulysses2"))
    places = [SequencePlace(ring_rank=r, ring_size=2, ulysses_rank=u, ulysses_size=2) for r in (0, 1) for u in (0, 1)]
    shards = [shard_rows(rows, place)["completions"] for place in places]
    assert any((shard[0] < 0).all() for shard in shards)  # row 0: a rank without a completion token
    owners = [sum(((shard[1] == c).any().item()) for shard in shards) for c in (0, 1)]
    assert owners == [1, 1] and (shards[0][1] == 0).any() and (shards[0][1] == 1).any()  # pair 0 of row 1: one rank
