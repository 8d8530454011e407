"""What a run records and prints: metrics.jsonl (resumed runs drop the steps after the resumed one), the loss and
validation plots, the log lines through the progress bar, Weights & Biases offline and disabled."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lctrain.config import LoggingConfig
from lctrain.train.metrics import MetricsLogger


def test_metrics_jsonl_drops_steps_after_the_resumed_one_and_plots(tmp_path: Path) -> None:
    def record(loss: float) -> dict:
        return {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None, "peak_mem_gib": 0.1}

    cfg = LoggingConfig(every=2)
    first = MetricsLogger(cfg, tmp_path, rank=0, resume_step=0, job_config={})
    lines = [first.log(step, record(10.0 - step)) for step in range(1, 6)]
    assert lines[0] is None and lines[1].startswith("step 2 | loss 8.0000 | grad_norm 1.000 | lr 1.00e-03")
    resumed = MetricsLogger(cfg, tmp_path, rank=0, resume_step=3, job_config={})
    resumed.log(4, record(0.5))
    resumed.close()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in steps] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    other_rank = MetricsLogger(cfg, tmp_path / "r1", rank=1, resume_step=0, job_config={})
    assert other_rank.log(2, record(1.0)) is None and not (tmp_path / "r1").exists()


def test_validation_records_print_and_plot(tmp_path: Path) -> None:
    """A step that validates carries val_loss, val_tokens and val_loss_by_position in metrics.jsonl, prints its line
    even off the logging cadence, and the run gets val_loss.png beside loss.png."""
    base = {"grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None, "peak_mem_gib": 0.1}
    metrics = MetricsLogger(LoggingConfig(every=10), tmp_path, rank=0, resume_step=0, job_config={})
    for step in range(1, 7):
        record = {**base, "loss": 8.0 - step}
        if step % 3 == 0:
            by_position = {"0-64": 6.0 - step / 3, "64-256": 5.5 - step / 3, "256-1024": None}
            record.update({"val_loss": 5.0 - step / 3, "val_tokens": 1000, "val_loss_by_position": by_position})
        line = metrics.log(step, record)
        assert (line is not None) == (step % 3 == 0)
    assert line.endswith(" | val_loss 3.0000")
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[5]["val_loss_by_position"] == {"0-64": 4.0, "64-256": 3.5, "256-1024": None}
    assert "val_loss" not in records[0]
    assert (tmp_path / "val_loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_weights_and_biases_offline_writes_a_local_run_and_disabled_nothing(tmp_path: Path, mode: str) -> None:
    metrics = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "mfu": None, "peak_mem_gib": 0.1}
    logger = MetricsLogger(LoggingConfig(wandb=mode, plot=False), tmp_path, rank=0, resume_step=0, job_config={})
    logger.log(1, metrics)
    logger.close()
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    if mode == "offline":
        assert len(runs) == 1 and runs[0].stat().st_size > 0
    else:
        assert not (tmp_path / "wandb").exists()


def test_log_lines_go_through_the_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Log lines are written with ``tqdm.write``, which clears rank 0's progress bar, prints, and redraws it: the
    bar and the per-step lines never overwrite each other."""
    import lctrain.runtime

    written: list[str] = []
    monkeypatch.setattr(lctrain.runtime.tqdm, "write", lambda text, file=None, **kwargs: written.append(text))
    root_handlers = logging.getLogger().handlers[:]
    try:
        lctrain.runtime.setup_logging(0)
        logging.getLogger("lctrain").info("step 1 | loss 1.0")
    finally:
        logging.getLogger().handlers[:] = root_handlers
    assert len(written) == 1 and written[0].startswith("[rank0] ") and written[0].endswith("step 1 | loss 1.0")


def test_preference_runs_plot_margin_and_accuracy(tmp_path: Path) -> None:
    base = {"grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None, "peak_mem_gib": 0.1}
    metrics = MetricsLogger(LoggingConfig(), tmp_path, rank=0, resume_step=0, job_config={})
    for step in range(1, 5):
        record = {**base, "loss": 0.7 - step / 20, "rewards/margins": step / 10, "rewards/accuracies": 0.5}
        line = metrics.log(step, record)
    assert line.endswith(" | margin 0.4000 | acc 0.500")
    metrics.close()
    assert (tmp_path / "rewards.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "val_loss.png").exists()


def test_preference_validation_plots_its_loss_without_positions(tmp_path: Path) -> None:
    """Validation pairs report the preference loss and rewards, no loss by position: ``val_loss.png`` shows the
    validation loss alone."""
    base = {"grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None, "peak_mem_gib": 0.1}
    metrics = MetricsLogger(LoggingConfig(), tmp_path, rank=0, resume_step=0, job_config={})
    for step in range(1, 5):
        validation = {"val_loss": 0.69 - step / 50, "val_rewards/margins": step / 10} if step % 2 == 0 else {}
        metrics.log(step, {**base, "loss": 0.7, "rewards/margins": 0.1, "rewards/accuracies": 0.5, **validation})
    metrics.close()
    assert (tmp_path / "val_loss.png").read_bytes()[:4] == b"\x89PNG"
