"""Activation checkpointing of decoder layers: keep only each checkpointed layer's input, recompute the rest in the
backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(layers: nn.ModuleList | nn.ModuleDict, mode: str, every: int = 1) -> None:
    """Wrap decoder layers in place: ``full`` = every layer, ``selective`` = layers 0, every, 2·every, ...,
    ``none`` = no change. ``layers`` is the model's list, or a pipeline stage's dict keyed by global layer index
    (the same layers are checkpointed for every pp). Parameter names gain ``_checkpoint_wrapped_module.``
    (``lctrain.models.hf.hf_name`` removes it)."""
    if mode == "none":
        return
    step = 1 if mode == "full" else every
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    for key in keys:
        if int(key) % step == 0:
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
