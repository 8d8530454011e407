"""Run a Hugging Face Llama-style model's attention as USP attention, through transformers' public registry.

``patch_attention`` registers an attention function bound to the mesh's Ulysses and ring groups with
``transformers.AttentionInterface`` and selects it on the model (``set_attn_implementation``); the model classes
are not touched. Per-batch metadata travels through the call: the model is called with this rank's shard of
``input_ids`` and ``position_ids`` (global positions, so RoPE is right on every shard) and, for packed rows,
``cu_seq_lens_q`` (the global document boundaries), which transformers forwards to the attention function.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel

from lctrain.attention import usp_attention


def _group_name(group: dist.ProcessGroup | None) -> str:
    return "none" if group is None else group.group_name


def usp_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    layout: str,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """The transformers attention signature: q ``[B, Hq, S_local, D]``, k/v ``[B, Hkv, S_local, D]`` ->
    (``[B, S_local, Hq, D]``, no weights). Causal; documents from ``cu_seq_lens_q``; the layer's
    ``sliding_window`` (None on full-attention layers) becomes the window, with transformers' meaning."""
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by USP attention: set attention_dropout=0")
    if attention_mask is not None:
        raise ValueError("USP attention takes no attention_mask: pass document boundaries as cu_seq_lens_q")
    out = usp_attention(
        query.transpose(1, 2),  # [B, H, S, D] -> [B, S, H, D]
        key.transpose(1, 2),
        value.transpose(1, 2),
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        causal=getattr(module, "is_causal", True),
        layout=layout,
        scale=scaling,
        cu_seqlens=cu_seq_lens_q,
        window=sliding_window,
    )
    return out, None


def patch_attention(
    model: PreTrainedModel,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    layout: str = "zigzag",
) -> str:
    """Select USP attention over these groups on ``model`` (in place); returns the registered implementation name.

    The model's config object is changed: give each model its own config (``copy.deepcopy``) when several share one.
    """
    name = f"lctrain_usp:{layout}:{_group_name(ulysses_group)}:{_group_name(ring_group)}"
    AttentionInterface.register(
        name,
        functools.partial(usp_attention_forward, ulysses_group=ulysses_group, ring_group=ring_group, layout=layout),
    )
    model.set_attn_implementation(name)
    return name
