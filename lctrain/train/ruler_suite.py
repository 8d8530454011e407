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

from transformers import PreTrainedTokenizerBase

from lctrain.attention import SequencePlace
from lctrain.config import JobConfig
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.ruler.report import metrics, plot_curves, read_curve, summarize, table, write_results
from lctrain.ruler.suite import build_suite, check_suite
from lctrain.train.forward import RowsForward
from lctrain.train.reference import rows_forward
from lctrain.train.ruler_score import score_examples

logger = logging.getLogger("lctrain")


def check_job_suite(cfg: JobConfig, tokenizer: PreTrainedTokenizerBase, max_positions: int | None) -> None:
    """The suite of ``cfg`` checked before any process group exists (``lctrain.ruler.suite.check_suite``)."""
    lengths = cfg.ruler.suite_lengths(cfg.data.seq_len)
    check_suite(cfg.ruler, tokenizer, lengths, cfg.parallel.dims(), max_positions)


class SuiteScorer:
    """The suite's examples (made here, on every rank alike) and their scoring through a built model (a
    ``lctrain.build.BuiltModel`` and its ``hidden_states``, None with pipeline stages) on ``mesh``."""

    def __init__(
        self,
        cfg: JobConfig,
        tokenizer: PreTrainedTokenizerBase,
        built: Any,
        hidden_states: FinalHiddenStates | None,
        mesh: Any,
        place: SequencePlace,
        device: Any,
    ):
        self.cfg, self.tokenizer, self.place, self.device = cfg, tokenizer, place, device
        self.built, self.hidden_states, self.mesh = built, hidden_states, mesh
        lengths = cfg.ruler.suite_lengths(cfg.data.seq_len)
        self.examples = build_suite(cfg.ruler, tokenizer, lengths)
        self.pack_tokens = max(lengths)  # shorter examples share rows: no row is longer than the longest example
        self.forwards: dict[int, RowsForward] = {}
        self.dp_rank, self.dp = mesh.get_local_rank("dp"), mesh["dp"].size()
        # a pipeline runs the rows of a step (its micro-batches) at a time; one schedule per row length (its shapes)
        self.rows_per_run = cfg.data.batch_size * cfg.train.grad_accum if built.stages else 1

    def forward_for(self, length: int) -> RowsForward:
        if length not in self.forwards:
            self.forwards[length] = rows_forward(self.built, self.hidden_states, self.cfg, self.mesh, self.device)
        return self.forwards[length]

    def score(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(every example's record, the summary), the same on every rank."""
        records = score_examples(
            self.examples,
            self.forward_for,
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
    """The suite every ``ruler.every`` steps of a run and at its last step (never with ``ruler.every=0``)."""

    def __init__(self, scorer: SuiteScorer, run_dir: Path, *, every: int, steps: int, rank: int):
        self.scorer, self.directory, self.every, self.steps, self.rank = scorer, run_dir / "ruler", every, steps, rank
        self.plot = run_dir / "ruler.png"

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


def training_suite(cfg: JobConfig, tokenizer: PreTrainedTokenizerBase, built: Any, hidden_states: Any, mesh: Any,
                   place: SequencePlace, device: Any, rank: int) -> TrainingSuite | None:  # fmt: skip
    """The run's suite (``ruler.every`` > 0), or None."""
    if not cfg.ruler.every:
        return None
    scorer = SuiteScorer(cfg, tokenizer, built, hidden_states, mesh, place, device)
    return TrainingSuite(scorer, Path(cfg.train.run_dir), every=cfg.ruler.every, steps=cfg.train.steps, rank=rank)
