"""The job's suite (``ruler`` section) scored through its model: by ``lctrain eval`` on an exported checkpoint or a
base model, and every ``ruler.every`` steps of training on the training mesh (``TrainingSuite``).

Training writes ``<run_dir>/ruler/step_XXXXXXXX/`` (``ruler.json``: the table and the effective length;
``ruler_examples.jsonl``: every example) and ``<run_dir>/ruler.png`` (score against length, one line per scored step),
and returns its figures for ``metrics.jsonl`` and W&B (``lctrain.ruler.report.metrics``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from lctrain.build import Job
from lctrain.config import JobConfig
from lctrain.ruler.report import metrics, plot_curves, read_curve, summarize, table, write_results
from lctrain.ruler.suite import build_suite, check_suite
from lctrain.train.forward import forward_only
from lctrain.train.ruler_score import score_examples

logger = logging.getLogger("lctrain")


def check_job_suite(cfg: JobConfig, tokenizer: PreTrainedTokenizerBase, max_positions: int | None) -> None:
    """The suite of ``cfg`` checked before any process group exists (``lctrain.ruler.suite.check_suite``)."""
    lengths = cfg.ruler.suite_lengths(cfg.data.seq_len)
    check_suite(cfg.ruler, tokenizer, lengths, cfg.parallel.dims(), max_positions)


class SuiteScorer:
    """The suite's examples (made here, on every rank alike) and their scoring through a job's model (``job``:
    ``lctrain.build.build_job``'s) on its mesh."""

    def __init__(self, job: Job):
        cfg = self.cfg = job.cfg
        self.tokenizer, self.device, self.place = job.prepared.tokenizer, job.device, job.mesh.place
        self.dp_rank, self.dp = job.mesh.dp_rank, job.mesh.dims.dp
        # a pipeline runs the rows of a step (its micro-batches) at a time
        self.rows_per_run = cfg.step_rows if job.model.stages else 1
        self.forward = forward_only(job.model, job, self.rows_per_run)
        lengths = cfg.ruler.suite_lengths(cfg.data.seq_len)
        self.pack_tokens = max(lengths)  # shorter examples share rows: no row is longer than the longest example
        self.examples = build_suite(cfg.ruler, self.tokenizer, lengths)

    def score(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(every example's record, the summary), the same on every rank."""
        records = score_examples(
            self.examples,
            self.forward,
            pack_tokens=self.pack_tokens,
            rows_per_run=self.rows_per_run,
            place=self.place,
            dp_rank=self.dp_rank,
            dp=self.dp,
            device=self.device,
            tokenizer=self.tokenizer,
        )
        return records, summarize(records, self.cfg.ruler)

    def meta(self, label: str) -> dict[str, Any]:
        dims = self.cfg.parallel.dims()
        return {
            "label": label,
            "model": self.cfg.model.path,
            "mesh": dims.degrees() | {"layout": dims.layout},
            "ruler": dataclasses.asdict(self.cfg.ruler),
        }


class TrainingSuite:
    """The suite of ``job`` (``lctrain.build.build_job``'s, training) every ``ruler.every`` steps of its run and at
    its last step (never with ``ruler.every=0``); rank 0 writes under ``train.run_dir``."""

    def __init__(self, job: Job, *, rank: int):
        cfg = job.cfg
        run_dir = Path(cfg.train.run_dir)
        self.directory, self.every, self.steps, self.rank = run_dir / "ruler", cfg.ruler.every, cfg.train.steps, rank
        self.plot = run_dir / "ruler.png"
        self.scorer = SuiteScorer(job)

    def should_run(self, step: int) -> bool:
        return step == self.steps or step % self.every == 0

    def run(self, step: int) -> dict[str, Any]:
        """Score the suite now; rank 0 writes the step's files and the plot. Returns the step's figures."""
        records, summary = self.scorer.score()
        if self.rank == 0:
            write_results(self.directory / f"step_{step:08d}", self.scorer.meta(f"step {step}"), summary, records)
            curves = [read_curve(path) for path in sorted(self.directory.glob("step_*/ruler.json"))]
            plot_curves(curves, self.plot, f"{self.directory.parent.name}: score against length")
            logger.info("ruler at step %d:\n%s", step, table(summary))
        return metrics(summary)


def training_suite(job: Job) -> TrainingSuite | None:
    """The run's suite (``ruler.every`` > 0), or None."""
    return TrainingSuite(job, rank=dist.get_rank()) if job.cfg.ruler.every else None
