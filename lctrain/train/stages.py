"""Progressive training in one recipe: ``train.stages`` runs the job several times with growing settings (longer
sequences, more context-parallel ranks, another RoPE scaling), each stage starting from the weights the previous one
exported.

Stage ``k`` is the job with the stage's settings applied (dotted keys: ``{data.seq_len: 131072, train.steps: 200,
parallel.ring: 8}``), writing to ``<train.run_dir>/stage_<k>``; from stage 1 on, ``model.path`` is the previous
stage's ``hf/`` export, so the weights carry over and the optimizer, schedule and data start afresh (each stage's
``train.steps`` is its own warmup and cosine). Every stage but the last exports (``checkpoint.export_hf``). A
relaunch skips the stages that are finished (their last checkpoint is at their ``train.steps`` and their export is
written) and resumes the first unfinished one from its own checkpoints (``checkpoint.resume=auto``).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from transformers import PretrainedConfig

from lctrain.build import tokenizer_path
from lctrain.checkpoint import checkpoint_step, complete_checkpoints
from lctrain.config import JobConfig, check_model_job
from lctrain.data import load_tokenizer
from lctrain.families import set_rope
from lctrain.models import model_config

# settings the stages decide themselves
_FIXED = ("train.stages", "train.run_dir", "model.path", "checkpoint.resume")
_MISSING = object()  # OmegaConf.select's answer for a key the config does not have
logger = logging.getLogger("lctrain")


def stage_dir(run_dir: str | Path, index: int) -> Path:
    return Path(run_dir) / f"stage_{index}"


def stage_configs(cfg: JobConfig) -> list[JobConfig]:
    """The job of each stage, in order; ``[cfg]`` for a job without stages. Raises ``ValueError`` naming the stage
    and the setting for an unknown key, a value of the wrong type, or a setting the stages decide themselves."""
    if not cfg.train.stages:
        return [cfg]
    if cfg.checkpoint.resume not in ("auto", "none"):
        raise ValueError(
            f"checkpoint.resume={cfg.checkpoint.resume} with train.stages: each stage resumes from its own "
            f"directory; use checkpoint.resume=auto (or none)"
        )
    base = OmegaConf.structured(cfg)
    base.train.stages = []
    jobs = []
    for index, settings in enumerate(cfg.train.stages):
        stage = copy.deepcopy(base)
        for key, value in settings.items():
            if key.startswith(_FIXED):
                raise ValueError(
                    f"train.stages[{index}] sets {key}, which the stages decide: each stage writes to "
                    f"<train.run_dir>/stage_<k> and starts from the previous stage's export"
                )
            if OmegaConf.select(stage, key, default=_MISSING) is _MISSING:
                raise ValueError(f"train.stages[{index}]: {key} is not a setting (docs/configuration.md lists them)")
            try:
                OmegaConf.update(stage, key, value, merge=True)
            except OmegaConfBaseException as error:
                raise ValueError(f"train.stages[{index}]: {key}={value!r}: {str(error).splitlines()[0]}") from None
        stage.train.run_dir = str(stage_dir(cfg.train.run_dir, index))
        if index > 0:
            stage.model.path = str(stage_dir(cfg.train.run_dir, index - 1) / "hf")
        if index < len(cfg.train.stages) - 1:
            stage.checkpoint.export_hf = True  # the next stage starts from it
            stage.checkpoint.export_merged = True  # with LoRA: from the merged model
        jobs.append(OmegaConf.to_object(stage))
    return jobs


def check_stages(cfg: JobConfig, world_size: int) -> None:
    """``check_job`` for every stage before the first one runs (``check_stage_jobs`` with the job's tokenizer and
    first model)."""
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    check_stage_jobs(stage_configs(cfg), world_size, model_config(cfg.model, len(tokenizer)), len(tokenizer))


def check_stage_jobs(jobs: list[JobConfig], world_size: int, first_model: PretrainedConfig, vocab_size: int) -> None:
    """``check_job`` for every stage, with the first stage's model (every later stage continues it) and each stage's
    RoPE settings."""
    for job in jobs:
        config = copy.deepcopy(first_model)
        set_rope(config, job.model)
        check_model_job(job, world_size, config, vocab_size)


def pending_stages(cfg: JobConfig) -> list[JobConfig]:
    """The jobs to run now: ``[cfg]`` without stages; otherwise the unfinished stages (or the last one, which then
    only exports again, as a finished plain run does)."""
    jobs = stage_configs(cfg)
    if len(jobs) == 1:
        return jobs
    pending = [job for job in jobs if not stage_finished(job)]
    for index, job in enumerate(jobs):
        state = "to run" if job in pending else "finished"
        logger.info(
            "stage_%d of %d (%s): seq_len %d, %d steps, %s",
            index,
            len(jobs),
            state,
            job.data.seq_len,
            job.train.steps,
            job.train.run_dir,
        )
    return pending or jobs[-1:]


def stage_finished(job: JobConfig) -> bool:
    """Whether this stage's last checkpoint is at its ``train.steps`` and its export (if any) is written."""
    found = complete_checkpoints(Path(job.train.run_dir) / "checkpoints")
    if not found or checkpoint_step(found[-1]) != job.train.steps:
        return False
    adapter_only = job.model.lora.rank and not job.checkpoint.export_merged
    export = Path(job.train.run_dir) / ("adapter/adapter_config.json" if adapter_only else "hf/config.json")
    return not job.checkpoint.export_hf or export.is_file()
