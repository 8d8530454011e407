"""Activation checkpointing of decoder layers: keep only each checkpointed layer's input, recompute the rest in the
backward. Optionally (``offload=True``) that input is kept in host memory between the forward and the backward.

What a checkpointed layer keeps. ``torch.utils.checkpoint`` (non-reentrant) stores the layer's positional tensor
inputs (the hidden states ``[B, S_local, hidden]``) as saved tensors and nothing else from inside the layer; the
keyword arguments (RoPE ``cos``/``sin``, positions, document bounds) are held as they are, but they are the same
tensors for every layer. Saved tensors go through ``torch.autograd.graph.saved_tensors_hooks``: with offload, the
pack hook copies the hidden states to pinned host memory in the forward and the unpack hook brings them back when
the backward recomputes the layer (``HostOffload``). Device memory then holds no per-layer activation between the
forward and the backward, only the layer being recomputed and the next one's input, prefetched.

On CUDA the copies run on a side stream, overlapped with compute: in the forward the copy to the host starts once
the current stream has produced the tensor, and the device memory is released to the allocator only after the copy
has read it (``record_stream``); in the backward, bringing a layer's input back also starts the copy of the input
of the layer the backward reaches next (the one checkpointed before it), so that copy runs during this layer's
recomputation and backward; the compute stream waits for a copy's event only where it uses the tensor.

On a CPU device the activations already live in host memory: the pack hook keeps the tensor as it is (no copy),
so offload changes nothing there, neither memory nor results.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint


class Offloaded:
    """A saved tensor moved to host memory: the pinned copy, the event that marks it complete, and, once reloaded
    (or prefetched), the device copy with the event that marks it ready."""

    def __init__(self, device: torch.device, host: Tensor, on_host: Any):
        self.device, self.host, self.on_host = device, host, on_host
        self.reloaded: tuple[Tensor, Any] | None = None


class HostOffload:
    """The saved-tensor hooks of one model's offloaded checkpoints (``pack``, ``unpack``), as the module docstring
    describes. Tensors not on CUDA are kept as they are. Which entries are still to be reloaded is tracked by weak
    reference: a graph freed without a backward frees its host copies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # pack runs on the forward's thread, unpack on the autograd engine's
        self._pending: list[weakref.ref[Offloaded]] = []  # packed and not yet reloaded, in forward order
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def pack(self, tensor: Tensor) -> Tensor | Offloaded:
        if not self._offloads(tensor):
            return tensor
        host, on_host = self._to_host(tensor)
        entry = Offloaded(tensor.device, host, on_host)
        with self._lock:
            self._pending = [ref for ref in self._pending if ref() is not None] + [weakref.ref(entry)]
        return entry

    def unpack(self, packed: Tensor | Offloaded) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        with self._lock:
            live = [ref for ref in self._pending if ref() is not None]
            index = next((i for i, ref in enumerate(live) if ref() is packed), None)
            if index is not None:
                live.pop(index)
            self._pending = live
            before = live[index - 1]() if index else None  # the input the backward reaches next
        reloaded = packed.reloaded or self._to_device(packed)
        packed.reloaded = None  # used once; a second backward (retain_graph) copies again
        if before is not None and before.reloaded is None:
            before.reloaded = self._to_device(before)
        return self._use(*reloaded)

    # the device-specific steps (CUDA); tests replace them to follow the order of the copies on a CPU

    def _offloads(self, tensor: Tensor) -> bool:
        return tensor.is_cuda

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]

    def _to_host(self, tensor: Tensor) -> tuple[Tensor, torch.cuda.Event]:
        """The copy to pinned host memory, on the side stream once the current stream has produced ``tensor``;
        returns the host tensor and the event of the copy's completion."""
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return host, stream.record_event()

    def _to_device(self, entry: Offloaded) -> tuple[Tensor, torch.cuda.Event]:
        """The copy back to the device, on the side stream once the copy to the host is complete; returns the device
        tensor and the event of its completion."""
        stream = self._side_stream(entry.device)
        stream.wait_event(entry.on_host)
        with torch.cuda.stream(stream):
            tensor = entry.host.to(entry.device, non_blocking=True)
        return tensor, stream.record_event()

    def _use(self, tensor: Tensor, ready: torch.cuda.Event) -> Tensor:
        """``tensor`` for the current stream: it waits for the copy, and the tensor's memory (allocated on the side
        stream) is not reused before the current stream's work on it is done."""
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(ready)
        tensor.record_stream(current)
        return tensor


def offloaded_checkpoint(module: nn.Module, *args: Any, offload: HostOffload, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` checkpointed (non-reentrant), with the tensors the checkpoint keeps for the backward
    (``args``' tensors: the layer input) moved to host memory by ``offload`` until the backward needs them."""
    # the hooks see only the checkpoint's own saved inputs: inside it, its recomputation hooks take precedence
    with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
        return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def apply_activation_checkpointing(
    layers: nn.ModuleList | nn.ModuleDict, mode: str, every: int = 1, *, offload: bool = False
) -> HostOffload | None:
    """Wrap decoder layers in place: ``full`` = every layer, ``selective`` = layers 0, every, 2·every, ...,
    ``none`` = no change. ``layers`` is the model's list, or a pipeline stage's dict keyed by global layer index
    (the same layers are checkpointed for every pp). Parameter names gain ``_checkpoint_wrapped_module.``
    (``lctrain.models.hf.hf_name`` removes it). ``offload``: checkpointed layers keep their input in host memory
    (``offloaded_checkpoint`` with one ``HostOffload`` for these layers, returned); it needs ``mode`` full or
    selective (the job's settings are checked together when its config loads: ``ParallelConfig``)."""
    if mode == "none":
        if offload:
            raise ValueError("offload=True keeps the inputs of checkpointed layers: it needs mode full or selective")
        return None
    step = 1 if mode == "full" else every
    host_offload = HostOffload() if offload else None
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    for key in keys:
        if int(key) % step == 0:
            if host_offload is not None:
                checkpoint_fn = functools.partial(offloaded_checkpoint, offload=host_offload)
                layers[key] = checkpoint_wrapper(layers[key], checkpoint_fn=checkpoint_fn)
            else:
                layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
    return host_offload
