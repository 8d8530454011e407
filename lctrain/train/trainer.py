"""The training loop, top to bottom, over a job built once (``lctrain.train.job``): data -> model (patched,
checkpointed, sharded) -> loss -> optimizer -> metrics -> checkpoint.

Launch with ``torchrun ... -m lctrain train recipe=NAME [overrides]``; see ``recipes/`` and ``configs/``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from lctrain.build import prepare_model, tokenizer_path
from lctrain.checkpoint import complete_checkpoints
from lctrain.config import JobConfig, to_yaml
from lctrain.config.checks import check_objective_data
from lctrain.data import check_data, load_tokenizer
from lctrain.models import export_hf
from lctrain.models.lora import export_lora
from lctrain.parallel.pipeline import step_inputs
from lctrain.runtime import run_command
from lctrain.train.forward import model_hidden, row_fields
from lctrain.train.job import TrainingJob, build_training_job
from lctrain.train.key_tokens import check_key_window
from lctrain.train.metrics import MetricsLogger
from lctrain.train.objective import Batch, StepTotals
from lctrain.train.optim import clip_grad_norm, step_if_finite
from lctrain.train.ruler_suite import check_job_suite
from lctrain.train.stages import check_stages, pending_stages, stage_configs

logger = logging.getLogger("lctrain")


class Trainer:
    """Runs a ``TrainingJob`` (``lctrain.train.job.build_training_job``) to ``train.steps``: ``train()``."""

    def __init__(self, job: TrainingJob):
        base = job.base
        self.cfg, cfg = base.cfg, base.cfg
        self.rank = dist.get_rank()
        self.device, self.mesh, self.dims = base.device, base.mesh, base.mesh.dims
        self.place, self.pp_group = base.mesh.place, base.mesh.pp
        self.tokenizer, self.hf_config = base.prepared.tokenizer, base.prepared.config
        self.run_dir = Path(cfg.train.run_dir)
        # with pp > 1 the schedule runs this rank's stage modules, and self.model is their parts under Hugging Face
        # names, for the optimizer, clipping, checkpoints and export
        self.model, self.hidden_states, self.schedule = base.model.model, base.model.hidden_states, base.schedule
        self.loader, self.validator, self.objective = job.loader, job.validator, job.objective
        self.optimizer, self.scheduler, self.checkpointer = job.optimizer, job.scheduler, job.checkpointer
        self.suite = job.suite  # the ruler suite every ruler.every steps; None when never
        self.step = 0
        self._resume()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.metrics = MetricsLogger(
            cfg.logging, self.run_dir, rank=self.rank, resume_step=self.step, job_config=dataclasses.asdict(cfg)
        )
        self.meter = job.meter
        config, num_params = self.hf_config, base.model.num_params
        logger.info(
            "model %s: %.2fM parameters, mesh %s, seq_len %d, device %s",
            config.model_type,
            num_params / 1e6,
            self.dims,
            cfg.data.seq_len,
            self.device,
        )

    def _resume(self) -> None:
        """Continue from a checkpoint. On the mesh that saved it, every rank takes its own state back. On another
        mesh with the same ``dp`` (pp, ring and ulysses may change), weights and optimizer state are resharded and
        each rank takes the data position of its dp rank, so the run goes on with the same batches."""
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            return
        path = self.checkpointer.latest() if resume == "auto" else Path(resume)
        if path is None:
            return
        saved, mesh = self.checkpointer.read_extra(path, 0)["mesh"], self.dims.degrees()
        if saved == mesh:
            source_rank = self.rank
        elif saved["dp"] == mesh["dp"]:
            # the saving rank at pp 0, ring 0, ulysses 0 of this rank's dp index: it held this dp rank's data state
            source_rank = self.mesh.dp_rank * saved["ring"] * saved["ulysses"]
            logger.info("checkpoint %s was saved with mesh %s; loading it into mesh %s", path, saved, mesh)
        else:
            raise ValueError(
                f"{path} was saved with parallel.dp={saved['dp']} and this job has parallel.dp={mesh['dp']}: the "
                f"data position of each dp rank cannot carry over; resume with parallel.dp={saved['dp']} (pp, ring "
                f"and ulysses may change)"
            )
        extra = self.checkpointer.read_extra(path, source_rank)
        self.checkpointer.load(path, self.model, self.optimizer)
        self.step = extra["step"]
        self.scheduler.load_state_dict(extra["scheduler"])
        self.loader.load_state_dict(extra["data"])
        torch.set_rng_state(extra["rng"])
        logger.info("resumed from %s at step %d", path, self.step)

    def save_checkpoint(self) -> None:
        extra = {
            "step": self.step,
            "mesh": self.dims.degrees(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
        }
        path = self.checkpointer.save(self.step, self.model, self.optimizer, extra)
        logger.info("checkpoint %s", path)

    def forward_loss(self, batch: Batch, row: int, counts: Tensor) -> Tensor:
        """One row of this rank's micro-batch (``[1, S_local]`` tokens) through the model and the objective:
        ``_share_and_sums``."""
        hidden = model_hidden(self.hidden_states, batch, row, self.device)
        fields = row_fields(batch, row, self.objective.fields, self.device)
        # the LM head was all-gathered by the root's forward and is kept for its backward
        return self._share_and_sums(counts, hidden, self.model.lm_head.weight, fields)

    def _share_and_sums(self, counts: Tensor, hidden: Tensor, weight: Tensor, row: Batch) -> Tensor:
        """The head of a training forward: ``[this rank's share of the step's loss from the row, then the row's
        report sums]`` (fp64 ``[1 + report_size]``; only the share carries a gradient) from the objective."""
        share, sums = self.objective.loss(hidden, weight, row, counts)
        return torch.cat([share.double().view(1), sums])

    def forward_backward(self, micro_batches: Sequence[Batch]) -> StepTotals:
        """Accumulate the gradients of the step's loss over ``micro_batches``; returns the step's totals.

        The objective's counts come first (one all-reduce over its group, e.g. the step's trained tokens over dp_cp);
        each row's share of the step's loss is back-propagated, so the gradients accumulated over the rows and summed
        over dp_cp (apply_fsdp) are the step's loss's. A step without anything to train changes nothing
        (optimizer_step). With a pipeline, one schedule run over every row of the step (each row a pipeline
        micro-batch); the stages before the last report zeros."""
        counts = self.objective.step_counts(micro_batches)
        width = 1 + self.objective.report_size
        if self.schedule is not None:
            inputs = step_inputs(micro_batches, self.objective.fields, self.device)
            rows = inputs["input_ids"].shape[0]
            outputs = self.schedule.step(
                inputs.pop("input_ids"),
                **inputs,
                head=functools.partial(self._share_and_sums, counts),
                target=torch.zeros(rows),
                return_outputs=True,
            )
            totals = torch.zeros(width, dtype=torch.float64, device=self.device)
            if outputs is not None:  # the last stage: every row's output, concatenated
                totals = outputs.detach().view(rows, width).sum(0)
        else:
            totals = torch.zeros(width, dtype=torch.float64, device=self.device)
            for batch in micro_batches:
                for row in range(batch["input_ids"].shape[0]):
                    output = self.forward_loss(batch, row, counts)
                    output[0].backward()
                    totals += output.detach()
        return StepTotals(totals[0].float(), counts, totals[1:])

    def optimizer_step(self, trained: Tensor) -> Tensor:
        """Clip by the global gradient norm (over all shards and pipeline stages), step AdamW and the schedule;
        returns the norm. ``trained``: the step had something to train (``StepTotals.trained``, on the device); a
        step without is skipped like a non-finite one. Reads nothing back to the host.

        With a NaN/inf norm (the same on every rank) AdamW's update is skipped on the device (``step_if_finite``:
        parameters and optimizer state stay those of the previous step); the schedule still advances, so steps and
        learning rates stay aligned. ``train_step`` then stops the job or, with ``train.nonfinite=skip``, goes on.
        """
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.max_grad_norm, pp_group=self.pp_group)
        # with parallel.cpu_offload the norm and the step are on the host, which waits for the gradients anyway
        step_if_finite(self.optimizer, torch.where(trained.to(grad_norm.device), grad_norm, torch.nan))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_step(self, micro_batches: Sequence[Batch]) -> dict[str, float | None]:
        """One optimizer step over ``grad_accum`` micro-batches; returns the global mean loss, the grad norm and the
        objective's report (with several sources ``loss/<name>`` and ``tokens/<name>``), read back to the host
        together: the step's one host sync."""
        step = self.forward_backward(micro_batches)
        grad_norm = self.optimizer_step(step.trained)
        # the ranks' loss shares and report sums, summed (off a pipeline's last stage they are 0)
        shares = torch.cat([step.loss.view(1).double(), step.sums])
        dist.all_reduce(shares)
        # the norm is on the host already with parallel.cpu_offload (the gradients are there)
        norm = grad_norm.to(shares.device, non_blocking=True).view(1).double()
        values = torch.cat([shares[:1], norm, step.counts.double(), shares[1:]]).tolist()
        counted = 2 + len(step.counts)
        loss, norm_value, counts, sums = values[0], values[1], values[2:counted], values[counted:]
        if not counts[0]:
            logger.warning(
                "step %d: no %s in this step on any rank: update skipped", self.step + 1, self.objective.counted
            )
        if not math.isfinite(norm_value):
            if self.cfg.train.nonfinite == "stop":
                raise FloatingPointError(
                    f"step {self.step + 1}: the gradient norm is {norm_value} (a NaN/inf loss or gradient); stopped "
                    f"without updating, so the last checkpoint is intact. Set train.nonfinite=skip to skip such steps"
                )
            logger.warning("step %d: the gradient norm is %s: update skipped", self.step + 1, norm_value)
        return {"loss": loss, "grad_norm": norm_value, **self.objective.report(counts, sums)}

    def train(self) -> list[float]:
        """Run to ``train.steps``; returns the losses of the steps run here."""
        cfg = self.cfg
        batches: Iterator[Batch] = iter(self.loader)
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.step,
            disable=self.rank != 0 or not cfg.logging.progress_bar,
            dynamic_ncols=True,
        )
        losses = []
        while self.step < cfg.train.steps:
            lr = self.scheduler.get_last_lr()[0]
            with self.meter.measure() as figures:  # time, tokens/s, MFU and this step's peak memory
                result = self.train_step([next(batches) for _ in range(cfg.train.grad_accum)])
            self.step += 1
            validation = self.validator.should_validate(self.step)
            ruler = self.suite.run(self.step) if self.suite and self.suite.should_run(self.step) else {}
            line = self.metrics.log(
                self.step,
                {
                    **result,
                    "lr": lr,
                    **figures,
                    **(self.validator.validate(self.hidden_states, self.objective) if validation else {}),
                    **ruler,
                },
            )
            if ruler:  # the effective length in the progress bar and the step's line
                bar.set_postfix_str(f"effective length {ruler['ruler/effective_length']}")
                line = line and f"{line} | effective length {ruler['ruler/effective_length']}"
            if line is not None:
                logger.info(line)  # through tqdm.write (lctrain.runtime.setup_logging): the bar stays below
            bar.update(1)
            losses.append(result["loss"])
            every = cfg.checkpoint.every
            if self.step == cfg.train.steps or (every and self.step % every == 0):
                self.save_checkpoint()
        bar.close()
        self._log_skipped()
        if cfg.checkpoint.export_hf:
            self.export()
        adapter_only = cfg.model.lora.rank and not cfg.checkpoint.export_merged
        self.metrics.close(self.run_dir / ("adapter" if adapter_only else "hf") if cfg.checkpoint.export_hf else None)
        return losses

    def export(self) -> None:
        """The trained model as a Hugging Face directory, ``<run_dir>/hf``; with LoRA the adapter in peft's format,
        ``<run_dir>/adapter``, and (``checkpoint.export_merged``) the merged model in ``hf/``."""
        cfg = self.cfg
        parts = {
            "part": self.mesh.pp_rank,
            "num_parts": self.dims.pp,
            "layout": cfg.checkpoint.export_layout,
        }
        if cfg.model.lora.rank:
            merged = cfg.checkpoint.export_merged
            export_lora(
                self.model,
                self.hf_config,
                cfg.model.lora,
                self.run_dir,
                self.tokenizer,
                base_path=cfg.model.path,
                merged=merged,
                pp_group=self.pp_group,
                **parts,
            )
            logger.info("LoRA adapter (peft) written to %s", self.run_dir / "adapter")
        else:
            merged = True
            export_hf(self.model, self.hf_config, self.run_dir / "hf", tokenizer=self.tokenizer, **parts)
        if merged:
            logger.info(
                "Hugging Face model written to %s (%s layout)", self.run_dir / "hf", cfg.checkpoint.export_layout
            )

    def _log_skipped(self) -> None:
        """One line with the loader's counts (``PackedLoader.skipped_line``: records skipped, conversations rendered
        once per trained turn, turns left out), summed over the dp ranks (the context-parallel ranks of a dp rank
        read the same ones)."""
        skipped = self.loader.skipped()
        counts = torch.tensor([list(c.values()) for c in skipped.values()], device=self.device)
        dist.all_reduce(counts, group=self.mesh.dp)
        summed = {name: dict(zip(c, total)) for (name, c), total in zip(skipped.items(), counts.tolist())}
        line = self.loader.skipped_line(summed)
        if self.rank == 0 and line:
            logger.info("data: %s", line)


def check(cfg: JobConfig, world_size: int) -> None:
    """Every stage of the job (one, without ``train.stages``) checked against its model and its data, before any
    process group exists: ``ValueError`` or ``FileNotFoundError`` naming the setting."""
    if cfg.train.stages:
        check_stages(cfg, world_size)
        tokenizer, max_positions = load_tokenizer(tokenizer_path(cfg)), None
    else:
        prepared = prepare_model(cfg, world_size)
        tokenizer, max_positions = prepared.tokenizer, prepared.config.max_position_embeddings
    for job in stage_configs(cfg):
        check_objective_data(job.objective.name, check_data(job.data, tokenizer))
        check_key_window(job.train.val_key_window, job.data.seq_len)
        if job.ruler.every:
            check_job_suite(job, tokenizer, max_positions)


def train(cfg: JobConfig) -> None:
    """The job (or the unfinished stages of ``train.stages``), on the initialized default process group."""
    jobs = pending_stages(cfg)  # [cfg], or the unfinished stages of train.stages
    for job in jobs:
        Trainer(build_training_job(job)).train()  # from stage 1 on, starts from the previous stage's export


def latest_checkpoint(cfg: JobConfig) -> Path | None:
    checkpoints = complete_checkpoints(Path(cfg.train.run_dir) / "checkpoints")
    return checkpoints[-1] if checkpoints else None


def main(argv: Sequence[str]) -> None:
    """The ``train`` command (``lctrain.runtime.run_command``: errors and faults end with one line and exit 1)."""
    run_command(argv, check=check, job=train, checkpoints=latest_checkpoint)
