"""Preference files read by the trainer's own loader on a spawned gloo group of 4 (ring 2 x Ulysses 2): the first
step's DPO loss, metrics and gradients equal TRL's formulas on the plain single-process model (each
``[prompt, answer]`` a sequence of its own) over the pairs the loader packs in that step's rows, with the prompt
shared and repeated (``data.share_prompt``), against a reference given by path (another seed: rewards are not zero).

The file holds TRL's three forms (strings, conversational, implicit prompt: ``testbed.corpus.write_pair_corpus``)
rendered with the embedded tokenizer's ChatML template. The expected pairs are the encoder's, in file order, the
ones longer than a row left out, as many as the loader's first step (two rows) holds. Tolerances as the preference
parity tests': the loss within 1e-5 relative, every gradient within 1e-5 absolute + 1e-4 relative.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from lctrain.config import ObjectiveConfig
from lctrain.data import PackedLoader, load_tokenizer
from lctrain.data.pairs import PairEncoder, parse_pair
from lctrain.testing import run_distributed
from testbed.corpus import write_pair_corpus
from tests.helpers.preference_training import expected_losses, other_model
from tests.helpers.reference_training import SEQ_LEN, job_config, world_job

SHARED = {"shared": True, "repeated": False}


def case_job(workdir: str, name: str):  # noqa: ANN201
    cfg = job_config(
        workdir,
        f"{workdir}/run_{name}",
        steps=1,
        batch_size=2,
        parallel=["parallel.ring=2", "parallel.ulysses=2"],
        data=[f"data.paths=[{workdir}/pairs.jsonl]", "data.format=preference", f"data.share_prompt={SHARED[name]}"],
    )
    cfg.objective = ObjectiveConfig(name="dpo", beta=0.1, reference="path", reference_path=f"{workdir}/reference")
    return cfg


@functools.cache
def results_for(workdir: str) -> dict:
    write_pair_corpus(Path(workdir) / "pairs.jsonl", 40)
    other_model(case_job(workdir, "shared"), Path(workdir) / "reference")
    return run_distributed(world_job, 4, {name: case_job(workdir, name) for name in SHARED})[0]


def first_step_pairs(workdir: str, name: str) -> list[tuple[list[int], list[int], list[int]]]:
    """The token lists of the pairs the loader packs in the first step's two rows, from the encoder alone (which
    pairs fit a row depends on the layout)."""
    cfg = case_job(workdir, name)
    count = sum(next(iter(PackedLoader(cfg.data)))["pair_counts"])
    lines = (Path(workdir) / "pairs.jsonl").read_text().splitlines()
    encoder = PairEncoder(load_tokenizer(cfg.data.tokenizer), shared=cfg.data.share_prompt)
    encoded = encoder.encode([parse_pair(line, "x") for line in lines])
    fitting = [pair for pair in encoded if len(pair) <= SEQ_LEN]
    return [(p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()) for p in fitting[:count]]


@pytest.mark.parametrize("name", list(SHARED))
def test_preference_files_train_as_trl_on_the_plain_model(name: str, parity_workdir: str) -> None:
    losses, _, grads = results_for(parity_workdir)[name]
    cfg = case_job(parity_workdir, name)
    pairs = first_step_pairs(parity_workdir, name)
    assert len(pairs) >= 2
    reference = other_model(cfg, Path(parity_workdir) / "reference")
    want_loss, _, want_grads = expected_losses(cfg, pairs, [["sigmoid"]], reference)[("sigmoid",)]
    assert math.isclose(losses[0], want_loss, rel_tol=1e-5), (losses[0], want_loss)
    assert not math.isclose(want_loss, math.log(2), rel_tol=1e-3)  # the reference differs from the policy
    assert grads.keys() == want_grads.keys()
    for key, grad in want_grads.items():
        torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{name} {k}: {m}")
