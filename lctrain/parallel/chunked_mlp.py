"""Chunked MLP: each decoder layer's MLP runs over the sequence a fixed number of tokens at a time, and each chunk is
recomputed in the backward, so its ``[tokens, intermediate]`` tensors (gate, up, activation, product) exist for one
chunk at a time instead of for the whole local sequence.

The MLP is wrapped with PyTorch's checkpoint wrapper, whose checkpoint function (``mlp_in_chunks``) cuts the input
along the tokens and runs ``torch.utils.checkpoint`` on each piece. The model's classes are not changed; the
parameter names gain ``_checkpoint_wrapped_module.``, which ``lctrain.models.hf.hf_name`` and torch's distributed
state dicts remove, so checkpoints and exports keep the Hugging Face names. It composes with activation
checkpointing of the whole layer (the chunks are then checkpoints nested in the layer's: in the backward the layer
is recomputed, and inside it each MLP chunk once more), with FSDP2 on the layer, and with pipeline stages.

The MLP must be token-wise (each output token depends only on the same input token): true of the Llama, Mistral,
Qwen2 and Qwen3 MLPs (``down(act(gate(x)) * up(x))``) and of the Qwen3-MoE and Mixtral blocks (each token's router
probabilities, top-k and experts are its own), not of a block whose router balances over the sequence. Each chunk
is given to the MLP as one row ``[1, chunk, hidden]``, the shape the MoE blocks take.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint


def mlp_in_chunks(mlp: nn.Module, hidden_states: Tensor, *, chunk_tokens: int) -> Tensor:
    """``mlp(hidden_states)`` computed ``chunk_tokens`` tokens at a time, each chunk checkpointed (only its input is
    kept; its intermediate tensors are recomputed in the backward). ``hidden_states`` ``[..., tokens, hidden]``:
    every leading dimension (batch) is flattened with the tokens, so a chunk may span rows."""
    shape = hidden_states.shape
    flat = hidden_states.reshape(-1, shape[-1])  # [B, S, hidden] -> [B·S, hidden]
    pieces = flat.split(chunk_tokens)
    if torch.is_grad_enabled():
        outputs = [checkpoint(mlp, piece[None], use_reentrant=False, preserve_rng_state=False) for piece in pieces]
    else:  # no backward: nothing to keep, the chunks only bound the size of the temporaries
        outputs = [mlp(piece[None]) for piece in pieces]
    out = torch.cat(outputs, dim=1)[0]  # chunks [1, chunk, hidden] -> [B·S, hidden]
    return out.view(*shape[:-1], out.shape[-1])  # [B·S, hidden] -> [B, S, hidden]


def chunked_mlp(mlp: nn.Module, chunk_tokens: int) -> nn.Module:
    """``mlp`` wrapped to run in checkpointed chunks of ``chunk_tokens`` tokens (see ``mlp_in_chunks``)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    return checkpoint_wrapper(mlp, checkpoint_fn=mlp_in_chunks, chunk_tokens=chunk_tokens)


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module inside any checkpoint/offload wrappers."""
    while isinstance(module, ActivationWrapper):
        module = module._checkpoint_wrapped_module
    return module


def apply_chunked_mlp(layers: nn.ModuleList | nn.ModuleDict, chunk_tokens: int) -> None:
    """Make every decoder layer's ``mlp`` a chunked one, in place; ``chunk_tokens=0`` = no change.

    ``layers`` is the model's list or a pipeline stage's dict (``stage.model.layers``). Apply it before FSDP (the
    wrapper must be part of the module tree FSDP shards) and before or after activation checkpointing (a
    checkpoint-wrapped layer is looked into). Applying it twice does not wrap an MLP twice.
    """
    if chunk_tokens == 0:
        return
    modules = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    for layer in modules:
        layer = _unwrapped(layer)
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise TypeError(
                f"{type(layer).__name__} has no `mlp` submodule: parallel.mlp_chunk_tokens needs Llama-style decoder "
                f"layers (set parallel.mlp_chunk_tokens=0 for this model)"
            )
        if isinstance(mlp, ActivationWrapper) and getattr(mlp.checkpoint_fn, "func", None) is mlp_in_chunks:
            continue
        layer.mlp = chunked_mlp(mlp, chunk_tokens)
