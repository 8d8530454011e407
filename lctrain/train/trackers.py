"""The experiment trackers a run reports to beside ``metrics.jsonl`` (rank 0 only), any of them at once: Weights &
Biases (``logging.wandb``), TensorBoard (``logging.tensorboard``: event files in ``<run_dir>/tensorboard``) and MLflow
(``logging.mlflow``: a run of the experiment ``logging.mlflow_experiment`` at ``logging.mlflow_uri``, a tracking
server or a store, by default a SQLite store with its artifacts in ``<run_dir>/mlflow``). TensorBoard and MLflow are
installed by the extras of their names (``pip install 'lctrain[tensorboard,mlflow]'``).

Each receives every step's metrics as ``metrics.jsonl`` holds them (a dict value such as ``val_loss_by_position``
as ``key/sub`` values; None left out), the job's config (``section.field``: MLflow's parameters, TensorBoard's
``config`` text) and, at the end, the plots and the exported model's path. A resumed run continues the same run:
TensorBoard drops its events after the resumed step (``purge_step``), MLflow reopens the run whose id it keeps in
``<run_dir>/mlflow_run_id`` (the steps after the checkpoint are logged again).

A tracker that fails (a server that cannot be reached) is warned about once and training goes on: its records wait
and are sent again with the first step ``RETRY_S`` seconds later, and at the end; ``metrics.jsonl`` holds every step
in any case. A request that failed without an answer (a server slower than MLflow's request timeout) may have been
stored all the same: MLflow looks the step up before sending it again, so that no step is logged twice, and a start
tried again looks up the run its failed request may have made (by the tag ``lctrain.start_id``) before making one.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lctrain.config.schema import LoggingConfig

if TYPE_CHECKING:
    from mlflow.entities import Metric

logger = logging.getLogger("lctrain")

RETRY_S = 30.0
# MLflow's client retries a failing request for minutes by default: one try of a few seconds, then the guard's retry
_MLFLOW_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"section.field": text}`` (lists and None as JSON)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat


class WandbTracker:
    def __init__(self, project: str, mode: str, run_dir: Path, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, dir=str(run_dir), mode=mode, config=config, resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, plots: list[Path], exported: Path | None) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            rows = "\n".join(f"| {key} | {value} |" for key, value in flat_config(config).items())
            self.writer.add_text("config", "| setting | value |\n|---|---|\n" + rows)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, plots: list[Path], exported: Path | None) -> None:
        import matplotlib.pyplot as plt

        for plot in plots:
            self.writer.add_image(plot.stem, plt.imread(plot)[..., :3], dataformats="HWC")
        if exported is not None:
            self.writer.add_text("exported_model", str(exported))
        self.writer.close()


class MLflowTracker:
    def __init__(self, uri: str | None, experiment: str, run_dir: Path, config: dict[str, Any], resume_step: int):
        for key, value in _MLFLOW_ENV.items():
            os.environ.setdefault(key, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        local = run_dir.resolve() / "mlflow"  # without a URI: a SQLite store and the artifacts in the run directory
        if uri is None:
            local.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri or f"sqlite:///{local / 'mlflow.db'}")
        self.unanswered: int | None = None  # the step whose request failed: the server may have stored it all the same
        id_file = run_dir / "mlflow_run_id"
        self.run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None
        if self.run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            artifacts = None if uri else (local / "artifacts").as_uri()
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment, artifacts)
            # a start whose request failed may have made its run all the same: the retry finds it by this tag
            start_file, tag = run_dir / "mlflow_start_id", "lctrain.start_id"
            retried = start_file.is_file()
            if not retried:
                start_file.write_text(uuid.uuid4().hex)
            tags = {tag: start_file.read_text()}
            made = self.client.search_runs([experiment_id], f"tags.`{tag}` = '{tags[tag]}'") if retried else []
            run = made[0] if made else self.client.create_run(experiment_id, run_name=run_dir.name, tags=tags)
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id)
            start_file.unlink()
        logged = self.client.get_run(self.run_id).data.params  # a resumed run keeps the values it started with
        params = [Param(key, value[:6000]) for key, value in flat_config(config).items() if key not in logged]
        for start in range(0, len(params), 100):  # MLflow takes up to 100 parameters a call
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        if metrics and self.unanswered == step and self._stored(metrics[0]):
            self.unanswered = None
            return
        self.unanswered = step
        self.client.log_batch(self.run_id, metrics=metrics)  # one transaction: all of the step's metrics or none
        self.unanswered = None

    def _stored(self, metric: Metric) -> bool:
        """Whether the run holds ``metric``'s step with its value (a batch sent again would add a second point)."""
        history = self.client.get_metric_history(self.run_id, metric.key)
        return any(point.step == metric.step and point.value == metric.value for point in history)

    def finish(self, plots: list[Path], exported: Path | None) -> None:
        for plot in plots:
            self.client.log_artifact(self.run_id, str(plot))
        if exported is not None:
            self.client.set_tag(self.run_id, "exported_model", str(exported))
        self.client.set_terminated(self.run_id)


class Guarded:
    """A tracker made by ``make`` on first use, whose failures are warned about once and never stop the run: the
    records it could not take wait and are sent again (module docstring)."""

    def __init__(self, name: str, make: Callable[[], Any]):
        self.name, self.make, self.tracker = name, make, None
        self.pending: list[tuple] = []
        self.failed_at: float | None = None
        self.warned = False
        self._send(force=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.pending.append(("log", step, values))
        self._send()

    def finish(self, plots: list[Path], exported: Path | None) -> None:
        self.pending.append(("finish", plots, exported))
        self._send(force=True)
        if self.pending:
            logger.warning("%s: %d records were never sent (metrics.jsonl holds them)", self.name, len(self.pending))

    def _send(self, force: bool = False) -> None:
        if self.failed_at is not None and not force and time.monotonic() - self.failed_at < RETRY_S:
            return
        try:
            if self.tracker is None:
                self.tracker = self.make()
            while self.pending:
                method, *arguments = self.pending[0]
                getattr(self.tracker, method)(*arguments)
                self.pending.pop(0)
            self.failed_at = None
        except Exception as error:  # noqa: BLE001 (a tracker never stops training)
            self.failed_at = time.monotonic()
            if not self.warned:
                logger.warning(
                    "%s failed (%s: %s); training goes on, metrics.jsonl holds every step, and the records are sent "
                    "again every %.0f s",
                    self.name,
                    type(error).__name__,
                    str(error).splitlines()[0][:300] if str(error) else "",
                    RETRY_S,
                )
                self.warned = True


def open_trackers(cfg: LoggingConfig, run_dir: Path, config: dict[str, Any], resume_step: int) -> list[Guarded]:
    """The trackers ``cfg`` (``LoggingConfig``) turns on; a missing package is one line naming the extra."""
    for enabled, package, extra in ((cfg.tensorboard, "tensorboard", "tensorboard"), (cfg.mlflow, "mlflow", "mlflow")):
        if enabled and importlib.util.find_spec(package) is None:
            raise ValueError(f"logging.{extra}=true needs the {package} package: pip install 'lctrain[{extra}]'")
    trackers = []
    if cfg.wandb != "disabled":
        trackers.append(Guarded("W&B", lambda: WandbTracker(cfg.wandb_project, cfg.wandb, run_dir, config)))
    if cfg.tensorboard:
        trackers.append(Guarded("TensorBoard", lambda: TensorBoardTracker(run_dir, config, resume_step)))
    if cfg.mlflow:
        make = lambda: MLflowTracker(cfg.mlflow_uri, cfg.mlflow_experiment, run_dir, config, resume_step)  # noqa: E731
        trackers.append(Guarded("MLflow", make))
    return trackers
