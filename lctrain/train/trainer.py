"""The training loop, top to bottom: config -> mesh -> data -> model (patched, checkpointed, sharded) -> loss ->
optimizer -> metrics -> checkpoint.

Launch with ``torchrun ... -m lctrain train recipe=NAME [overrides]``; see ``configs/`` and ``recipes/``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from tqdm import tqdm

from lctrain.config import JobConfig, check_model_job, load_config, to_yaml
from lctrain.data import IGNORE_INDEX, PackedLoader, load_tokenizer
from lctrain.models import (
    build_empty_model,
    export_hf,
    materialize,
    model_config,
    patch_attention,
    random_init_source,
    safetensors_source,
)
from lctrain.models.chunked_mlp import apply_chunked_mlp
from lctrain.parallel.activation_checkpointing import apply_activation_checkpointing
from lctrain.parallel.dims import ParallelDims, flat_mesh
from lctrain.parallel.fsdp import apply_fsdp
from lctrain.parallel.pipeline import apply_pipeline, build_schedule, merge_stages
from lctrain.train.checkpoint import Checkpointer, complete_checkpoints
from lctrain.train.loss import chunked_cross_entropy
from lctrain.train.metrics import MetricsLogger, flops_per_token, peak_flops, peak_memory_gib, setup_logging
from lctrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from lctrain.train.stages import pending_stages

logger = logging.getLogger("lctrain")

Batch = dict[str, Any]


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but CUDA is not available: set train.device=cpu (or auto)")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Trainer:
    """Builds everything from a ``JobConfig`` on an initialized default process group, then ``train()``."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = resolve_device(cfg.train.device)
        self.run_dir = Path(cfg.train.run_dir)

        # 1. config: checked against the world size and the model before any collective
        if cfg.model.path is not None and cfg.data.tokenizer is None:
            cfg.data.tokenizer = cfg.model.path  # fine-tuning a checkpoint: its own tokenizer
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.hf_config = model_config(cfg.model, len(self.tokenizer))
        if self.hf_config.vocab_size < len(self.tokenizer):
            raise ValueError(
                f"the tokenizer (data.tokenizer={cfg.data.tokenizer}) has {len(self.tokenizer)} tokens but the model "
                f"{cfg.model.path} only {self.hf_config.vocab_size} embeddings: use the model's own tokenizer"
            )
        check_model_job(cfg, world_size, self.hf_config, len(self.tokenizer))
        if cfg.model.path is not None:  # fail before any work if the weights are missing
            source = safetensors_source(cfg.model.path)
        else:
            source = random_init_source(self.hf_config, cfg.train.seed)

        # 2. mesh: pp × dp × ring × ulysses; dp_cp (flattened) is where parameters are sharded and losses reduced
        par = cfg.parallel
        self.mesh = ParallelDims(pp=par.pp, dp=par.dp, ring=par.ring, ulysses=par.ulysses).build_mesh(self.device.type)
        dp_cp_mesh = flat_mesh(self.mesh, "dp_cp")
        self.dp_cp_group = dp_cp_mesh.get_group()
        self.pp_group = self.mesh.get_group("pp") if par.pp > 1 else None
        torch.manual_seed(cfg.train.seed)

        # 3. data: this rank's dp shard of the rows, cut to its (ring, ulysses) part
        self.loader = PackedLoader(
            cfg.data,
            dp_rank=self.mesh.get_local_rank("dp"),
            dp_size=par.dp,
            ring_rank=self.mesh.get_local_rank("ring"),
            ring_size=par.ring,
            ulysses_rank=self.mesh.get_local_rank("ulysses"),
            ulysses_size=par.ulysses,
        )

        # 4. model, in this order: USP attention -> pipeline stages -> chunked MLP -> activation checkpointing (with
        # offload) -> FSDP -> weights.
        # With pp > 1 the schedule runs this rank's stage modules, and self.model is their parts under Hugging Face
        # names (merge_stages), for the optimizer, clipping, checkpoints and export.
        model = build_empty_model(self.hf_config)
        num_params = sum(p.numel() for p in model.parameters())
        patch_attention(
            model,
            ulysses_group=self.mesh.get_group("ulysses"),
            ring_group=self.mesh.get_group("ring"),
            layout=par.layout,
        )
        if par.pp > 1:
            stages = apply_pipeline(
                model,
                self.mesh["pp"],
                schedule=par.pp_schedule,
                stages_per_rank=par.pp_stages_per_rank,
                split_points=par.pp_split_points,
                loss_chunk_tokens=cfg.train.loss_chunk_tokens,
            )
        else:
            stages = [model]
        for stage in stages:
            apply_chunked_mlp(stage.model.layers, par.mlp_chunk_tokens)
            apply_activation_checkpointing(
                stage.model.layers, par.activation_checkpointing, par.ac_every, offload=par.activation_offload
            )
            apply_fsdp(
                stage,
                dp_cp_mesh,
                param_dtype=_dtype(par.param_dtype, self.device),
                reduce_dtype=_dtype(par.reduce_dtype, self.device),
                reshard_after_forward=par.pp == 1,
            )
            materialize(stage, source, self.device)
            stage.train()
        self.schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None
        if par.pp > 1:
            self.model = merge_stages(stages)
            self.schedule = build_schedule(
                stages,
                self.mesh["pp"],
                schedule=par.pp_schedule,
                microbatches=cfg.data.batch_size * cfg.train.grad_accum,
                device=self.device,
                loss_fn=self._pipeline_loss,
            )
        else:
            self.model = model
            # the final hidden states, taken as the base model returns them, feed the chunked loss (no full logits)
            self.model.model.register_forward_hook(self._keep_hidden)
        self._hidden: torch.Tensor | None = None
        self._valid_tokens = torch.ones((), device=self.device)

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
        self.flops_per_token = flops_per_token(self.hf_config, num_params, cfg.data.seq_len)
        self.peak_flops = peak_flops(self.device, cfg.train.peak_tflops)
        logger.info(
            "model %s: %.2fM parameters, mesh pp=%d dp=%d ring=%d ulysses=%d, seq_len %d, device %s",
            self.hf_config.model_type,
            num_params / 1e6,
            par.pp,
            par.dp,
            par.ring,
            par.ulysses,
            cfg.data.seq_len,
            self.device,
        )

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._hidden = output.last_hidden_state

    def _pipeline_loss(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the last stage computes the token-summed loss itself (inside its FSDP forward, where the LM head is
        # gathered); the schedule still passes each micro-batch's target, unused here
        return loss_sum / self._valid_tokens

    def _mesh_degrees(self) -> dict[str, int]:
        par = self.cfg.parallel
        return {"pp": par.pp, "dp": par.dp, "ring": par.ring, "ulysses": par.ulysses}

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
        saved, mesh = self.checkpointer.read_extra(path, 0)["mesh"], self._mesh_degrees()
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
            "mesh": self._mesh_degrees(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
        }
        path = self.checkpointer.save(self.step, self.model, self.optimizer, extra)
        logger.info("checkpoint %s", path)

    def forward_loss_sum(self, batch: Batch, row: int) -> torch.Tensor:
        """The token-summed loss of one row of this rank's micro-batch (``[1, S_local]`` tokens)."""
        rows = slice(row, row + 1)
        self.model(
            input_ids=batch["input_ids"][rows].to(self.device),
            position_ids=batch["position_ids"][rows].to(self.device),  # global positions: RoPE is right per shard
            cu_seq_lens_q=batch["cu_seqlens"][row],  # document bounds of the global row
            logits_to_keep=torch.empty(0, dtype=torch.long),  # no logits here: the chunked loss computes them
        )
        hidden, self._hidden = self._hidden, None
        loss_sum, _ = chunked_cross_entropy(
            hidden,
            self.model.lm_head.weight,  # all-gathered by the root's forward and kept for its backward
            batch["labels"][rows].to(self.device),
            chunk_tokens=self.cfg.train.loss_chunk_tokens,
        )
        return loss_sum

    def forward_backward(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """Accumulate the gradients of the step's global mean loss over ``micro_batches``; returns this rank's share
        of that loss (summed over dp_cp it is the global mean)."""
        # valid tokens of the whole step, summed over dp_cp: each rank's loss is its token sum / this count, so the
        # gradients summed over dp_cp (apply_fsdp) and accumulated over micro-batches are the global mean's
        valid = sum((batch["labels"] != IGNORE_INDEX).sum() for batch in micro_batches).to(self.device)
        dist.all_reduce(valid, group=self.dp_cp_group)
        valid = valid.clamp(min=1)
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
        labels = rows["labels"].to(self.device)
        self.schedule.step(
            rows["input_ids"].to(self.device),
            position_ids=rows["position_ids"].to(self.device),
            cu_seqlens=torch.nn.utils.rnn.pad_sequence(bounds, batch_first=True, padding_value=-1),
            labels=labels,
            target=labels,
            losses=losses,
            return_outputs=False,
        )
        return sum((loss.detach() for loss in losses), torch.zeros((), device=self.device))

    def optimizer_step(self) -> torch.Tensor:
        """Clip by the global gradient norm (over all shards and pipeline stages), step AdamW and the schedule;
        returns the norm.

        A NaN/inf norm (the same on every rank) stops the job, or with ``train.nonfinite=skip`` drops this update
        (the schedule still advances, so steps and learning rates stay aligned).
        """
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.max_grad_norm, pp_group=self.pp_group)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        elif self.cfg.train.nonfinite == "stop":
            raise FloatingPointError(
                f"step {self.step + 1}: the gradient norm is {grad_norm.item()} (a NaN/inf loss or gradient); stopped "
                f"before updating, so the last checkpoint is intact. Set train.nonfinite=skip to skip such steps"
            )
        else:
            logger.warning("step %d: the gradient norm is %s: update skipped", self.step + 1, grad_norm.item())
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_step(self, micro_batches: Sequence[Batch]) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns the global mean loss and the grad norm."""
        loss = self.forward_backward(micro_batches)
        grad_norm = self.optimizer_step()
        dist.all_reduce(loss)  # the last stage's shares over dp_cp (other pipeline stages add 0)
        return {"loss": loss.item(), "grad_norm": grad_norm.item()}

    def train(self) -> list[float]:
        """Run to ``train.steps``; returns the losses of the steps run here."""
        cfg = self.cfg
        batches: Iterator[Batch] = iter(self.loader)
        tokens_per_step = cfg.data.seq_len * cfg.data.batch_size * cfg.train.grad_accum * cfg.parallel.dp
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
            line = self.metrics.log(
                self.step,
                {
                    **result,
                    "lr": lr,
                    "tokens_per_s": tokens_per_s,
                    "mfu": mfu,
                    "peak_mem_gib": peak_memory_gib(self.device),
                    "step_time_s": elapsed,
                },
            )
            if line is not None and bar.disable:
                logger.info(line)
            elif line is not None:
                bar.write(line)
            bar.update(1)
            losses.append(result["loss"])
            every = cfg.checkpoint.every
            if self.step == cfg.train.steps or (every and self.step % every == 0):
                self.save_checkpoint()
        bar.close()
        if cfg.checkpoint.export_hf:
            export_hf(
                self.model,
                self.hf_config,
                self.run_dir / "hf",
                tokenizer=self.tokenizer,
                part=self.mesh.get_local_rank("pp"),
                num_parts=cfg.parallel.pp,
            )
            logger.info("Hugging Face model written to %s", self.run_dir / "hf")
        self.metrics.close()
        return losses


def init_distributed(device: torch.device, timeout_s: float) -> None:
    """The default process group from torchrun's environment, or a group of one for a plain ``python`` run.
    A collective that waits ``timeout_s`` for the other ranks raises instead of hanging."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        device_id = device
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device_id, timeout=timeout)
    else:
        dist.init_process_group(
            backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1, device_id=device_id, timeout=timeout
        )


class Terminated(Exception):
    """SIGTERM reached this rank: the launcher stops every rank when one fails, or the job was cancelled."""


def _raise_terminated(signum: int, frame: object) -> None:
    # Only the first SIGTERM counts: slurm signals every process of a job step and torchrun passes the signal on, so a
    # rank often gets two, and one arriving while the first is handled must not interrupt the rank's shutdown.
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(f"received {signal.Signals(signum).name}")


def is_communication_failure(error: BaseException) -> bool:
    """A collective or transfer failed: a peer process died (its connections closed), a peer hung past
    ``train.timeout_s``, or the network failed. gloo raises these as plain ``RuntimeError`` naming gloo."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo" in str(error))


def _first_sentence(error: BaseException) -> str:
    """``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1970. This is ...`` ->
    ``Connection closed by peer [127.0.0.1]:1970``."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.split(". ")[0].splitlines()[0] if text else type(error).__name__


def load_config_or_exit(overrides: Sequence[str]) -> JobConfig:
    """The job's config; a bad one ends the process with one line (printed by rank 0) and exit status 1."""
    try:
        return load_config(overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"lctrain: bad config: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def main(overrides: Sequence[str]) -> None:
    """The ``train`` command. A bad config or a missing file ends the job with one line per rank and exit status 1,
    before anything is written. When another rank fails (or SIGTERM arrives), every surviving rank ends with exit
    status 1 and one line naming the last complete checkpoint that ``checkpoint.resume=auto`` continues from."""
    cfg = load_config_or_exit(overrides)
    signal.signal(signal.SIGTERM, _raise_terminated)
    init_distributed(resolve_device(cfg.train.device), cfg.train.timeout_s)
    setup_logging(dist.get_rank())
    try:
        try:
            jobs = pending_stages(cfg, dist.get_world_size())  # [cfg], or the unfinished stages of train.stages
            trainer = Trainer(jobs[0])
        except (ValueError, FileNotFoundError) as error:
            logger.error("lctrain: %s", error)  # every rank: the launcher may stop the others as soon as one exits
            raise SystemExit(1) from None
        trainer.train()
        for job in jobs[1:]:
            del trainer
            trainer = Trainer(job)  # starts from the previous stage's export
            trainer.train()
    except Exception as error:
        # this rank stops now: a SIGTERM (the launcher stopping the other ranks) must not interrupt its message or exit
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not (isinstance(error, Terminated) or is_communication_failure(error)):
            raise
        if isinstance(error, Terminated):
            cause = "the launcher stopped this rank (another rank failed, or the job was cancelled or preempted)"
        else:
            cause = "another rank has failed (see the first failure in the launcher's report) or the network did"
        checkpoints = complete_checkpoints(Path(cfg.train.run_dir) / "checkpoints")
        logger.error(
            "lctrain: rank %d stopped: %s. Probably %s. Last complete checkpoint: %s; relaunch the same command "
            "(checkpoint.resume=auto) to continue from it.",
            dist.get_rank(),
            _first_sentence(error),
            cause,
            checkpoints[-1] if checkpoints else "none",
        )
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nor, whatever the outcome, its exit hooks
        dist.destroy_process_group()
