"""Unified sequence parallelism: Ulysses all-to-all inside (adjacent ranks, one node), ring attention across."""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch import Tensor

from lctrain.attention.kernels import check_kernel_choice
from lctrain.attention.ring import attend_ring, check_attention_inputs
from lctrain.attention.ulysses import attend_head_sharded


def _check_orthogonal(ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None) -> None:
    if ulysses_group is None or ring_group is None:
        return
    shared = set(dist.get_process_group_ranks(ulysses_group)) & set(dist.get_process_group_ranks(ring_group))
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"ulysses_group and ring_group share ranks {sorted(shared)}: they must be orthogonal axes of the mesh "
            f"(meet only at this rank); build them from a DeviceMesh with separate 'ring' and 'ulysses' dims"
        )


def usp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    causal: bool = True,
    layout: str = "zigzag",
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    window: int | None = None,
    kernel: str = "auto",
) -> Tensor:
    """Exact attention over a sequence sharded with ``shard_sequence`` over (ring, ulysses) ranks.

    q ``[B, S/(R·U), Hq, D]``, k/v ``[B, S/(R·U), Hkv, D]`` -> ``[B, S/(R·U), Hq, D]``, differentiable.
    Ulysses turns the local part into the ring rank's whole piece for ``Hq/U`` heads; ring attention then runs
    over ``ring_group`` on that piece; a second all-to-all restores the sequence sharding. ``cu_seqlens``,
    ``window`` and ``kernel`` as in ``ring_attention``.
    """
    ulysses_size, ring_size = (dist.get_world_size(g) if g is not None else 1 for g in (ulysses_group, ring_group))
    bounds = check_attention_inputs(
        q,
        k,
        v,
        causal=causal,
        layout=layout,
        window=window,
        cu_seqlens=cu_seqlens,
        ring_size=ring_size,
        ulysses_size=ulysses_size,
    )
    check_kernel_choice(kernel)
    _check_orthogonal(ulysses_group, ring_group)  # like every check, before any communication

    attend = functools.partial(
        attend_ring,
        group=ring_group,
        causal=causal,
        layout=layout,
        scale=scale,
        bounds=bounds,
        window=window,
        kernel=kernel,
    )
    return attend_head_sharded(q, k, v, ulysses_group, attend)
