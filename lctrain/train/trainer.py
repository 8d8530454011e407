"""The training loop, top to bottom: config -> mesh -> data -> model (patched, checkpointed, sharded) -> loss ->
optimizer -> metrics -> checkpoint.

Launch with ``torchrun ... -m lctrain train recipe=NAME [overrides]``; see ``recipes/`` and ``configs/``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from tqdm import tqdm

from lctrain.attention import SequencePlace
from lctrain.build import build_model, prepare_model, tokenizer_path
from lctrain.checkpoint import Checkpointer, complete_checkpoints
from lctrain.config import JobConfig, to_yaml
from lctrain.data import IGNORE_INDEX, PackedLoader, check_data, load_tokenizer
from lctrain.eval.evaluator import score_rows
from lctrain.flops import flops_per_token
from lctrain.models import export_hf
from lctrain.models.families import layer_windows
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.models.lora import export_lora
from lctrain.parallel.dims import ParallelDims, flat_mesh
from lctrain.parallel.pipeline import build_schedule
from lctrain.runtime import resolve_device, run_command
from lctrain.train.loss import chunked_cross_entropy, chunked_cross_entropy_by_group
from lctrain.train.metrics import MetricsLogger, peak_flops, peak_memory_gib
from lctrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm, step_if_finite
from lctrain.train.stages import check_stages, pending_stages, stage_configs

logger = logging.getLogger("lctrain")

Batch = dict[str, Any]


def position_buckets(seq_len: int) -> list[int]:
    """The edges ``[0, b, 4b, 16b, ..., seq_len]`` of the validation's loss-by-position buckets: ``b`` = 4096, or
    for rows shorter than 64K the largest power of 4 with 16·b <= seq_len, so that there are at least three buckets
    (seq_len 1024: [0, 64), [64, 256), [256, 1024); 131072: [0, 4K), [4K, 16K), [16K, 64K), [64K, 128K))."""
    first = 4096
    while first > 1 and 16 * first > seq_len:
        first //= 4
    edges = [0]
    while first < seq_len:
        edges.append(first)
        first *= 4
    return [*edges, seq_len]


def check_validation(cfg: JobConfig) -> None:
    """The validation settings: one ``ValueError`` naming the setting and the fix."""
    if cfg.train.val_every < 0:
        raise ValueError(f"train.val_every={cfg.train.val_every} must be >= 0 (0 = only at the end)")
    if cfg.train.val_rows < 1:
        raise ValueError(f"train.val_rows={cfg.train.val_rows} must be >= 1")
    if cfg.data.val_sources and cfg.parallel.pp > 1:
        raise ValueError(
            f"data.val_sources with parallel.pp={cfg.parallel.pp}: validation runs without a pipeline; leave "
            f"data.val_sources empty and score the export with `lctrain eval` (tasks=[perplexity])"
        )


class Trainer:
    """Builds everything from a ``JobConfig`` on an initialized default process group, then ``train()``."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = resolve_device(cfg.train.device)
        self.run_dir = Path(cfg.train.run_dir)

        # 1. the model's tokenizer, config and weights source, checked against the job before any collective
        prepared = prepare_model(cfg, world_size)
        self.tokenizer, self.hf_config = prepared.tokenizer, prepared.config

        # 2. mesh: pp × dp × ring × ulysses; dp_cp (flattened) is where parameters are sharded and losses reduced
        par = cfg.parallel
        self.dims = ParallelDims.from_config(par)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.place = SequencePlace.from_mesh(self.mesh, self.dims.layout)  # this rank's (ring, ulysses) part
        self.dp_cp_group = flat_mesh(self.mesh, "dp_cp").get_group()
        self.pp_group = self.mesh.get_group("pp") if self.dims.pp > 1 else None
        torch.manual_seed(cfg.train.seed)

        # 3. data: this rank's dp shard of the rows, cut to its place; the validation rows (every rank the same rows)
        self.loader = PackedLoader(
            dataclasses.replace(cfg.data, tokenizer=tokenizer_path(cfg)),
            dp_rank=self.mesh.get_local_rank("dp"),
            dp_size=self.dims.dp,
            place=self.place,
        )
        self.sources = self.loader.names  # with several, each step reports loss/<name> and tokens/<name>
        check_validation(cfg)
        self.val_names = [source.name for source in cfg.data.val_sources]
        self.val_edges = position_buckets(cfg.data.seq_len)
        self.val_rows, self.val_groups = self._validation_rows() if self.val_names else ([], [])

        # 4. model (lctrain.build). With pp > 1 the schedule runs this rank's stage modules, and self.model is their
        # parts under Hugging Face names, for the optimizer, clipping, checkpoints and export.
        built = build_model(cfg, prepared, self.mesh, self.device, training=True, stage_loss=self._loss_sum)
        self.model, num_params = built.model, built.num_params
        self.schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None
        if built.stages:
            self.schedule = build_schedule(
                built.stages,
                self.mesh["pp"],
                schedule=par.pp_schedule,
                microbatches=cfg.data.batch_size * cfg.train.grad_accum,
                device=self.device,
                loss_fn=self._pipeline_loss,
            )
        else:
            self.hidden_states = FinalHiddenStates(self.model)
        self._valid_tokens = torch.ones((), device=self.device)
        # the step's trained tokens over dp_cp: the total, then per source (with several); the per-source loss sums
        self._step_tokens = torch.ones(1, dtype=torch.int64, device=self.device)
        sums = len(self.sources) if len(self.sources) > 1 else 0
        self._source_loss = torch.zeros(sums, dtype=torch.float64, device=self.device)

        # 5. optimizer, schedule, checkpoints, metrics
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self.step = 0
        self._resume()
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.metrics = MetricsLogger(
            cfg.logging, self.run_dir, rank=self.rank, resume_step=self.step, job_config=dataclasses.asdict(cfg)
        )
        config = self.hf_config
        self.flops_per_token = flops_per_token(
            num_params, config.num_hidden_layers, config.hidden_size, cfg.data.seq_len, layer_windows(config)
        )
        self.peak_flops = peak_flops(self.device, cfg.train.peak_tflops)
        logger.info(
            "model %s: %.2fM parameters, mesh %s, seq_len %d, device %s",
            config.model_type,
            num_params / 1e6,
            self.dims,
            cfg.data.seq_len,
            self.device,
        )

    def _validation_rows(self) -> tuple[list[Batch], list[Tensor]]:
        """``train.val_rows`` rows of ``data.val_sources`` (this rank's part of each, the same rows on every dp rank),
        packed with ``truncate``: every row starts at a document start, so a token's position is the context it is
        predicted from. Each token's group: its source x its position bucket (``position_buckets``)."""
        cfg = self.cfg
        data = dataclasses.replace(
            cfg.data,
            tokenizer=tokenizer_path(cfg),
            paths=[],
            dataset=None,
            sources=cfg.data.val_sources,
            val_sources=[],
            batch_size=1,
            truncate=True,
        )
        rows = iter(PackedLoader(data, place=self.place))
        batches = [next(rows) for _ in range(cfg.train.val_rows)]
        inner = torch.tensor(self.val_edges[1:-1])
        buckets = len(self.val_edges) - 1
        groups = [
            batch["sources"].long() * buckets + torch.bucketize(batch["position_ids"], inner, right=True)
            for batch in batches
        ]
        return batches, groups

    def validate(self) -> dict[str, Any]:
        """The validation rows scored on the training mesh without gradients (``lctrain.eval.evaluator.score_rows``):
        ``val_loss`` (the token mean), ``val_tokens``, ``val_loss_by_position`` (``"a-b"``: the mean loss of the
        tokens predicted at document positions [a, b); None where there is none) and, with several validation
        sources, ``val_loss/<name>``. Reads the sums back to the host."""
        buckets = len(self.val_edges) - 1
        totals = score_rows(
            self.hidden_states,
            self.val_rows,
            groups=self.val_groups,
            num_groups=len(self.val_names) * buckets,
            dp_rank=self.mesh.get_local_rank("dp"),
            dp=self.dims.dp,
            group=self.dp_cp_group,
            device=self.device,
            chunk_tokens=self.cfg.train.loss_chunk_tokens,
        )
        sums = totals.view(len(self.val_names), buckets, 2).cpu()  # [source, bucket, (NLL, tokens)]

        def mean(part: Tensor) -> float | None:
            nll, tokens = part.reshape(-1, 2).sum(0).tolist()
            return nll / tokens if tokens else None

        edges = self.val_edges
        result = {
            "val_loss": mean(sums),
            "val_tokens": int(sums[..., 1].sum()),
            "val_loss_by_position": {f"{edges[b]}-{edges[b + 1]}": mean(sums[:, b]) for b in range(buckets)},
        }
        if len(self.val_names) > 1:
            result.update({f"val_loss/{name}": mean(sums[i]) for i, name in enumerate(self.val_names)})
        return result

    def _loss_sum(self, hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
        """The token-summed loss of ``hidden`` ``[..., H]`` against ``labels`` ``[...]`` (the chunked loss)."""
        return chunked_cross_entropy(hidden, weight, labels, chunk_tokens=self.cfg.train.loss_chunk_tokens)[0]

    def _pipeline_loss(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the last stage computes the token-summed loss itself (inside its FSDP forward, where the LM head is
        # gathered); the schedule still passes each micro-batch's target, unused here
        return loss_sum / self._valid_tokens

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
            source_rank = self.mesh.get_local_rank("dp") * saved["ring"] * saved["ulysses"]
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

    def _to_device(self, tensor: Tensor) -> Tensor:
        """A host tensor of the batch on the device, without waiting for the device (a blocking copy would wait for
        all queued work): the copy is queued behind it."""
        return tensor.to(self.device, non_blocking=True)

    def forward_loss_sum(self, batch: Batch, row: int) -> torch.Tensor:
        """The token-summed loss of one row of this rank's micro-batch (``[1, S_local]`` tokens). With several
        sources, the row's loss sums per source are added to the step's (``_source_loss``), from the same chunks."""
        rows = slice(row, row + 1)
        hidden = self.hidden_states(
            self._to_device(batch["input_ids"][rows]),
            self._to_device(batch["position_ids"][rows]),
            batch["cu_seqlens"][row],  # on the host: the attention plans its blocks from it
        )
        # the LM head was all-gathered by the root's forward and is kept for its backward
        labels = self._to_device(batch["labels"][rows])
        if len(self.sources) == 1:
            return self._loss_sum(hidden, self.model.lm_head.weight, labels)
        total, sums, _ = chunked_cross_entropy_by_group(
            hidden,
            self.model.lm_head.weight,
            labels,
            self._to_device(batch["sources"][rows]),
            len(self.sources),
            chunk_tokens=self.cfg.train.loss_chunk_tokens,
        )
        self._source_loss += sums
        return total

    def forward_backward(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """Accumulate the gradients of the step's global mean loss over ``micro_batches``; returns this rank's share
        of that loss (summed over dp_cp it is the global mean)."""
        # valid tokens of the whole step, summed over dp_cp: each rank's loss is its token sum / this count, so the
        # gradients summed over dp_cp (apply_fsdp) and accumulated over micro-batches are the global mean's. A rank
        # without any adds 0; a step without any changes nothing (optimizer_step). With several sources, their
        # counts travel in the same all-reduce.
        masks = [batch["labels"] != IGNORE_INDEX for batch in micro_batches]
        counts = [sum(mask.sum() for mask in masks).view(1)]
        if len(self.sources) > 1:
            sources = [batch["sources"][mask].long() for batch, mask in zip(micro_batches, masks)]
            counts.append(sum(torch.bincount(s, minlength=len(self.sources)) for s in sources))
        self._step_tokens = self._to_device(torch.cat(counts))
        dist.all_reduce(self._step_tokens, group=self.dp_cp_group)
        self._source_loss = torch.zeros_like(self._source_loss)
        valid = self._step_tokens[0].clamp(min=1)
        if self.schedule is not None:
            return self._pipeline_forward_backward(micro_batches, valid)
        loss = torch.zeros((), device=self.device)
        for batch in micro_batches:
            for row in range(batch["input_ids"].shape[0]):
                row_loss = self.forward_loss_sum(batch, row) / valid
                row_loss.backward()
                loss += row_loss.detach()
        return loss

    def _pipeline_forward_backward(self, micro_batches: Sequence[Batch], valid: torch.Tensor) -> torch.Tensor:
        """One schedule run over every row of the step (each row is a pipeline micro-batch); returns this rank's
        share of the global mean loss (0 off the last stage)."""
        rows = {key: torch.cat([b[key] for b in micro_batches]) for key in ("input_ids", "position_ids", "labels")}
        bounds = [row_bounds for batch in micro_batches for row_bounds in batch["cu_seqlens"]]
        self._valid_tokens = valid
        losses: list[torch.Tensor] = []
        labels = self._to_device(rows["labels"])
        self.schedule.step(
            self._to_device(rows["input_ids"]),
            position_ids=self._to_device(rows["position_ids"]),
            cu_seqlens=torch.nn.utils.rnn.pad_sequence(bounds, batch_first=True, padding_value=-1),
            labels=labels,
            target=labels,
            losses=losses,
            return_outputs=False,
        )
        return sum((loss.detach() for loss in losses), torch.zeros((), device=self.device))

    def optimizer_step(self) -> torch.Tensor:
        """Clip by the global gradient norm (over all shards and pipeline stages), step AdamW and the schedule;
        returns the norm. Reads nothing back to the host.

        With a NaN/inf norm (the same on every rank) AdamW's update is skipped on the device (``step_if_finite``:
        parameters and optimizer state stay those of the previous step); the schedule still advances, so steps and
        learning rates stay aligned. ``train_step`` then stops the job or, with ``train.nonfinite=skip``, goes on.
        """
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.max_grad_norm, pp_group=self.pp_group)
        # a step without a trained token (every label masked on every rank) is skipped like a non-finite one (with
        # parallel.cpu_offload the norm and the step are on the host, which waits for the gradients anyway)
        trained = self._step_tokens[0].to(grad_norm.device) > 0
        step_if_finite(self.optimizer, torch.where(trained, grad_norm, torch.nan))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_step(self, micro_batches: Sequence[Batch]) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns the global mean loss and the grad norm
        (with several sources also ``loss/<name>``, the token mean of that source's trained tokens in the step, and
        ``tokens/<name>``, their number), read back to the host together: the step's one host sync."""
        loss = self.forward_backward(micro_batches)
        grad_norm = self.optimizer_step()
        # the last stage's shares over dp_cp (other pipeline stages add 0), with the per-source loss sums
        shares = loss.view(1) if not len(self._source_loss) else torch.cat([loss.view(1).double(), self._source_loss])
        dist.all_reduce(shares)
        # the norm is on the host already with parallel.cpu_offload (the gradients are there)
        norm = grad_norm.to(loss.device, non_blocking=True).view(1)
        loss_value, norm_value, trained, *per_source = torch.cat(
            [shares[:1], norm.to(shares.dtype), self._step_tokens.to(shares.dtype), shares[1:]]
        ).tolist()
        if not trained:
            logger.warning(
                "step %d: no trained token in this step (every label is masked on every rank): update skipped",
                self.step + 1,
            )
        if not math.isfinite(norm_value):
            if self.cfg.train.nonfinite == "stop":
                raise FloatingPointError(
                    f"step {self.step + 1}: the gradient norm is {norm_value} (a NaN/inf loss or gradient); stopped "
                    f"without updating, so the last checkpoint is intact. Set train.nonfinite=skip to skip such steps"
                )
            logger.warning("step %d: the gradient norm is %s: update skipped", self.step + 1, norm_value)
        result = {"loss": loss_value, "grad_norm": norm_value}
        tokens, sums = per_source[: len(per_source) // 2], per_source[len(per_source) // 2 :]
        for name, count, total in zip(self.sources, tokens, sums):
            known = count and self.schedule is None  # the pipeline's last stage computes the total only
            result.update({f"loss/{name}": total / count if known else None, f"tokens/{name}": int(count)})
        return result

    def train(self) -> list[float]:
        """Run to ``train.steps``; returns the losses of the steps run here."""
        cfg = self.cfg
        batches: Iterator[Batch] = iter(self.loader)
        tokens_per_step = cfg.data.seq_len * cfg.data.batch_size * cfg.train.grad_accum * self.dims.dp
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.step,
            disable=self.rank != 0 or not cfg.logging.progress_bar,
            dynamic_ncols=True,
        )
        losses = []
        while self.step < cfg.train.steps:
            start = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]
            result = self.train_step([next(batches) for _ in range(cfg.train.grad_accum)])
            self.step += 1
            elapsed = time.perf_counter() - start
            tokens_per_s = tokens_per_step / elapsed
            devices = dist.get_world_size()
            mfu = None if self.peak_flops is None else tokens_per_s * self.flops_per_token / (devices * self.peak_flops)
            val_every = cfg.train.val_every
            validation = bool(self.val_rows) and (
                self.step == cfg.train.steps or (val_every > 0 and self.step % val_every == 0)
            )
            line = self.metrics.log(
                self.step,
                {
                    **result,
                    "lr": lr,
                    "tokens_per_s": tokens_per_s,
                    "mfu": mfu,
                    "peak_mem_gib": peak_memory_gib(self.device),
                    "step_time_s": elapsed,
                    **(self.validate() if validation else {}),
                },
            )
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
        self.metrics.close()
        return losses

    def export(self) -> None:
        """The trained model as a Hugging Face directory, ``<run_dir>/hf``; with LoRA the adapter in peft's format,
        ``<run_dir>/adapter``, and (``checkpoint.export_merged``) the merged model in ``hf/``."""
        cfg, parts = self.cfg, {"part": self.mesh.get_local_rank("pp"), "num_parts": self.dims.pp}
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
            logger.info("Hugging Face model written to %s", self.run_dir / "hf")

    def _log_skipped(self) -> None:
        """One line with the records the loaders skipped (conversations longer than a row, or without a trained
        token), the conversations rendered once per trained turn and the turns left out, summed over the dp ranks
        (the context-parallel ranks of a dp rank read the same ones)."""
        skipped = self.loader.skipped()
        counts = torch.tensor([list(c.values()) for c in skipped.values()], device=self.device)
        dist.all_reduce(counts, group=self.mesh.get_group("dp"))
        if self.rank == 0 and counts.any():
            lines = [
                f"{overlong} conversations longer than data.seq_len dropped (data.overlong=drop), {untrained} without "
                f"a trained token skipped, {divergent} rendered once per divergent turn (data.divergent_turns), "
                f"{unreachable} turns no generation prompt leads to left out (data.unreachable_turns=skip)"
                + (f" ({name})" if len(skipped) > 1 else "")
                for name, (overlong, untrained, divergent, unreachable) in zip(skipped, counts.tolist())
            ]
            logger.info("data: %s", "; ".join(lines))


def check(cfg: JobConfig, world_size: int) -> None:
    """Every stage of the job (one, without ``train.stages``) checked against its model and its data, before any
    process group exists: ``ValueError`` or ``FileNotFoundError`` naming the setting."""
    if cfg.train.stages:
        check_stages(cfg, world_size)
        tokenizer = load_tokenizer(tokenizer_path(cfg))
    else:
        tokenizer = prepare_model(cfg, world_size).tokenizer
    for job in stage_configs(cfg):
        check_validation(job)
        check_data(job.data, tokenizer)


def train(cfg: JobConfig) -> None:
    """The job (or the unfinished stages of ``train.stages``), on the initialized default process group."""
    jobs = pending_stages(cfg)  # [cfg], or the unfinished stages of train.stages
    for job in jobs:
        Trainer(job).train()  # from stage 1 on, starts from the previous stage's export


def latest_checkpoint(cfg: JobConfig) -> Path | None:
    checkpoints = complete_checkpoints(Path(cfg.train.run_dir) / "checkpoints")
    return checkpoints[-1] if checkpoints else None


def main(argv: Sequence[str]) -> None:
    """The ``train`` command (``lctrain.runtime.run_command``: errors and faults end with one line and exit 1)."""
    run_command(argv, check=check, job=train, checkpoints=latest_checkpoint)
