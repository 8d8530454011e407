"""The trackers beside metrics.jsonl, read back with their own readers: TensorBoard's event files (its
``EventAccumulator``) and MLflow's runs (``MlflowClient``: a local directory, and a real ``mlflow server`` on
localhost with a SQLite store), several at once; the metrics, the config as parameters, the plots and the exported
model's path; a resumed run continuing the same run; a tracker that cannot be reached warned about once, the run going
on, and what it missed sent when it is back."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lctrain.config import LoggingConfig
from lctrain.train import trackers
from lctrain.train.metrics import MetricsLogger

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

JOB = {"optim": {"lr": 0.001, "betas": [0.9, 0.95]}, "data": {"seq_len": 64, "tokenizer": None}}


def record(step: int, resumed: bool = False) -> dict:
    """A step's metrics, as the trainer gives them (a validation's dict, None values, another loss when resumed)."""
    loss = 10.0 - step + (0.5 if resumed else 0.0)
    metrics = {"loss": loss, "loss/text": loss + 1, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None}
    metrics["peak_mem_gib"] = 0.1
    if step % 2 == 0:
        metrics |= {"val_loss": loss - 1, "val_loss_by_position": {"0-64": loss - 2, "64-256": None}}
    return metrics


def run(cfg: LoggingConfig, run_dir: Path, steps: range, resume_step: int = 0, resumed: bool = False) -> None:
    logger = MetricsLogger(cfg, run_dir, rank=0, resume_step=resume_step, job_config=JOB)
    for step in steps:
        logger.log(step, record(step, resumed))
    logger.close(exported=run_dir / "hf")


def mlflow_history(uri: str, run_dir: Path, key: str) -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history((run_dir / "mlflow_run_id").read_text(), key)
    return sorted((m.step, m.value) for m in history)


@pytest.mark.slow
def test_tensorboard_and_mlflow_at_once_and_resumed(tmp_path: Path) -> None:
    cfg = LoggingConfig(tensorboard=True, mlflow=True, plot=True)
    run(cfg, tmp_path, range(1, 5))
    first_run = (tmp_path / "mlflow_run_id").read_text()
    run(cfg, tmp_path, range(3, 7), resume_step=2, resumed=True)  # steps 3-4 again, then on
    assert (tmp_path / "mlflow_run_id").read_text() == first_run  # the same MLflow run

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    want = [(1, 9.0), (2, 8.0)] + [(step, 10.5 - step) for step in range(3, 7)]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == want  # the resumed steps replaced the old ones
    assert [(e.step, e.value) for e in events.Scalars("val_loss_by_position/0-64")] == [(2, 6.0), (4, 4.5), (6, 2.5)]
    assert "val_loss_by_position/64-256" not in events.Tags()["scalars"] and "mfu" not in events.Tags()["scalars"]
    assert "loss" in events.Tags()["images"] and {"config/text_summary", "exported_model/text_summary"} <= set(
        events.Tags()["tensors"]
    )

    uri = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    history = mlflow_history(uri, tmp_path, "loss/text")
    assert history[:2] == [(1, 10.0), (2, 9.0)] and history[-1] == (6, 5.5)
    assert {(3, 8.0), (3, 8.5)} <= set(history)  # MLflow keeps both records of a step run again
    finished = MlflowClient(tracking_uri=uri).get_run(first_run)
    assert finished.data.params["optim.lr"] == "0.001" and finished.data.params["optim.betas"] == "[0.9, 0.95]"
    assert finished.data.tags["exported_model"] == str(tmp_path / "hf") and finished.info.status == "FINISHED"
    artifacts = [a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(first_run)]
    assert artifacts == ["loss.png", "val_loss.png"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]


def test_a_missing_package_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ValueError, match=r"logging.mlflow=true needs the mlflow package: pip install 'lctrain\[mlflow\]'"
    ):
        MetricsLogger(LoggingConfig(mlflow=True), tmp_path, rank=0, resume_step=0, job_config=JOB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` on localhost with a SQLite store under ``root``, once it answers; one worker process (its
    default is 4, each importing MLflow's server anew)."""
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root / 'store.db'}", "--artifacts-destination", str(root / "art")]
    server = subprocess.Popen(
        command, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            assert server.poll() is None, "mlflow server exited"
            time.sleep(0.5)
    stop(server)
    pytest.fail("mlflow server did not answer in 180 s")


def stop(server: subprocess.Popen) -> None:
    """SIGKILL the server and the workers it started (its session): gone at once, as a crashed server."""
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=60)


@pytest.mark.slow
def test_a_server_that_goes_away_mid_run_loses_nothing(tmp_path: Path, monkeypatch, caplog) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        cfg = LoggingConfig(mlflow=True, mlflow_uri=uri, mlflow_experiment="served", plot=True)
        logger = MetricsLogger(cfg, run_dir, rank=0, resume_step=0, job_config=JOB)
        for step in (1, 2, 3):
            logger.log(step, record(step))
        stop(server)
        with caplog.at_level(logging.WARNING, logger="lctrain"):
            for step in (4, 5, 6):  # the server is gone: warned once, the run goes on
                logger.log(step, record(step))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and warnings[0].startswith("MLflow failed (") and "training goes on" in warnings[0]
        server = start_server(tmp_path, port)
        monkeypatch.setattr(trackers, "RETRY_S", 0.0)
        logger.log(7, record(7))  # back: what it missed is sent now
        logger.close(exported=run_dir / "hf")
        assert mlflow_history(uri, run_dir, "loss") == [(step, 10.0 - step) for step in range(1, 8)]
        client = MlflowClient(tracking_uri=uri)
        finished = client.get_run((run_dir / "mlflow_run_id").read_text())
        assert finished.data.params["data.seq_len"] == "64" and finished.info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(finished.info.run_id)] == ["loss.png", "val_loss.png"]
    finally:
        if server.poll() is None:
            stop(server)


def test_a_server_never_reached_warns_once_and_the_run_goes_on(tmp_path: Path, caplog) -> None:
    cfg = LoggingConfig(mlflow=True, mlflow_uri=f"http://127.0.0.1:{free_port()}", plot=False)
    with caplog.at_level(logging.WARNING, logger="lctrain"):
        run(cfg, tmp_path, range(1, 4))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "training goes on" in warnings[0]
    assert warnings[1] == "MLflow: 4 records were never sent (metrics.jsonl holds them)"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_step_stored_before_its_request_failed_is_not_logged_twice(tmp_path: Path, monkeypatch, caplog) -> None:
    """A server slower than the client's timeout stores the batch whose request fails: sent again, it is looked up
    first, and MLflow's history holds each step once."""
    log_batch, failed = MlflowClient.log_batch, []

    def stored_then_timed_out(self: MlflowClient, run_id: str, metrics=(), **kwargs) -> None:  # noqa: ANN001
        log_batch(self, run_id, metrics=metrics, **kwargs)
        if not failed and any(metric.step == 2 for metric in metrics):
            failed.append(run_id)
            raise TimeoutError("read timed out")

    monkeypatch.setattr(MlflowClient, "log_batch", stored_then_timed_out)
    monkeypatch.setattr(trackers, "RETRY_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="lctrain"):
        run(LoggingConfig(mlflow=True, plot=False), tmp_path, range(1, 5))
    assert failed and [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"MLflow failed (TimeoutError: read timed out); training goes on, metrics.jsonl holds every step, and the "
        f"records are sent again every {trackers.RETRY_S:.0f} s"
    ]
    uri = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    assert mlflow_history(uri, tmp_path, "loss") == [(step, 10.0 - step) for step in range(1, 5)]
    assert mlflow_history(uri, tmp_path, "val_loss") == [(2, 7.0), (4, 5.0)]


def test_a_run_created_before_its_request_failed_is_adopted_by_the_retry(tmp_path: Path, monkeypatch) -> None:
    """A server slower than the client's timeout creates the run whose request fails: the retried start finds that
    run by its tag, and the experiment holds one run, the one ``mlflow_run_id`` names, with every step."""
    create_run, failed = MlflowClient.create_run, []

    def created_then_timed_out(self: MlflowClient, *args, **kwargs):
        made = create_run(self, *args, **kwargs)
        if not failed:
            failed.append(made.info.run_id)
            raise TimeoutError("read timed out")
        return made

    monkeypatch.setattr(MlflowClient, "create_run", created_then_timed_out)
    monkeypatch.setattr(trackers, "RETRY_S", 0.0)
    run(LoggingConfig(mlflow=True, plot=False), tmp_path, range(1, 4))
    uri = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("lctrain").experiment_id])
    assert failed and [r.info.run_id for r in runs] == failed
    assert (tmp_path / "mlflow_run_id").read_text() == failed[0]
    assert mlflow_history(uri, tmp_path, "loss") == [(step, 10.0 - step) for step in range(1, 4)]
    assert not (tmp_path / "mlflow_start_id").exists()
