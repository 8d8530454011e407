"""Activation checkpointing of decoder layers: keep only each checkpointed layer's input, recompute the rest in the
backward. Optionally (``offload=True``) that input is kept in host memory between the forward and the backward.

What a checkpointed layer keeps. ``torch.utils.checkpoint`` (non-reentrant) stores the layer's positional tensor
inputs (the hidden states ``[B, S_local, hidden]``) as saved tensors and nothing else from inside the layer; the
keyword arguments (RoPE ``cos``/``sin``, positions, document bounds) are held as they are, but they are the same
tensors for every layer. Saved tensors go through ``torch.autograd.graph.saved_tensors_hooks``: with offload, the
pack hook copies the hidden states to (pinned) host memory in the forward and the unpack hook copies them back to
the device when the backward recomputes the layer. Device memory then holds no per-layer activation at all between
the forward and the backward, only the layer being recomputed.

On a CPU device the activations already live in host memory: the pack hook keeps the tensor as it is (no copy),
so offload changes nothing there, neither memory nor results. The copies are synchronous to the host (as
``torch.autograd.graph.save_on_cpu``) and asynchronous back from pinned memory; the next layer's input is not
prefetched during the backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from lctrain.rules import check_activation_offload

Packed = tuple[torch.device, Tensor]


def offload_to_host(tensor: Tensor) -> Packed:
    """Pack hook: ``tensor`` copied to host memory (pinned, for a fast copy back) and its device; a tensor already
    on the CPU is kept as it is."""
    if tensor.device.type == "cpu":
        return tensor.device, tensor
    host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.device.type == "cuda")
    host.copy_(tensor)
    return tensor.device, host


def reload_to_device(packed: Packed) -> Tensor:
    """Unpack hook: the tensor back on the device it came from (the same tensor for a CPU one)."""
    device, tensor = packed
    return tensor.to(device, non_blocking=True)


def offloaded_checkpoint(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` checkpointed (non-reentrant), with the tensors the checkpoint keeps for the backward
    (``args``' tensors: the layer input) moved to host memory until the backward needs them."""
    # the hooks see only the checkpoint's own saved inputs: inside it, its recomputation hooks take precedence
    with torch.autograd.graph.saved_tensors_hooks(offload_to_host, reload_to_device):
        return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def apply_activation_checkpointing(
    layers: nn.ModuleList | nn.ModuleDict, mode: str, every: int = 1, *, offload: bool = False
) -> None:
    """Wrap decoder layers in place: ``full`` = every layer, ``selective`` = layers 0, every, 2·every, ...,
    ``none`` = no change. ``layers`` is the model's list, or a pipeline stage's dict keyed by global layer index
    (the same layers are checkpointed for every pp). Parameter names gain ``_checkpoint_wrapped_module.``
    (``lctrain.models.hf.hf_name`` removes it). ``offload``: checkpointed layers keep their input in host memory
    (``offloaded_checkpoint``); it needs ``mode`` full or selective."""
    check_activation_offload(offload, mode)
    if mode == "none":
        return
    step = 1 if mode == "full" else every
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    for key in keys:
        if int(key) % step == 0:
            if offload:
                layers[key] = checkpoint_wrapper(layers[key], checkpoint_fn=offloaded_checkpoint)
            else:
                layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
