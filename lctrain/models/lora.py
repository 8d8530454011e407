"""LoRA adapters on a frozen base model, made by peft (``model.lora``).

``apply_lora`` is the first step of ``lctrain.build.build_model``: on the empty (meta) model, peft's
``inject_adapter_in_model`` replaces each target linear layer with peft's LoRA layer and each ``trainable`` module
with peft's ``ModulesToSaveWrapper``, and freezes every other weight. The model stays the Hugging Face model (the
same classes, ``model.model.layers``, ``lm_head``), so attention patching, pipeline stages, the chunked MLP,
activation checkpointing and FSDP apply to it as to any other: they see ordinary modules.

Experts (``model.lora.target_parameters``, peft's option of that name): a mixture of experts' 3D expert weights
(transformers' ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``) get adapters from
peft's ``ParamWrapper``, one per weight, nested around the experts module; in the forward it adds each expert's
low-rank update to the weight (a parametrization, ``W + scaling · B_e A_e`` for every expert e) and runs the experts
module unchanged, so lctrain's expert kernel (``lctrain.parallel.expert``, one rank holding every expert) computes
with the adapted weights.

Names. peft renames what it wraps: a target's frozen weight ``q_proj.weight`` becomes ``q_proj.base_layer.weight``
beside its adapters ``q_proj.lora_A.default.weight`` ``[rank, in]`` and ``q_proj.lora_B.default.weight``
``[out, rank]``; a trainable module's frozen original is ``norm.original_module.weight`` and its trained copy
``norm.modules_to_save.default.weight``. The experts' wrappers nest in the order of the experts module's parameters
(peft sorts the targets): ``experts.base_layer.base_layer.gate_up_proj`` is the frozen weight,
``experts.base_layer.lora_A.default.weight`` ``[E · rank, H]`` and ``experts.base_layer.lora_B.default.weight``
``[2I, E · rank]`` are ``gate_up_proj``'s adapters, ``experts.lora_A.default.weight`` ``[E · rank, I]`` and
``experts.lora_B.default.weight`` ``[H, E · rank]`` ``down_proj``'s (peft's layout: expert e's ``A_e`` is rows
``e · rank`` to ``(e + 1) · rank - 1`` of ``lora_A``, its ``B_e`` the columns ``j · E + e`` of ``lora_B``).
``lctrain.models.hf.hf_name`` maps the frozen names back to the Hugging Face ones (the weights come from the
checkpoint or the random init under those) and keeps the adapter names whole (peft's), under which checkpoints, the
optimizer and the exported adapter hold the trained state.

Initial values (``adapter_source``): ``lora_A`` as peft draws it (Kaiming-uniform with ``a = sqrt(5)``), from a
generator seeded by (seed, parameter name) like lctrain's random init; ``lora_B`` zeros (the adapted model starts as
the base model); a trained copy starts from the base weight it copies. None depends on the mesh.

Export (``export_lora``): ``<run_dir>/adapter`` written by peft's ``PeftModel.save_pretrained`` (``adapter_config.json``
and ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, dir)`` loads it) and, when asked, the merged
model (peft's ``merge_and_unload``) as a Hugging Face directory, both from the gathered full tensors on an empty peft
model on the writing rank.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel

from lctrain.families import FAMILIES, num_experts
from lctrain.models.config import LoraConfig
from lctrain.models.hf import TensorSource, build_empty_model, export_hf, full_state_dict
from lctrain.rules import check_expert_adapters

if TYPE_CHECKING:  # peft is imported where it is used: importing it takes seconds, and the checks never need it
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel

logger = logging.getLogger("lctrain")

ADAPTER = "default"  # peft's adapter name: the one adapter lctrain trains
# modules that get no adapters, and why
_NOT_TARGETS = {
    "lm_head": "the chunked loss computes the logits from the LM head's weight, not through its forward",
    "embed_tokens": "lctrain puts adapters on linear layers only",
}
TRAINED_COPY = f"modules_to_save.{ADAPTER}."  # inside the name of a trainable module's trained copy


def lora_targets(lora: LoraConfig, config: PretrainedConfig) -> list[str]:
    """The leaf module names that get adapters: ``model.lora.target_modules``, or ``config``'s family's default
    (``Family.lora_targets``)."""
    return list(lora.target_modules) or list(FAMILIES[config.model_type].lora_targets)


def peft_config(lora: LoraConfig, config: PretrainedConfig, base_path: str | None = None) -> PeftLoraConfig:
    """peft's ``LoraConfig`` for ``model.lora`` on a model of ``config`` (``base_path``: the base model's directory,
    recorded in the adapter's ``adapter_config.json``)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_targets(lora, config),
        modules_to_save=list(lora.trainable) or None,
        target_parameters=list(lora.target_parameters) or None,
        base_model_name_or_path=base_path,
    )


def apply_lora(model: PreTrainedModel, lora: LoraConfig) -> None:
    """Inject peft's LoRA layers and trainable copies into ``model`` (empty, on meta) in place and freeze the rest;
    ``lora.rank`` 0: no change (full fine-tuning). Check the job first (``check_lora``)."""
    if lora.rank == 0:
        return
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(lora, model.config), model, adapter_name=ADAPTER)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "LoRA rank %d on %s%s: %.2fM trained parameters, %.2fM frozen",
        lora.rank,
        ", ".join(lora_targets(lora, model.config) + list(lora.target_parameters)),
        f"; trained in full: {', '.join(lora.trainable)}" if lora.trainable else "",
        trained / 1e6,
        sum(p.numel() for p in model.parameters() if not p.requires_grad) / 1e6,
    )


def _module_names(model: nn.Module) -> tuple[set[str], set[str], dict[str, int]]:
    """The leaf names of ``model``'s decoder layers' linear layers, of every module that holds parameters, and the
    number of dims of each parameter by full name."""
    linear = {
        name.rsplit(".", 1)[-1] for name, module in model.model.layers.named_modules() if type(module) is nn.Linear
    }
    with_params = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if next(module.parameters(recurse=False), None) is not None
    }
    return linear, with_params, {name: param.ndim for name, param in model.named_parameters()}


def _check_target_parameters(lora: LoraConfig, params: dict[str, int], parallel: Any, source: str) -> None:
    """Each of ``model.lora.target_parameters`` names expert weights (the 3D ones, ``[E, out, in]``) of the model
    (``params``: the dims of each parameter by name) by peft's rule (the name or a suffix after a dot); expert
    parallelism is refused with them."""
    experts = {name for name, dims in params.items() if dims == 3}
    suffixes = sorted({".".join(name.split(".")[-2:]) for name in experts})
    for target in lora.target_parameters:
        matched = {name for name in params if name == target or name.endswith(f".{target}")}
        if not matched & experts:
            has = f"its experts' weights are {', '.join(suffixes)}" if experts else "it has no experts"
            raise ValueError(
                f"model.lora.target_parameters has {target!r}, which names no expert weight of {source}: {has} "
                f"(adapters on linear layers go in model.lora.target_modules)"
            )
    check_expert_adapters(bool(lora.target_parameters), parallel.ep)


def check_lora(lora: LoraConfig, config: PretrainedConfig, parallel: Any, source: str) -> None:
    """Refuse ``model.lora`` settings peft or lctrain cannot train exactly on this model (``config``, with the job's
    ``model.*`` settings) and ``parallel`` (the job's ``parallel`` section); ``source`` names the model. One
    ``ValueError`` naming the setting and the fix, before any process group. ``LoraConfig`` checks its own
    fields."""
    if lora.rank == 0:
        return
    if lora.dropout and (parallel.activation_checkpointing != "none" or parallel.mlp_chunk_tokens):
        setting = (
            f"parallel.activation_checkpointing={parallel.activation_checkpointing}"
            if parallel.activation_checkpointing != "none"
            else f"parallel.mlp_chunk_tokens={parallel.mlp_chunk_tokens}"
        )
        raise ValueError(
            f"model.lora.dropout={lora.dropout} with {setting}: the recomputation in the backward draws other dropout "
            f"masks than the forward did (lctrain's checkpoints do not restore the RNG), so the gradients would not be "
            f"the loss's; set model.lora.dropout=0"
        )
    model = build_empty_model(config)
    linear, with_params, params = _module_names(model)
    _check_target_parameters(lora, params, parallel, source)
    for name in lora.target_modules:  # the default projections a family lacks (a MoE block's) are skipped
        if name in _NOT_TARGETS:
            raise ValueError(
                f"model.lora.target_modules has {name!r}: {_NOT_TARGETS[name]}; train it in full with "
                f"model.lora.trainable=[{name}] instead"
            )
        if name not in linear:
            raise ValueError(
                f"model.lora.target_modules has {name!r}, which {source} does not have: its decoder layers' linear "
                f"layers are {', '.join(sorted(linear))}"
            )
    if lora.target_modules and num_experts(config):
        _check_peft_keeps_target_modules(lora, model, source)
    for name in lora.trainable:
        if name not in with_params or name in linear:
            reason = "gets adapters" if name in linear else "is not a module with weights of"
            raise ValueError(
                f"model.lora.trainable has {name!r}, which {reason} {source}: modules trained in full may be "
                f"{', '.join(sorted(with_params - linear))}"
            )
        if config.tie_word_embeddings and name in ("embed_tokens", "lm_head"):
            raise ValueError(
                f"model.lora.trainable has {name!r} and {source} ties its embeddings to the LM head "
                f"(tie_word_embeddings): peft trains a copy of one while the other stays frozen, which unties them; "
                f"leave {name} out of model.lora.trainable"
            )


def _check_peft_keeps_target_modules(lora: LoraConfig, model: PreTrainedModel, source: str) -> None:
    """peft under transformers 5 reads transformers 4's names of a mixture of experts' expert layers (Qwen3-MoE's
    ``gate_proj``, ``up_proj``, ``down_proj``; Mixtral's ``w1``, ``w2``, ``w3``) in ``target_modules`` as the experts'
    weights and moves them to ``target_parameters``, in training and when it reloads the adapter: such a name would
    leave a dense layer's MLP (``mlp_only_layers``) without adapters. Refused; ``model`` (empty) gets adapters."""
    from peft import inject_adapter_in_model

    given = peft_config(lora, model.config)
    inject_adapter_in_model(given, model, adapter_name=ADAPTER)  # peft rewrites given's targets
    moved = [name for name in lora.target_modules if name not in given.target_modules]
    if moved:
        raise ValueError(
            f"model.lora.target_modules has {moved[0]!r}, which peft reads on {source} as transformers 4's name of the "
            f"experts' weights (a dense layer's MLP would get no adapters): leave it out; the experts get adapters "
            f"from model.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]"
        )


def adapter_source(source: TensorSource, seed: int) -> TensorSource:
    """``source`` (full tensors by Hugging Face name) completed with the adapters' initial values of the module
    docstring: ``lora_A`` Kaiming-uniform seeded by (seed, name), ``lora_B`` zeros, a trained copy the base weight."""

    def make(name: str, shape: torch.Size) -> Tensor:
        if ".lora_A." in name:
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=gen)
        if ".lora_B." in name:
            return torch.zeros(shape)
        return source(name.replace(TRAINED_COPY, ""), shape)

    return make


def _peft_model(
    config: PretrainedConfig, lora: LoraConfig, tensors: dict[str, Tensor], base_path: str | None
) -> PeftModel:
    """An empty peft model of ``config`` holding ``tensors`` (state-dict names; the others stay on meta)."""
    from peft import get_peft_model

    model = get_peft_model(build_empty_model(config), peft_config(lora, config, base_path), adapter_name=ADAPTER)
    model.base_model.model.load_state_dict(tensors, strict=False, assign=True)
    return model


def _unaliased(tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``tensors``, those that share memory with ``model``'s parameters copied."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    shared = {p.untyped_storage().data_ptr() for p in local}
    return {name: t.clone() if t.untyped_storage().data_ptr() in shared else t for name, t in tensors.items()}


def export_lora(
    model: nn.Module,
    config: PretrainedConfig,
    lora: LoraConfig,
    run_dir: str | Path,
    tokenizer: Any = None,
    *,
    base_path: str | None,
    merged: bool,
    layout: str = "published",
    part: int = 0,
    num_parts: int = 1,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """Write ``<run_dir>/adapter`` (peft's format: peft's names, the experts' adapters under their fused weights'
    names) and, with ``merged``, the merged model to ``<run_dir>/hf`` in ``layout`` (``export_hf``, with the tokenizer).
    Every rank calls it.

    ``model`` is the trained model (FSDP-sharded or plain, with pipeline stages this rank's parts: ``part`` its pp
    rank of ``num_parts``, ``pp_group`` the pp group). The adapters of every part are gathered to global rank 0,
    which writes the adapter; each part's writer merges its own layers."""
    tensors = full_state_dict(model)  # None off the writers (coordinate 0 of dp_cp)
    if tensors is not None:
        trainable = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
        adapter = {name: tensors[name] for name in trainable}
        if pp_group is not None:
            parts: list[dict[str, Tensor]] = [{} for _ in range(dist.get_world_size(pp_group))]
            dist.all_gather_object(parts, adapter, group=pp_group)
            adapter = {name: tensor for stage in parts for name, tensor in stage.items()}
        if not dist.is_initialized() or dist.get_rank() == 0:
            _peft_model(config, lora, adapter, base_path).save_pretrained(Path(run_dir) / "adapter")
        if merged:  # peft merges in place: into copies of the tensors a mesh of one gathered without copying
            unloaded = _peft_model(config, lora, _unaliased(tensors, model), base_path).merge_and_unload()
            tensors = {name: t for name, t in unloaded.state_dict().items() if not t.is_meta}  # this part's
    if dist.is_initialized():
        dist.barrier()  # the adapter is written before any rank returns
    if merged:
        export_hf(tensors, config, Path(run_dir) / "hf", tokenizer, layout=layout, part=part, num_parts=num_parts)
