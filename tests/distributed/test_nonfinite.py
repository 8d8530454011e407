"""A NaN/inf loss or gradient never trains silently on: ``train.nonfinite=stop`` raises before the update (the last
checkpoint stays intact and loads), ``skip`` drops that step's update, logs a warning and goes on.

One spawned gloo rank (FSDP over a group of one), a tiny model on ``testbed/corpus.py``, three faults at step 2:
each row's loss share scaled by NaN (every gradient NaN), by inf, and a finite loss with one gradient element set to NaN
after the backward. Checked for each: with ``stop``, a ``FloatingPointError`` naming the step and the setting,
parameters equal to those after step 1, the step-1 checkpoint complete, and a new ``Trainer`` resuming from it with
exactly the step-1 parameters; with ``skip``, the warning ``skip`` promises, parameters after step 2 equal to those
after step 1 exactly, step 3 changing them with a finite loss, and the schedule advanced on the skipped step.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from lctrain.checkpoint import complete_checkpoints
from lctrain.config import load_config
from lctrain.testing import run_distributed
from testbed.corpus import corpus_overrides, write_corpus

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
FAULTS = ("nan_loss", "inf_loss", "nan_grad")
POLICIES = ("stop", "skip")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def parameters(trainer: object) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}


def run(root: str, policy: str, fault: str) -> dict:
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer

    run_dir = f"{root}/{policy}_{fault}"
    overrides = [*BASE, *corpus_overrides(Path(root) / "corpus.jsonl"), f"train.run_dir={run_dir}"]
    cfg = load_config([*overrides, f"train.nonfinite={policy}"])
    trainer = Trainer(build_training_job(cfg))
    forward_loss, optimizer_step = trainer.forward_loss, trainer.optimizer_step
    scale = {"nan_loss": float("nan"), "inf_loss": float("inf"), "nan_grad": 1.0}[fault]

    def faulty_loss(batch: dict, row: int, counts: torch.Tensor) -> torch.Tensor:
        output = forward_loss(batch, row, counts)  # [the row's loss share, then its report sums]
        return torch.cat([output[:1] * scale, output[1:]]) if trainer.step == 1 else output

    params: list[dict[str, torch.Tensor]] = []
    lrs: list[float] = []

    def recording_optimizer_step(trained: torch.Tensor) -> torch.Tensor:
        lrs.append(trainer.scheduler.get_last_lr()[0])
        if fault == "nan_grad" and trainer.step == 1:
            next(trainer.model.parameters()).grad.to_local().view(-1)[0] = float("nan")
        try:
            return optimizer_step(trained)
        finally:
            params.append(parameters(trainer))

    trainer.forward_loss, trainer.optimizer_step = faulty_loss, recording_optimizer_step
    records = Records()
    logging.getLogger("lctrain").addHandler(records)
    losses, error, resumed = [], None, None
    try:
        losses = trainer.train()
    except FloatingPointError as raised:
        error = str(raised)
        resumed = parameters(Trainer(build_training_job(load_config([*overrides, "checkpoint.resume=auto"]))))
    finally:
        logging.getLogger("lctrain").removeHandler(records)
    grad_norms = [json.loads(line)["grad_norm"] for line in (Path(run_dir) / "metrics.jsonl").open()]
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": params,
        "lrs": lrs,
        "error": error,
        "warnings": records.messages,
        "resumed": resumed,
    }


def run_all(root: str) -> dict:
    return {(policy, fault): run(root, policy, fault) for policy in POLICIES for fault in FAULTS}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("nonfinite")
    write_corpus(root / "corpus.jsonl")
    return run_distributed(run_all, 1, str(root))[0] | {"root": root}


def unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("fault", FAULTS)
def test_stop_raises_before_the_update(outcomes: dict, fault: str) -> None:
    stop = outcomes["stop", fault]
    assert stop["error"] is not None and "step 2" in stop["error"] and "train.nonfinite=skip" in stop["error"]
    assert len(stop["grad_norms"]) == 1 and len(stop["params"]) == 2  # step 1 recorded, step 2 stopped
    assert unchanged(stop["params"][0], stop["params"][1])


@pytest.mark.parametrize("fault", FAULTS)
def test_skip_drops_the_update_and_goes_on(outcomes: dict, fault: str) -> None:
    skip = outcomes["skip", fault]
    assert skip["error"] is None and len(skip["losses"]) == 3
    assert not math.isfinite(skip["grad_norms"][1])
    assert math.isfinite(skip["losses"][1]) == (fault == "nan_grad")
    assert [m for m in skip["warnings"] if "step 2: the gradient norm is" in m and "update skipped" in m]
    assert unchanged(skip["params"][0], skip["params"][1])
    assert not unchanged(skip["params"][1], skip["params"][2]) and math.isfinite(skip["losses"][2])
    assert skip["lrs"][2] != skip["lrs"][1]  # the schedule advanced on the skipped step


@pytest.mark.parametrize("fault", FAULTS)
def test_checkpoint_before_the_stop_is_intact(outcomes: dict, fault: str) -> None:
    found = complete_checkpoints(outcomes["root"] / f"stop_{fault}" / "checkpoints")
    assert [p.name for p in found] == ["step_00000001"]
    stop = outcomes["stop", fault]
    assert unchanged(stop["params"][0], stop["resumed"])  # it loads, and holds the parameters after step 1
