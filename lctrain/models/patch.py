"""Run a Hugging Face Llama-style model's attention as USP attention, through transformers' public registry.

``patch_attention`` registers an attention function bound to the mesh's Ulysses and ring groups with
``transformers.AttentionInterface`` and selects it on the model (``set_attn_implementation``); the model classes
are not touched. Per-batch metadata travels through the call: the model is called with this rank's shard of
``input_ids`` and ``position_ids`` (global positions, so RoPE is right on every shard) and, for packed rows,
``cu_seq_lens_q`` (the global document boundaries) and, for rows whose documents share a prefix (preference
pairs), ``doc_prefix`` (``usp_attention``'s), which transformers forwards to the attention function.

A family whose record names a linear-attention mixer (``Family.linear_mixer``: Qwen3-Next's and Qwen3.5's gated
delta layers) has those modules run over the same groups and layout by ``lctrain.linear_attention``, which receives
the same call.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from lctrain.attention import usp_attention
from lctrain.attention.kernels import KernelCase, resolve
from lctrain.families import FAMILIES
from lctrain.linear_attention.gated_deltanet import patch_linear_attention
from lctrain.linear_attention.kernel import describe_linear_kernel

logger = logging.getLogger("lctrain")


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
    kernel: str = "auto",
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    doc_prefix: Tensor | None = None,
    s_aux: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """The transformers attention signature: q ``[B, Hq, S_local, D]``, k/v ``[B, Hkv, S_local, D]`` ->
    (``[B, S_local, Hq, D]``, no weights). Causal; documents from ``cu_seq_lens_q``, their shared prefixes from
    ``doc_prefix``; the layer's ``sliding_window`` (None on full-attention layers) becomes the window, with
    transformers' meaning; ``s_aux`` (gpt-oss's ``sinks``, ``[Hq]``) the attention sinks."""
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
        doc_prefix=doc_prefix,
        window=sliding_window,
        kernel=kernel,
        sinks=s_aux,
    )
    return out, None


def describe_attention_kernel(config: PretrainedConfig, kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel runs each kind of attention block of this model's layers on ``device`` in ``dtype``, and why
    (``kernels.Resolution.describe``). Raises ``ValueError`` when ``kernel`` names one that cannot run there."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    case = KernelCase(dtype, head_dim, heads, getattr(config, "num_key_value_heads", None) or heads)
    return resolve(device, case, choice=kernel).describe()


def patch_attention(
    model: PreTrainedModel,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    layout: str = "zigzag",
    kernel: str = "auto",
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """Select USP attention over these groups on ``model`` (in place), and the family's linear-attention mixers (see
    the module docstring); returns the registered implementation name.

    ``kernel``: ``parallel.attention_kernel`` (``auto`` or a kernel name). Given the ``device`` and the ``dtype``
    attention will run in, the kernel choice is resolved now, logged ("attention kernel: ..."), and a kernel
    that cannot run there stops the job here. The model's config object is changed: give each model its own
    config (``copy.deepcopy``) when several share one.
    """
    if device is not None and dtype is not None:
        logger.info("attention kernel: %s", describe_attention_kernel(model.config, kernel, device, dtype))
    name = f"lctrain_usp:{layout}:{_group_name(ulysses_group)}:{_group_name(ring_group)}"
    name += "" if kernel == "auto" else f":{kernel}"
    AttentionInterface.register(
        name,
        functools.partial(
            usp_attention_forward, ulysses_group=ulysses_group, ring_group=ring_group, layout=layout, kernel=kernel
        ),
    )
    model.set_attn_implementation(name)
    family = FAMILIES.get(model.config.model_type)
    if family is not None and family.linear_mixer is not None:
        mixers = [getattr(m, family.linear_mixer) for m in model.modules() if hasattr(m, family.linear_mixer)]
        patch_linear_attention(mixers, ring_group=ring_group, ulysses_group=ulysses_group, layout=layout)
        kernel_line = describe_linear_kernel(device, dtype)
        logger.info("linear-attention layers: %d gated delta layers, %s", len(mixers), kernel_line)
    return name
