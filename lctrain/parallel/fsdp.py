"""FSDP2 over the flattened ``dp_cp`` mesh (dp × ring × ulysses): each decoder layer, then the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import PreTrainedModel

from lctrain.parallel.expert import experts_modules


def apply_fsdp(
    model: PreTrainedModel | nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """Shard ``model`` (a Hugging Face model, or one ``PipelineStageModule``) in place over the 1-D ``mesh``
    (``dp_cp``): one all-gather unit per decoder layer, and the root (embeddings, final norm, LM head).

    Gradients are *summed* over the mesh, not averaged: the caller divides the token-summed loss by the global
    number of valid tokens (every rank of ``dp_cp`` and every micro-batch), so the sum is the mean gradient.
    Context-parallel ranks see different tokens of the same rows, so their gradients are partial sums too.

    ``reshard_after_forward=False`` keeps every layer's parameters gathered from its first forward to the end of the
    backward: for a pipeline stage, which runs many micro-batches' forwards before their backwards (one all-gather
    per step instead of one per micro-batch), and which the zero-bubble schedules need (their deferred weight
    gradients land in the gathered parameters).

    ``cpu_offload`` (``parallel.cpu_offload``): FSDP2's ``CPUOffloadPolicy``, the sharded parameters and gradients in
    host memory (pinned when the mesh is on CUDA), copied to the device for each all-gather; the optimizer then steps
    on the CPU. The model must then be materialized with its parameters on the host (``materialize``'s
    ``params_device``).

    Frozen parameters (a LoRA job's base weights: ``lctrain.models.lora``) are stored in ``param_dtype``, the
    trainable ones in fp32, both in the same units: FSDP2 gathers a unit's parameters in ``param_dtype`` and
    reduce-scatters only the gradients that exist, so frozen weights cost no gradient, no reduction and no
    optimizer state.

    ``experts_mesh`` (expert parallelism, ``parallel.ep > 1``): the ``efsdp`` mesh of the ranks holding the same
    experts (``lctrain.parallel.expert``). Each experts module (its weights DTensors over the EP mesh) is then its own
    FSDP unit over that mesh, inside its layer's: the gradient reduce-scatter of an expert sums over the ranks
    holding it, after the all-to-all's backward has summed it over the EP group.
    """
    for param in model.parameters():
        if not param.requires_grad:  # a frozen weight (LoRA's base) is kept in the compute dtype: never updated
            param.data = param.data.to(param_dtype)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    layers = model.model.layers
    layers = list(layers.values()) if isinstance(layers, nn.ModuleDict) else layers
    for index, layer in enumerate(layers):
        # the last layer is all-gathered again at once for the backward: keep it unsharded after the forward
        reshard = reshard_after_forward and index < len(layers) - 1
        for experts in experts_modules(layer) if experts_mesh is not None else ():
            fully_shard(
                experts, mesh=experts_mesh, mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload
            )
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
