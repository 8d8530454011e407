"""Activation checkpointing of decoder layers: keep only each checkpointed layer's input, recompute the rest in the
backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(layers: nn.ModuleList, mode: str, every: int = 1) -> None:
    """Wrap decoder layers in place: ``full`` = every layer, ``selective`` = layers 0, every, 2·every, ...,
    ``none`` = no change. Parameter names gain ``_checkpoint_wrapped_module.`` (``lctrain.models.hf.hf_name``
    removes it)."""
    if mode == "none":
        return
    step = 1 if mode == "full" else every
    for index in range(0, len(layers), step):
        layers[index] = checkpoint_wrapper(layers[index], preserve_rng_state=False)
