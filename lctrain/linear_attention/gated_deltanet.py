"""transformers' gated delta layers (Qwen3-Next's ``Qwen3NextGatedDeltaNet``, Qwen3.5's ``Qwen3_5GatedDeltaNet``)
run on a context-parallel shard of the sequence, exactly.

``gated_deltanet_forward`` takes the module's place in its forward (``patch_linear_attention`` binds it to the
mesh's groups): the module's own projections, gate norm and output projection run on this rank's tokens; the
convolution and the recurrence run on the ring rank's pieces (``context.py``). Under Ulysses the layer's heads are
split like attention's: the projected q/k/v and the gates travel sequence -> heads with lctrain's Ulysses all-to-all,
each rank convolves and runs its head group's channels over the whole ring piece, and the output travels back.
Training only: no cache, no padding mask; documents come as ``cu_seq_lens_q`` (global boundaries) and their shared
prefixes as ``doc_prefix`` (preference pairs), as attention's: a document with a prefix runs as if directly after it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lctrain.attention.checks import check_cu_seqlens, check_doc_prefix
from lctrain.attention.transport import group_coordinates
from lctrain.attention.ulysses import heads_to_seq, seq_to_heads
from lctrain.linear_attention.context import delta_rule_context
from lctrain.linear_attention.plan import Documents
from lctrain.rules import check_linear_heads


def _project(module: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The module's projections of ``hidden`` ``[B, L, E]``: q, k ``[B, L, Hk, dk]``, v, z ``[B, L, Hv, dv]`` (q, k,
    v before the convolution), b, a ``[B, L, Hv]``; Qwen3-Next's fused projections or Qwen3.5's separate ones."""
    batch, length = hidden.shape[:2]
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden), module.in_proj_ba(hidden))
    else:
        q, k, v = module.in_proj_qkv(hidden).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
        z = module.in_proj_z(hidden)
        b, a = module.in_proj_b(hidden), module.in_proj_a(hidden)
    q, k = (t.reshape(batch, length, module.num_k_heads, module.head_k_dim) for t in (q, k))
    v, z = (t.reshape(batch, length, module.num_v_heads, module.head_v_dim) for t in (v, z))
    return q, k, v, z, b, a


def _conv_weight(module: nn.Module, part: int, parts: int) -> Tensor:
    """The convolution's taps ``[C / parts, K]`` of head group ``part`` of ``parts``: its q, k and v channels."""
    weight = module.conv1d.weight.squeeze(1)
    if parts == 1:
        return weight
    qk, vv = module.key_dim // parts, module.value_dim // parts
    return torch.cat(
        [
            weight[part * qk : (part + 1) * qk],
            weight[module.key_dim + part * qk : module.key_dim + (part + 1) * qk],
            weight[2 * module.key_dim + part * vv : 2 * module.key_dim + (part + 1) * vv],
        ]
    )


def gated_deltanet_forward(
    module: nn.Module,
    hidden_states: Tensor,
    cache: object = None,
    attention_mask: Tensor | None = None,
    *,
    ring_group: dist.ProcessGroup | None,
    ulysses_group: dist.ProcessGroup | None,
    layout: str,
    cu_seq_lens_q: Tensor | None = None,
    doc_prefix: Tensor | None = None,
    **kwargs: object,
) -> Tensor:
    """The module's forward on this rank's shard: hidden_states ``[B, S/(R·U), E]`` -> ``[B, S/(R·U), E]``."""
    if cache is not None or attention_mask is not None:
        raise ValueError("lctrain's linear-attention layers train on whole rows: no cache and no padding mask")
    part, parts = group_coordinates(ulysses_group)
    check_linear_heads(module.num_k_heads, module.num_v_heads, parts)
    length = hidden_states.shape[1] * parts * group_coordinates(ring_group)[1]
    bounds = check_cu_seqlens(cu_seq_lens_q, length)
    documents = Documents.of(bounds or [0, length], check_doc_prefix(doc_prefix, bounds))
    q, k, v, z, b, a = _project(module, hidden_states)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    gates = torch.stack([g, b.sigmoid().float()], dim=-1)  # [B, L, Hv, 2]
    if parts > 1:
        q, k, v, gates = (seq_to_heads(t, ulysses_group) for t in (q, k, v, gates))
    out = delta_rule_context(
        q,
        k,
        v,
        gates[..., 0],
        gates[..., 1],
        _conv_weight(module, part, parts),
        group=ring_group,
        layout=layout,
        documents=documents,
    )
    if parts > 1:
        out = heads_to_seq(out, ulysses_group)
    shape = z.shape
    out = module.norm(out.reshape(-1, shape[-1]), z.reshape(-1, shape[-1])).reshape(*shape[:2], -1)
    return module.out_proj(out)


def patch_linear_attention(
    modules: list[nn.Module],
    *,
    ring_group: dist.ProcessGroup | None,
    ulysses_group: dist.ProcessGroup | None,
    layout: str,
) -> None:
    """Run each gated delta module of ``modules`` with ``gated_deltanet_forward`` over these groups (in place: the
    instance's ``forward``; the class, its parameters and their names are untouched)."""
    for module in modules:
        module.forward = functools.partial(
            gated_deltanet_forward, module, ring_group=ring_group, ulysses_group=ulysses_group, layout=layout
        )
