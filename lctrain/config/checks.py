"""The rules that join sections of a job, or need its model and world size: one clear error naming the setting and
the fix, raised before anything runs. Each section checks its own fields when it is made (``__post_init__`` of
the dataclasses in ``lctrain.config.schema``, ``lctrain.models.config``, ``lctrain.data.config``).

The rules shared with the loader, the attention functions and the planner come from ``lctrain.rules``. Importing
this module loads neither torch nor transformers (``check_model_job`` imports ``lctrain.models.lora`` when it runs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lctrain.config.schema import JobConfig
from lctrain.families import (
    FAMILIES,
    HYBRID_LAYER_TYPES,
    LAYER_TYPES,
    ROPE_TYPES,
    family_of,
    layer_windows,
    model_source,
    num_experts,
    rope_parameters,
)
from lctrain.rules import check_expert_parallel, check_linear_heads, check_pipeline, check_ulysses_heads

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
    num_experts: int | None = None,
) -> None:
    """Raise one clear error for a config that cannot run on ``world_size`` processes with this model.

    ``max_position_embeddings`` and ``rope_type`` are the model config's (after ``model.*`` overrides: a
    checkpoint's own RoPE type when ``model.rope_scaling.type`` is unset); ``num_experts`` its experts per MoE layer
    (0: dense; None: not known, ``parallel.ep`` is then checked against the ranks only). ``local_world_size`` is the
    processes per node (torchrun's ``LOCAL_WORLD_SIZE``; None = one node). Call it before any process group work:
    every rank raises the same error, nothing has been written.
    """
    par, data, train = cfg.parallel, cfg.data, cfg.train
    dims = par.dims()
    dims.check_world_size(world_size)
    check_ulysses_heads(num_heads, num_kv_heads, dims.ulysses)
    check_expert_parallel(par.ep, dims.dp_cp, num_experts)
    dims.check_sequence_length(data.seq_len)
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
            cfg.step_rows,
            tied_embeddings=tied_embeddings,
        )
    check_rope(cfg, dims.cp, max_position_embeddings, rope_type)
    if par.cpu_offload and train.device == "cpu":
        logger.warning(
            "parallel.cpu_offload=true with train.device=cpu: the parameters and optimizer states are in host memory "
            "already, so the offload only adds copies; set parallel.cpu_offload=false on CPU"
        )
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < vocab_size:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size} tokens: "
            f"set model.vocab_size >= {vocab_size} (or leave it unset)"
        )
    if data.val_sources and par.pp > 1:
        raise ValueError(
            f"data.val_sources with parallel.pp={par.pp}: validation runs without a pipeline; leave "
            f"data.val_sources empty and score the export with `lctrain eval` (tasks=[perplexity])"
        )


def check_model_job(cfg: JobConfig, world_size: int, config: PretrainedConfig, vocab_size: int) -> None:
    """The model first (a family lctrain runs exactly, the config features and ``model.sliding_window`` it can
    honour: ``lctrain.families``), then ``check_job`` with the sizes of the transformers ``config`` the job
    builds (after its ``model.*`` settings) and the processes per node from torchrun's environment
    (``LOCAL_WORLD_SIZE``), then the LoRA settings against the model's modules (``check_lora``)."""
    from lctrain.models.lora import check_lora  # builds the model on meta: torch and peft

    source = model_source(cfg.model.path, cfg.model.family)
    family = family_of(config.model_type, source)
    check_model_features(config, source, cfg.model.sliding_window)
    check_experts(config, source, cfg.model.router_aux_loss_coef, cfg.train.router_aux_scope)
    router_loss = getattr(config, "output_router_logits", False) and config.router_aux_loss_coef > 0
    if cfg.objective.name == "dpo" and family.moe and router_loss:
        raise ValueError(
            f"objective.name=dpo with {config.model_type}'s router load-balancing loss: the preference loss does not "
            f"add it (its reference pass would count in the routers' statistics); set model.router_aux_loss_coef=0"
        )
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
        rope_type="dynamic" if any(r.get("rope_type") == "dynamic" for r in rope_parameters(config).values()) else None,
        num_experts=num_experts(config),
    )
    if family.linear_mixer is not None:
        check_linear_layers(cfg, config, source)
    check_lora(cfg.model.lora, config, cfg.parallel, source)


def check_model_features(config: PretrainedConfig, source: str, window_setting: int | None) -> None:
    """Refuse what a supported family's config asks for that lctrain cannot honour exactly, and a
    ``model.sliding_window`` that the model cannot have. ``config`` has the job's ``model.*`` settings applied."""
    model_type, rule = config.model_type, FAMILIES[config.model_type].window
    if (
        isinstance(window_setting, bool)
        or not isinstance(window_setting, (int, type(None)))
        or (window_setting is not None and window_setting < 0)
    ):
        raise ValueError(
            f"model.sliding_window={window_setting!r} must be null (the checkpoint's own windows), 0 (no window on "
            f"any layer) or a positive number of tokens"
        )
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise ValueError(
            f"{source} sets attention_dropout={dropout}: USP attention has no dropout, so training would not be the "
            f"model's; set attention_dropout to 0 in its config.json"
        )
    if getattr(config, "quantization_config", None):
        raise ValueError(
            f"{source} holds quantized weights (quantization_config in its config.json): lctrain trains full-"
            f"precision weights; use the unquantized checkpoint"
        )
    for rope in rope_parameters(config).values():
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"{source} uses RoPE type {rope_type!r} (rope_parameters in its config.json), which lctrain does not "
                f"check against transformers: supported types are {', '.join(ROPE_TYPES)} (model.rope_scaling.type "
                f"replaces it)"
            )
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, field, None):
            raise ValueError(
                f"{source} sets {field}={getattr(config, field)}: lctrain's attention and loss do not soft-cap "
                f"scores or logits, so training would not be the model's; use a checkpoint without it"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{source} sets use_bidirectional_attention: lctrain trains causal decoders; set it to false")
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        raise ValueError(
            f"{source} sets router_jitter_noise={jitter}: the router's inputs would be scaled by random noise drawn "
            f"differently on each rank; set router_jitter_noise to 0 in its config.json"
        )
    if rule in ("layers", "pattern") or FAMILIES[model_type].linear_mixer:
        known = HYBRID_LAYER_TYPES if FAMILIES[model_type].linear_mixer else LAYER_TYPES
        unknown = sorted(set(config.layer_types) - set(known))
        if unknown:
            raise ValueError(f"{source} has layer_types {unknown}: lctrain runs only {known} layers exactly")
    if window_setting and not any(layer_windows(config)):
        if rule == "none":
            reason = f"transformers' {model_type} attention has no sliding window, so the export could not hold it"
        else:
            reason = (
                "it has no sliding-window layers (use_sliding_window=false, or no layer_types entry "
                "sliding_attention): the setting sizes the windows the checkpoint declares; to add windowed layers "
                "set use_sliding_window, sliding_window and max_window_layers (or layer_types) in its config.json"
            )
        raise ValueError(
            f"model.sliding_window={window_setting} for {source}: {reason}. Set model.sliding_window to null (the "
            f"checkpoint's own) or 0 (none)"
        )


def check_experts(config: PretrainedConfig, source: str, coef_setting: float | None, scope: str = "sequence") -> None:
    """Refuse ``model.router_aux_loss_coef`` where it cannot apply and ``train.router_aux_scope=global`` without a
    router loss. ``config`` has the job's ``model.*`` settings applied."""
    experts = num_experts(config)
    routed = experts > 0 and getattr(config, "output_router_logits", False)
    if scope == "global" and not (routed and config.router_aux_loss_coef > 0):
        raise ValueError(
            f"train.router_aux_scope=global for {source}, which trains no router load-balancing loss (a mixture of "
            f"experts with model.router_aux_loss_coef > 0): set train.router_aux_scope=sequence"
        )
    if coef_setting is not None and (isinstance(coef_setting, bool) or coef_setting < 0):
        raise ValueError(f"model.router_aux_loss_coef={coef_setting} must be >= 0 (or null: the checkpoint's)")
    if not experts:
        if coef_setting:
            raise ValueError(
                f"model.router_aux_loss_coef={coef_setting} for {source}, a {config.model_type!r} model without "
                f"routers: set it to null"
            )
        return
    if not 1 <= config.num_experts_per_tok <= experts:
        raise ValueError(
            f"{source} routes each token to {config.num_experts_per_tok} of {experts} experts: set "
            f"model.experts_per_token between 1 and model.num_experts"
        )


def check_linear_layers(cfg: JobConfig, config: PretrainedConfig, source: str) -> None:
    """A hybrid model's gated delta layers: their heads split over the Ulysses ranks and each ring rank's chunks at
    least the convolution's halo."""
    dims = cfg.parallel.dims()
    check_linear_heads(config.linear_num_key_heads, config.linear_num_value_heads, dims.ulysses)
    chunks = 2 * dims.ring if cfg.parallel.layout == "zigzag" else dims.ring
    halo = config.linear_conv_kernel_dim - 1
    if cfg.data.seq_len // chunks < halo:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} cut into {chunks} ring pieces leaves fewer tokens than the linear "
            f"layers' convolution halo ({halo}) of {source}: use a longer data.seq_len or a smaller parallel.ring"
        )


def check_rope(cfg: JobConfig, cp: int, max_position_embeddings: int | None, rope_type: str | None = None) -> None:
    """No dynamic RoPE scaling (set in ``model.rope_scaling``, or the checkpoint's own ``rope_type``) that the
    ``cp`` context-parallel ranks would compute differently (``RopeScalingConfig`` checks its own fields)."""
    scaling = cfg.model.rope_scaling
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


def check_objective_data(objective: str, formats: Sequence[str]) -> None:
    """The objective against the kinds of its data (``formats``: each training and validation source's, as read):
    the preference loss trains on preference pairs only, and the language-modelling loss on none."""
    pairs = [kind == "preference" for kind in formats]
    if objective == "dpo" and not all(pairs):
        others = sorted({kind for kind in formats if kind != "preference"})
        raise ValueError(
            f"objective.name=dpo trains on preference pairs, and data has {' and '.join(others)} sources: give it "
            f"preference sources only (data=preference, data.format=preference), or set objective.name=lm"
        )
    if objective == "lm" and any(pairs):
        raise ValueError(
            "data has preference pairs (data.format=preference) and objective.name=lm would train the "
            "language-modelling loss on both answers: set objective.name=dpo (or train the chosen answers as "
            "prompt/completion chat records)"
        )
