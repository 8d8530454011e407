"""Cross-field checks of a job: one clear error naming the setting and the fix, raised before anything runs.

The rules shared with the loader, the attention functions and the planner come from ``lctrain.rules``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lctrain.attention.kernels import check_kernel_choice
from lctrain.config.schema import ACTIVATION_CHECKPOINTING, DTYPES, JobConfig
from lctrain.data import check_data_config
from lctrain.models.families import ROPE_SCALING_TYPES, check_family, check_model_features, model_source
from lctrain.models.lora import check_lora
from lctrain.parallel.dims import ParallelDims
from lctrain.rules import check_activation_offload, check_pipeline, check_ulysses_heads

logger = logging.getLogger("lctrain")


def check_job(
    cfg: JobConfig,
    world_size: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    num_layers: int,
    tied_embeddings: bool,
    vocab_size: int,
    local_world_size: int | None = None,
    max_position_embeddings: int | None = None,
    rope_type: str | None = None,
) -> None:
    """Raise one clear error for a config that cannot run on ``world_size`` processes with this model.

    ``max_position_embeddings`` and ``rope_type`` are the model config's (after ``model.*`` overrides: a
    checkpoint's own RoPE type when ``model.rope_scaling.type`` is unset). ``local_world_size`` is the
    processes per node (torchrun's ``LOCAL_WORLD_SIZE``; None = one node). Call it before any process group work:
    every rank raises the same error, nothing has been written.
    """
    par, data, train = cfg.parallel, cfg.data, cfg.train
    dims = ParallelDims.from_config(par)  # degrees >= 1, a known layout
    check_kernel_choice(par.attention_kernel, setting="parallel.attention_kernel")
    dims.check_world_size(world_size)
    check_ulysses_heads(num_heads, num_kv_heads, dims.ulysses)
    dims.check_sequence_length(data.seq_len)
    if par.ulysses_across_nodes not in ("error", "warn"):
        raise ValueError(f"parallel.ulysses_across_nodes={par.ulysses_across_nodes!r} must be error or warn")
    try:
        dims.check_ulysses_inside_nodes(local_world_size or world_size)
    except ValueError as error:
        if par.ulysses_across_nodes == "error":
            raise
        logger.warning("%s", error)
    if par.pp > 1:
        check_pipeline(
            par.pp,
            par.pp_schedule,
            par.pp_stages_per_rank,
            par.pp_split_points,
            num_layers,
            data.batch_size * train.grad_accum,
            tied_embeddings=tied_embeddings,
        )
    check_rope(cfg, dims.cp, max_position_embeddings, rope_type)
    if cfg.objective.name == "dpo" and par.pp > 1:
        raise ValueError(
            f"objective.name=dpo with parallel.pp={par.pp}: the preference loss runs without a pipeline; set "
            f"parallel.pp=1 and spread the pairs' length over parallel.ring and parallel.ulysses"
        )
    if par.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"parallel.activation_checkpointing={par.activation_checkpointing!r} must be one of "
            f"{ACTIVATION_CHECKPOINTING}"
        )
    if par.ac_every < 1:
        raise ValueError(f"parallel.ac_every={par.ac_every} must be >= 1")
    check_activation_offload(par.activation_offload, par.activation_checkpointing)
    if par.cpu_offload and train.device == "cpu":
        logger.warning(
            "parallel.cpu_offload=true with train.device=cpu: the parameters and optimizer states are in host memory "
            "already, so the offload only adds copies; set parallel.cpu_offload=false on CPU"
        )
    if par.mlp_chunk_tokens < 0:
        raise ValueError(f"parallel.mlp_chunk_tokens={par.mlp_chunk_tokens} must be >= 0 (0 = no chunking)")
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(par, name) not in DTYPES:
            raise ValueError(f"parallel.{name}={getattr(par, name)!r} must be one of {DTYPES}")
    if cfg.model.path is None:
        check_family(cfg.model.family, model_source(None, cfg.model.family))
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab_size:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size} tokens: "
            f"set model.vocab_size >= {vocab_size} (or leave it unset)"
        )
    positive = {
        "data.batch_size": data.batch_size,
        "train.steps": train.steps,
        "train.grad_accum": train.grad_accum,
        "train.loss_chunk_tokens": train.loss_chunk_tokens,
        "checkpoint.keep": cfg.checkpoint.keep,
        "logging.every": cfg.logging.every,
    }
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if train.timeout_s <= 0:
        raise ValueError(f"train.timeout_s={train.timeout_s} must be > 0 (seconds a collective may wait)")
    if cfg.checkpoint.every < 0:
        raise ValueError(f"checkpoint.every={cfg.checkpoint.every} must be >= 0 (0 = only at the end)")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")
    if len(cfg.optim.betas) != 2:
        raise ValueError(f"optim.betas={cfg.optim.betas} must be two numbers, e.g. [0.9, 0.95]")
    if train.nonfinite not in ("stop", "skip"):
        raise ValueError(f"train.nonfinite={train.nonfinite!r} must be stop or skip")
    if train.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"train.device={train.device!r} must be auto, cuda or cpu")
    if cfg.logging.wandb not in ("disabled", "offline", "online"):
        raise ValueError(f"logging.wandb={cfg.logging.wandb!r} must be disabled, offline or online")
    check_data_config(cfg.data)  # the data settings on their own; lctrain.train.trainer.check reads the data


def check_model_job(cfg: JobConfig, world_size: int, config: Any, vocab_size: int) -> None:
    """The model first (a family lctrain runs exactly, the config features and ``model.sliding_window`` it can
    honour: ``lctrain.models.families``), then ``check_job`` with the sizes of the transformers ``config`` the job
    builds (after its ``model.*`` settings) and the processes per node from torchrun's environment
    (``LOCAL_WORLD_SIZE``), then the LoRA settings against the model's modules (``check_lora``)."""
    source = model_source(cfg.model.path, cfg.model.family)
    check_family(config.model_type, source)
    check_model_features(config, source, cfg.model.sliding_window)
    check_job(
        cfg,
        world_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        num_layers=config.num_hidden_layers,
        tied_embeddings=config.tie_word_embeddings,
        vocab_size=vocab_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        max_position_embeddings=config.max_position_embeddings,
        rope_type=config.rope_parameters.get("rope_type"),
    )
    check_lora(cfg.model.lora, config, cfg.parallel, source)


def check_rope(cfg: JobConfig, cp: int, max_position_embeddings: int | None, rope_type: str | None = None) -> None:
    """The RoPE scaling settings: a type transformers supports for Llama, its required fields, and no dynamic
    scaling (set here, or the checkpoint's own ``rope_type``) that the ``cp`` context-parallel ranks would compute
    differently."""
    scaling = cfg.model.rope_scaling
    if scaling.type is not None:
        if scaling.type not in ROPE_SCALING_TYPES:
            raise ValueError(f"model.rope_scaling.type={scaling.type!r} must be one of {ROPE_SCALING_TYPES} (or null)")
        if scaling.factor < 1:
            raise ValueError(
                f"model.rope_scaling.factor={scaling.factor} must be >= 1: the new context over the one the "
                f"checkpoint was trained at (e.g. 16 for 8K -> 128K)"
            )
        if scaling.type in ("yarn", "llama3") and scaling.original_max_position_embeddings is None:
            raise ValueError(
                f"model.rope_scaling.type={scaling.type} needs model.rope_scaling.original_max_position_embeddings: "
                f"set it to the context the checkpoint was trained at (e.g. 8192)"
            )
    dynamic = scaling.type == "dynamic" or (scaling.type is None and rope_type == "dynamic")
    if dynamic and cp > 1 and (max_position_embeddings or 0) < cfg.data.seq_len:
        setting = "model.rope_scaling.type=dynamic" if scaling.type else f"{cfg.model.path}'s RoPE type dynamic"
        raise ValueError(
            f"{setting} rescales RoPE by the largest position each rank sees, which differs "
            f"between the {cp} context-parallel ranks once data.seq_len={cfg.data.seq_len} exceeds "
            f"max_position_embeddings={max_position_embeddings}: set model.max_position_embeddings >= "
            f"{cfg.data.seq_len} (training then uses the base frequencies and inference scales beyond), or use "
            f"linear, yarn or llama3"
        )
