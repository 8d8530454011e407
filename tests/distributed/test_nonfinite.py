"""A NaN loss never trains silently on: ``train.nonfinite=stop`` raises before the update (the last checkpoint stays
intact), ``skip`` drops that step's update, logs it and goes on.

One spawned gloo rank (FSDP over a group of one), a tiny model on ``tests/corpus.py``. The loss of step 2 is made
NaN by scaling its token sum by NaN (so every gradient is NaN). Checked: with ``stop``, a ``FloatingPointError``
naming the step and the setting, parameters equal to those after step 1, and the step-1 checkpoint complete; with
``skip``, parameters after step 2 equal those after step 1 exactly, step 3 changes them and is finite, and the
schedule advanced on the skipped step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lctrain.config import load_config
from lctrain.testing import run_distributed
from lctrain.train.checkpoint import complete_checkpoints
from tests.corpus import corpus_overrides, write_corpus

BASE = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "data.seq_len=32",
    "train.steps=3",
    "checkpoint.every=1",
    "checkpoint.export_hf=false",
    "logging.progress_bar=false",
    "logging.plot=false",
]


def run(root: str, policy: str) -> dict:
    from lctrain.train.trainer import Trainer

    cfg = load_config(
        [
            *BASE,
            *corpus_overrides(Path(root) / "corpus.jsonl"),
            f"train.run_dir={root}/{policy}",
            f"train.nonfinite={policy}",
        ]
    )
    trainer = Trainer(cfg)
    forward_loss_sum = trainer.forward_loss_sum

    def nan_at_step_2(batch: dict, row: int) -> torch.Tensor:
        loss = forward_loss_sum(batch, row)
        return loss * float("nan") if trainer.step == 1 else loss

    trainer.forward_loss_sum = nan_at_step_2
    optimizer_step = trainer.optimizer_step
    params: list[dict[str, torch.Tensor]] = []
    lrs: list[float] = []

    def recording_optimizer_step() -> torch.Tensor:
        lrs.append(trainer.scheduler.get_last_lr()[0])
        try:
            return optimizer_step()
        finally:
            params.append({n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()})

    trainer.optimizer_step = recording_optimizer_step
    losses, error = [], None
    try:
        losses = trainer.train()
    except FloatingPointError as raised:
        error = str(raised)
    grad_norms = [json.loads(line)["grad_norm"] for line in (Path(cfg.train.run_dir) / "metrics.jsonl").open()]
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "lrs": lrs, "error": error}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("nonfinite")
    write_corpus(root / "corpus.jsonl")
    return {policy: run_distributed(run, 1, str(root), policy)[0] for policy in ("stop", "skip")} | {"root": root}


def unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[name], after[name]) for name in before)


def test_stop_raises_before_the_update(outcomes: dict) -> None:
    stop = outcomes["stop"]
    assert stop["error"] is not None and "step 2" in stop["error"] and "train.nonfinite=skip" in stop["error"]
    assert len(stop["grad_norms"]) == 1 and len(stop["params"]) == 2  # step 1 recorded, step 2 stopped
    assert unchanged(stop["params"][0], stop["params"][1])


def test_skip_drops_the_update_and_goes_on(outcomes: dict) -> None:
    skip = outcomes["skip"]
    assert skip["error"] is None and len(skip["losses"]) == 3
    assert math.isnan(skip["losses"][1]) and math.isnan(skip["grad_norms"][1])
    assert unchanged(skip["params"][0], skip["params"][1])
    assert not unchanged(skip["params"][1], skip["params"][2]) and math.isfinite(skip["losses"][2])
    assert skip["lrs"][2] != skip["lrs"][1]  # the schedule advanced on the skipped step


def test_checkpoint_before_the_stop_is_intact(outcomes: dict) -> None:
    found = complete_checkpoints(outcomes["root"] / "stop" / "checkpoints")
    assert [p.name for p in found] == ["step_00000001"]
