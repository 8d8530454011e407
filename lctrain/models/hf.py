"""Hugging Face Llama-style models: config, empty (meta) construction, weight loading shard by shard, export.

The model is built with parameters on the meta device (buffers such as RoPE's ``inv_freq`` are real and small),
parallelized, then materialized: ``materialize`` allocates each rank's shards and fills them one parameter at a
time from a *source* of full tensors (a local safetensors checkpoint, or a seeded random init), so no rank ever
holds more than one full tensor. Random init draws each tensor from a generator seeded by (seed, parameter name):
the initial weights do not depend on the mesh.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from lctrain.families import (
    FAMILIES,
    LANGUAGE_MODELS,
    Family,
    apply_sliding_window,
    family_of,
    layer_windows,
    model_source,
    set_rope,
    set_router_aux_loss,
)
from lctrain.models.config import ModelConfig
from lctrain.models.layouts import (
    LAYOUT_WORDS,
    WEIGHTS_NAME,
    Reading,
    TensorSource,
    checkpoint_files,
    checkpoint_source,
    dequantizer,
    to_layout,
)

logger = logging.getLogger("lctrain")

RANDOM_INIT_CONTEXT = 131072  # max_position_embeddings of a randomly initialised model (RoPE has no length limit)
RANDOM_INIT_ROPE_THETA = 10000.0
# Wrappers applied by activation checkpointing and FSDP insert this into parameter names; checkpoints use HF names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)
# peft's names of the frozen weight a LoRA layer adapts and of a trained module's frozen original (lctrain.models.lora)
_FROZEN_BASE_PREFIXES = ("base_layer.", "original_module.")


def hf_name(name: str) -> str:
    """The Hugging Face name of a (possibly wrapped) parameter; a LoRA adapter's name (``lora_A``, ``lora_B``, a
    trained copy's ``modules_to_save``) is peft's, kept whole."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if ".lora_" in name:  # peft's name: the experts' nested wrappers tell their adapters apart by base_layer.
        return name
    for prefix in _FROZEN_BASE_PREFIXES:
        name = name.replace(prefix, "")
    return name


def model_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """The transformers config: read from ``cfg.path`` (``checkpoint_config``), or built from the sizes in ``cfg``
    (``random_init_config``), then the job's ``model.*`` settings written into it by ``lctrain.families`` (the
    checkpoint's family record first, which refuses a model type lctrain cannot run; the sliding window, RoPE, the
    router's load-balancing coefficient)."""
    source = model_source(cfg.path, cfg.family)
    if cfg.path is None:
        config = random_init_config(cfg, vocab_size)
    else:
        config = checkpoint_config(cfg.path, source)
        family_of(config.model_type, source)  # before anything reads its fields
        apply_sliding_window(config, cfg.sliding_window)
    set_rope(config, cfg)
    set_router_aux_loss(config, cfg.router_aux_loss_coef)
    windows = [window for window in layer_windows(config) if window]
    if windows:
        logger.info(
            "%s: a sliding window of %s tokens on %d of %d layers (model.sliding_window=0 turns it off)",
            source,
            "/".join(str(window) for window in sorted(set(windows))),
            len(windows),
            config.num_hidden_layers,
        )
    config.use_cache = False
    return config


def checkpoint_config(path: str | Path, source: str) -> PretrainedConfig:
    """The config of the model lctrain trains from the checkpoint in ``path`` (``_language_model``), without the
    quantization of weights it reads dequantized (trained and exported unquantized). ``source`` names it in
    messages."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={str(path)!r} has no config.json: point it at a local Hugging Face model directory"
        )
    config = _language_model(AutoConfig.from_pretrained(path), source)
    if checkpoint_reading(path).quantizer is not None:
        del config.quantization_config
    return config


def random_init_config(cfg: ModelConfig, vocab_size: int) -> PretrainedConfig:
    """A randomly initialised model's config: ``cfg.family`` (its record in ``FAMILIES``; ``ModelConfig`` refuses any
    other) with ``head_dim = hidden_size / num_heads`` where its record says (``Family.head_dim_from_width``: Qwen3's
    config class would default to 128), a mixture of experts with ``model.num_experts`` experts of width
    ``model.intermediate_size``, ``model.experts_per_token`` per token, a hybrid's gated delta layers with
    ``model.num_kv_heads`` key heads and ``model.num_heads`` value heads of ``hidden_size / num_heads`` (and a shared
    expert of width ``model.intermediate_size``), and the window of ``random_init_window``. Sizes transformers refuses
    (its config classes validate them, e.g. a width the heads do not divide) become a ``ValueError`` naming the
    ``model.*`` settings."""
    family = FAMILIES[cfg.family]
    fields = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size or vocab_size,
        "max_position_embeddings": RANDOM_INIT_CONTEXT,
        "rope_theta": RANDOM_INIT_ROPE_THETA,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
    }
    if family.head_dim_from_width:
        fields["head_dim"] = cfg.hidden_size // cfg.num_heads
    if family.experts is not None:  # model.num_experts of width model.intermediate_size
        fields |= {family.experts.count: cfg.num_experts, family.experts.width: cfg.intermediate_size}
        fields |= {"num_experts_per_tok": cfg.experts_per_token, "output_router_logits": False}
    if family.linear_mixer is not None:  # the gated delta layers sized as the attention, a shared expert as one
        head_dim = cfg.hidden_size // cfg.num_heads
        fields |= {"linear_num_key_heads": cfg.num_kv_heads, "linear_num_value_heads": cfg.num_heads}
        fields |= {"linear_key_head_dim": head_dim, "linear_value_head_dim": head_dim}
        if family.experts is not None:
            fields["shared_expert_intermediate_size"] = cfg.intermediate_size
    fields |= random_init_window(family, cfg.sliding_window, cfg.num_layers)
    try:
        return AutoConfig.for_model(cfg.family, **fields)
    except Exception as error:  # transformers raises its own validation error types, not ValueError
        cause = error.__cause__ or error
        raise ValueError(
            f"model.family={cfg.family} with model.hidden_size={cfg.hidden_size}, model.num_heads={cfg.num_heads}, "
            f"model.num_kv_heads={cfg.num_kv_heads}, model.num_layers={cfg.num_layers}: transformers refuses these "
            f"sizes ({str(cause).strip().splitlines()[-1]}); change the model.* settings"
        ) from None


def random_init_window(family: Family, setting: int | None, num_layers: int) -> dict[str, Any]:
    """The transformers config arguments of a randomly initialised model's window: none unless ``setting`` > 0
    (transformers' own defaults, Mistral's 4096 and Qwen's 4096 when sliding, are not used), then ``setting`` on
    every layer, or on the family's own sliding layers (``pattern``: gpt-oss's every other one). Llama has no window
    (a positive setting is refused by ``lctrain.config.checks.check_model_features``)."""
    window = setting if setting and setting > 0 else None
    if family.window == "pattern":  # the config class's own layer_types, or none sliding
        return {"sliding_window": window} if window else {"layer_types": ["full_attention"] * num_layers}
    if family.window == "model":
        flag = {"use_sliding_window": window is not None} if family.window_flag else {}
        return {"sliding_window": window, **flag}
    if family.window == "layers":  # layers i >= max_window_layers slide: all of them
        return {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0}
    return {}


def _language_model(config: PretrainedConfig, source: str) -> PretrainedConfig:
    """The config of the model lctrain trains from a checkpoint's: an image-text model's language model
    (``families.LANGUAGE_MODELS``, said in one line with what is left out), else ``config`` itself."""
    if config.model_type not in LANGUAGE_MODELS:
        return config
    record = LANGUAGE_MODELS[config.model_type]
    language_model = getattr(config, record.config)
    logger.info(
        "%s: a %s checkpoint: training its language model (%s); left out: %s",
        source,
        config.model_type,
        language_model.model_type,
        record.left_out,
    )
    return language_model


def build_empty_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model with parameters on the meta device and real buffers (``config`` is deep-copied, not shared)."""
    with init_empty_weights(include_buffers=False):
        attention = FAMILIES[config.model_type].built_attention if config.model_type in FAMILIES else "sdpa"
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attention)
    # init_empty_weights re-creates each parameter on meta, which unties tie_word_embeddings models: tie again (one
    # Parameter, kept through FSDP and materialize; tied checkpoints store only the embeddings)
    model.tie_weights()
    return model


def random_init_source(config: PretrainedConfig, seed: int) -> TensorSource:
    """Full tensors like Hugging Face's init: normal(0, initializer_range) weights, ones for norms, zero biases."""

    def make(name: str, shape: torch.Size) -> Tensor:
        if "norm" in name:
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.empty(shape).normal_(0.0, config.initializer_range, generator=gen)

    return make


def safetensors_source(path: str | Path, config: PretrainedConfig, setting: str = "model.path") -> TensorSource:
    """Full tensors by the model's names, read lazily (memory-mapped) from the local Hugging Face checkpoint in
    ``path`` (the job's ``setting``) for a model of ``config``: in the family's published layout or transformers'
    fused one, converted as ``from_pretrained`` converts them (``lctrain.models.layouts``). Fails now, before any
    weight is read, if the checkpoint cannot make every tensor of the model."""
    source = model_source(str(path), config.model_type)
    files = checkpoint_files(path, setting)
    reading = checkpoint_reading(path)
    read, plan = checkpoint_source(files, build_empty_model(config), source, reading)
    dequantized = " (MXFP4 experts dequantized by transformers as they are read)" if reading.quantizer else ""
    logger.info("%s: a %s checkpoint in %s%s", source, plan.model_type, LAYOUT_WORDS[plan.layout], dequantized)
    return read


def checkpoint_reading(path: str | Path) -> Reading:
    """How the checkpoint in ``path`` is read, from its config.json: dequantized (``quantization_config``:
    ``layouts.dequantizer``), and for an image-text model type its language model's tensors renamed to the text
    model's (``families.LANGUAGE_MODELS``). Without a config.json the tensors are read as they are named."""
    config_file = Path(path) / "config.json"
    fields = json.loads(config_file.read_text()) if config_file.is_file() else {}
    language_model = LANGUAGE_MODELS.get(fields.get("model_type"))
    return Reading(dequantizer(fields.get("quantization_config")), language_model and language_model.renames)


def checkpoint_layout(path: str | Path) -> str:
    """The layout of the Hugging Face checkpoint in ``path``, in words (``LAYOUT_WORDS``), planned as
    ``safetensors_source`` plans it against the model its ``config.json`` describes; reads no weight."""
    read = AutoConfig.from_pretrained(path)
    source = model_source(str(path), read.model_type)
    config = _language_model(read, source)
    _, plan = checkpoint_source(checkpoint_files(path), build_empty_model(config), source, checkpoint_reading(path))
    return LAYOUT_WORDS[plan.layout]


@torch.no_grad()
def materialize(
    model: nn.Module, source: TensorSource, device: torch.device, *, params_device: torch.device | None = None
) -> None:
    """Allocate the (sharded) parameters on ``device`` and fill them from ``source``, one full tensor at a time.

    Buffers keep the values they were built with, on ``device``. ``params_device``: where the parameters live when
    not on ``device`` (host memory, for FSDP2's CPU offload). Works on FSDP-sharded (DTensor) and plain parameters;
    plain parameters shared by several modules (tied embeddings) stay shared, filled once under their first name.
    """
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    shared = _shared_parameters(model)
    model.to_empty(device=params_device or device)
    for module, key, owner, owner_key in shared:  # to_empty gives each module a parameter of its own
        module._parameters[key] = owner._parameters[owner_key]
    for module_name, module in model.named_modules():
        for key in dict(module.named_buffers(recurse=False)):
            module._buffers[key] = buffers[f"{module_name}.{key}" if module_name else key].to(device)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            full = source(hf_name(name), param.shape).to(device=device, dtype=param.dtype)
            # every rank holds the full tensor, so each keeps its own shard with no communication
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())  # to the parameter's own memory, on the host or the device
        else:
            param.copy_(source(hf_name(name), param.shape))


def _shared_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, key, owner, owner's key) for each plain parameter slot holding a parameter that an earlier slot (its
    owner) holds too."""
    first: dict[int, tuple[nn.Module, str]] = {}
    shared = []
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) in first:
                shared.append((module, key, *first[id(param)]))
            else:
                first[id(param)] = (module, key)
    return shared


def full_state_dict(model: nn.Module) -> dict[str, Tensor] | None:
    """The model's full tensors (host memory) under their state-dict names (wrappers removed) on the rank at coordinate
    0 of the parameters' mesh (dp_cp), None on the others. Every rank must call it (the shards are gathered, one
    tensor at a time)."""
    tensors: dict[str, Tensor] = {}
    writer = True  # the rank at coordinate 0 of the parameters' mesh (dp_cp) keeps the full tensors
    for name, value in get_model_state_dict(model).items():
        if isinstance(value, DTensor):
            writer = not any(value.device_mesh.get_coordinate())
            value = value.full_tensor()  # a collective: every rank of the mesh takes part, one tensor at a time
        if writer:
            tensors[name] = value.detach().cpu().contiguous()
    return tensors if writer else None


def export_hf(
    weights: nn.Module | dict[str, Tensor] | None,
    config: PretrainedConfig,
    out_dir: str | Path,
    tokenizer=None,
    *,
    layout: str = "published",
    part: int = 0,
    num_parts: int = 1,
) -> None:
    """Write a Hugging Face model directory (``config.json`` + safetensors weights [+ tokenizer]) that
    ``AutoModelForCausalLM.from_pretrained`` loads, from ``weights``: a model with FSDP-sharded (DTensor) or plain
    parameters under Hugging Face names (gathered: ``full_state_dict``), or full tensors under the model's (in-memory)
    Hugging Face names (None on the ranks that write nothing). In ``layout`` (``checkpoint.export_layout``):
    ``published``, the names and per-expert tensors ``save_pretrained`` writes, or ``fused``, the model's own
    (``lctrain.models.layouts.to_layout``). Every rank must call it. With pipeline stages each pp rank passes its
    parts (``merge_stages``) with ``part`` = its pp rank and ``num_parts`` = pp: the first rank of each part writes
    ``model-0000<part+1>-of-0000<num_parts>.safetensors`` and rank 0 the index ``model.safetensors.index.json``, the
    sharded layout ``save_pretrained`` writes. One part: ``model.safetensors``."""
    tensors = weights
    if isinstance(weights, nn.Module):
        gathered = full_state_dict(weights)
        tensors = None if gathered is None else {hf_name(k): v for k, v in gathered.items()}
    writer = tensors is not None
    if writer and config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied to the input embeddings; safetensors stores each tensor once
    if writer:
        tensors = to_layout(tensors, build_empty_model(config), layout)
    out_dir = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = WEIGHTS_NAME if num_parts == 1 else _part_file(part, num_parts)
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
    if dist.is_initialized():
        dist.barrier()  # every part is written before rank 0 indexes them
    if rank == 0:
        if num_parts > 1:
            _write_index(out_dir, num_parts)
        config.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
            _warn_if_auto_tokenizer_differs(tokenizer, out_dir)
    if dist.is_initialized():
        dist.barrier()  # the directory is complete on every rank when it returns (a next stage reads it at once)


def _warn_if_auto_tokenizer_differs(tokenizer, out_dir: Path) -> None:  # noqa: ANN001
    """transformers' ``AutoTokenizer`` substitutes its own tokenizer for some model types (``qwen2``): say so when
    it would not give back the one the model was trained with."""
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if type(reloaded) is not type(tokenizer) or reloaded.get_vocab() != tokenizer.get_vocab():
        logger.warning(
            "transformers' AutoTokenizer loads %s as a %s of %d tokens, not the %s of %d tokens this model was trained "
            "with: load it with PreTrainedTokenizerFast.from_pretrained (as lctrain's next stages and eval do)",
            out_dir,
            type(reloaded).__name__,
            len(reloaded),
            type(tokenizer).__name__,
            len(tokenizer),
        )


def _write_index(out_dir: Path, num_parts: int) -> None:
    """``model.safetensors.index.json`` for the ``num_parts`` part files in ``out_dir``."""
    weight_map, total_size = {}, 0
    for index in range(num_parts):
        name = _part_file(index, num_parts)
        with safe_open(out_dir / name, "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), name))
        with (out_dir / name).open("rb") as f:  # a safetensors file: 8-byte header length, header, tensor data
            total_size += (out_dir / name).stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    index_json = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / f"{WEIGHTS_NAME}.index.json").write_text(json.dumps(index_json, indent=2) + "\n")


def _part_file(part: int, num_parts: int) -> str:
    return f"model-{part + 1:05d}-of-{num_parts:05d}.safetensors"
