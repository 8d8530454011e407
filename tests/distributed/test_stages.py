"""Progressive stages (``train.stages``) run in order, each from the previous stage's export, and a relaunch after a
crash skips the finished stages and resumes the unfinished one exactly.

One spawned gloo group of 2 ranks, a tiny Llama on a small jsonl corpus. Two stages:

- stage 0: 64-token rows, 3 steps, ``parallel.dp=2``;
- stage 1: 128-token rows, 3 steps, ``parallel.ring=2`` (another mesh on the same processes) and linear RoPE
  scaling (factor 2).

Run once without interruption (the reference). Run again in another directory with ``Trainer.train_step`` raising
on its 5th call (stage 1, step 2; stage 1 checkpoints every step), then a relaunch of the same job. Checked: stage 1
starts from stage 0's exported weights (bitwise); the relaunch does not re-run stage 0 (its 3 metrics lines are
unchanged) and resumes stage 1 at its step 1; stage 1's losses and exported weights equal the reference's exactly
(CPU fp32 gloo is deterministic); stage 1's export carries the RoPE scaling; a stage setting that is not a setting,
or one the stages decide, is refused naming the stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lctrain.config import load_config
from lctrain.testing import run_distributed
from lctrain.train.stages import stage_configs
from testbed.corpus import corpus_overrides, write_corpus

STAGES = (
    "train.stages=[{data.seq_len: 64, train.steps: 3, parallel.dp: 2}, {data.seq_len: 128, train.steps: 3, "
    "parallel.ring: 2, model.rope_scaling.type: linear, model.rope_scaling.factor: 2}]"
)
BASE = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "optim.warmup_steps=1",
    "checkpoint.every=1",
    "logging.progress_bar=false",
    "logging.plot=false",
    STAGES,
]


class Crash(Exception):
    pass


def run_job(root: str, name: str, crash_at_call: int | None) -> dict[str, Any]:
    """``lctrain train``'s loop over the pending stages; ``Trainer.train_step`` raises on call ``crash_at_call``."""
    from lctrain.train.job import build_training_job
    from lctrain.train.stages import pending_stages
    from lctrain.train.trainer import Trainer

    cfg = load_config([*BASE, *corpus_overrides(Path(root) / "corpus.jsonl"), f"train.run_dir={root}/{name}"])
    train_step, calls = Trainer.train_step, [0]

    def counting_train_step(self: Trainer, micro_batches: Any) -> dict[str, float]:
        calls[0] += 1
        if calls[0] == crash_at_call:
            raise Crash
        return train_step(self, micro_batches)

    Trainer.train_step = counting_train_step
    started_from_export, resumed_steps = [], []
    try:
        for job in pending_stages(cfg):
            trainer = Trainer(build_training_job(job))
            resumed_steps.append(trainer.step)
            if job.model.path is not None:  # a later stage: its weights at the start are the previous export
                exported = load_file(Path(job.model.path) / "model.safetensors")
                params = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
                started_from_export.append(all(torch.equal(params[n], t) for n, t in exported.items()))
            trainer.train()
    except Crash:
        return {"crashed": True, "resumed_steps": resumed_steps}
    finally:
        Trainer.train_step = train_step
    return {"crashed": False, "resumed_steps": resumed_steps, "started_from_export": started_from_export}


def runs(root: str) -> dict[str, Any]:
    return {
        "reference": run_job(root, "reference", None),
        "crashed": run_job(root, "resumed", 5),
        "relaunch": run_job(root, "resumed", None),
    }


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("stages")
    write_corpus(root / "corpus.jsonl")
    return root, run_distributed(runs, 2, str(root))[0]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_later_stage_starts_from_the_previous_export(outcome: tuple[Path, dict[str, Any]]) -> None:
    _, results = outcome
    assert results["reference"]["started_from_export"] == [True]
    assert results["reference"]["resumed_steps"] == [0, 0]


def test_relaunch_skips_finished_stage_and_resumes_the_next(outcome: tuple[Path, dict[str, Any]]) -> None:
    root, results = outcome
    assert results["crashed"] == {"crashed": True, "resumed_steps": [0, 0]}
    assert results["relaunch"]["resumed_steps"] == [1]  # stage 0 skipped; stage 1 from its step-1 checkpoint
    assert len(losses(root / "resumed" / "stage_0")) == 3


def test_resumed_stages_equal_the_uninterrupted_run(outcome: tuple[Path, dict[str, Any]]) -> None:
    root, _ = outcome
    for stage in ("stage_0", "stage_1"):
        assert losses(root / "resumed" / stage) == losses(root / "reference" / stage), stage
    reference = load_file(root / "reference" / "stage_1" / "hf" / "model.safetensors")
    resumed = load_file(root / "resumed" / "stage_1" / "hf" / "model.safetensors")
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[name], resumed[name]) for name in reference)
    config = json.loads((root / "reference" / "stage_1" / "hf" / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "linear" and config["rope_parameters"]["factor"] == 2.0


@pytest.mark.parametrize(
    "stages,message",
    [
        ("[{data.seq_length: 64}]", "train.stages[0]: data.seq_length is not a setting"),
        ("[{data.seq_len: 64}, {model.path: /m}]", "train.stages[1] sets model.path, which the stages decide"),
        ("[{data.seq_len: sixty}]", "train.stages[0]: data.seq_len='sixty'"),
    ],
)
def test_bad_stage_settings_name_the_stage(stages: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        stage_configs(load_config([f"train.stages={stages}"]))
    assert message in str(error.value)
