"""Metrics: one line per step on rank 0, every step to ``metrics.jsonl`` and the trackers enabled (W&B, TensorBoard,
MLflow: ``lctrain.train.trackers``), and a loss
plot at the end (and, when the run validates, a validation plot: ``val_loss.png``; for preference pairs, the reward
margin and accuracy: ``rewards.png``). The step's tokens/s, MFU and peak memory the line reports come from
``meter.py``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lctrain.config.schema import LoggingConfig
from lctrain.train.trackers import Guarded, open_trackers

logger = logging.getLogger("lctrain")


class MetricsLogger:
    """Rank 0 writes; other ranks' calls do nothing."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, *, rank: int, resume_step: int, job_config: dict[str, Any]):
        self.cfg = cfg
        self.enabled = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self.trackers: list[Guarded] = []
        if not self.enabled:
            return
        # a resumed run repeats the steps after its checkpoint: drop their old records
        kept = [line for line in _read_jsonl(self.path) if line["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(line) + "\n" for line in kept))
        self.trackers = open_trackers(cfg, run_dir, job_config, resume_step)

    def log(self, step: int, metrics: dict[str, Any]) -> str | None:
        """Record one step; returns the formatted line when this step is printed (every ``logging.every`` steps, and
        at each validation). A dict value (``val_loss_by_position``) goes to the trackers as ``key/sub`` values."""
        if not self.enabled:
            return None
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers:
            flat = {}
            for key, value in metrics.items():
                flat.update({f"{key}/{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
            numbers = {k: float(v) for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for tracker in self.trackers:
                tracker.log(step, numbers)
        validated = metrics.get("val_loss") is not None
        if step % self.cfg.every and not validated:
            return None
        mfu = "n/a" if metrics["mfu"] is None else f"{100 * metrics['mfu']:.1f}%"
        line = (
            f"step {step} | loss {metrics['loss']:.4f} | grad_norm {metrics['grad_norm']:.3f} | lr {metrics['lr']:.2e}"
            f" | tok/s {metrics['tokens_per_s']:.0f} | mfu {mfu} | mem {metrics['peak_mem_gib']:.2f} GiB"
        )
        if metrics.get("rewards/margins") is not None:  # preference pairs: TRL's two headline metrics
            line += f" | margin {metrics['rewards/margins']:.4f} | acc {metrics['rewards/accuracies']:.3f}"
        return line + (f" | val_loss {metrics['val_loss']:.4f}" if validated else "")

    def close(self, exported: Path | None = None) -> None:
        """The plots, then each tracker's end (the plots and ``exported``, the exported model's directory)."""
        if not self.enabled:
            return
        plots = []
        if self.cfg.plot:
            plots.append(self.run_dir / "loss.png")
            plot_loss(self.path, plots[-1])
            records = _read_jsonl(self.path)
            if any(record.get("val_loss") is not None for record in records):
                plots.append(self.run_dir / "val_loss.png")
                plot_validation(self.path, plots[-1])
            if any(record.get("rewards/margins") is not None for record in records):
                plots.append(self.run_dir / "rewards.png")
                plot_rewards(self.path, plots[-1])
        for tracker in self.trackers:
            tracker.finish(plots, exported)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, out: Path) -> None:
    """Training loss against step, from ``metrics.jsonl``, with its running mean, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _read_jsonl(metrics_path)
    steps, losses = [r["step"] for r in records], [r["loss"] for r in records]
    window = max(1, len(losses) // 20)  # the mean of the last `window` steps, for a readable trend
    trend = [sum(losses[max(0, i + 1 - window) : i + 1]) / min(window, i + 1) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, alpha=0.35, label="loss")
    ax.plot(steps, trend, label=f"mean of {window} steps")
    ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_rewards(metrics_path: Path, out: Path) -> None:
    """A preference run's ``rewards/margins`` and ``rewards/accuracies`` against step, from ``metrics.jsonl``, as a
    PNG (two panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in _read_jsonl(metrics_path) if r.get("rewards/margins") is not None]
    steps = [r["step"] for r in records]
    fig, panels = plt.subplots(1, 2, figsize=(11, 4))
    for panel, name in zip(panels, ("rewards/margins", "rewards/accuracies")):
        panel.plot(steps, [r[name] for r in records], label=name)
        panel.set_xlabel("step")
        panel.set_ylabel(name)
        panel.grid(alpha=0.3)
    panels[1].axhline(0.5, color="grey", linestyle="--", linewidth=1)  # chance
    fig.suptitle(metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_validation(metrics_path: Path, out: Path) -> None:
    """Validation loss against step (beside the training loss's running mean), and (language modelling, whose
    validation scores positions) the loss by position at up to eight validations spread over the run (one line each,
    later ones darker), from ``metrics.jsonl``, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _read_jsonl(metrics_path)
    validations = [r for r in records if r.get("val_loss") is not None]
    positions = "val_loss_by_position" in validations[-1]  # preference pairs' validation has none
    fig, axes = plt.subplots(1, 2 if positions else 1, figsize=(11 if positions else 6, 4), squeeze=False)
    curve = axes[0][0]
    losses = [r["loss"] for r in records]
    window = max(1, len(losses) // 20)
    trend = [sum(losses[max(0, i + 1 - window) : i + 1]) / min(window, i + 1) for i in range(len(losses))]
    curve.plot([r["step"] for r in records], trend, alpha=0.5, label=f"training loss (mean of {window} steps)")
    curve.plot([r["step"] for r in validations], [r["val_loss"] for r in validations], "o-", label="validation loss")
    curve.set_xlabel("step")
    curve.set_ylabel("loss")
    curve.legend()
    curve.grid(alpha=0.3)
    if positions:
        _plot_by_position(axes[0][1], validations, plt.get_cmap("viridis_r"))
    fig.suptitle(f"{metrics_path.parent.name}: validation")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _plot_by_position(by_position: Any, validations: list[dict[str, Any]], colors: Any) -> None:
    """The loss by position at up to eight of ``validations`` on the axes ``by_position``."""
    buckets = list(validations[-1]["val_loss_by_position"])
    shown = sorted({round(i * (len(validations) - 1) / 7) for i in range(8)})
    for index in shown:
        record = validations[index]
        values = [record["val_loss_by_position"].get(bucket) for bucket in buckets]
        shade = colors(0.15 + 0.85 * (index + 1) / len(validations))
        by_position.plot(range(len(buckets)), values, "o-", color=shade, label=f"step {record['step']}")
    by_position.set_xticks(range(len(buckets)), [f"[{b.replace('-', ', ')})" for b in buckets], fontsize=8)
    by_position.set_xlabel("document position of the predicting token")
    by_position.set_ylabel("validation loss")
    by_position.legend(fontsize=7, ncol=2)
    by_position.grid(alpha=0.3)
