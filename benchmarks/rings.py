"""The two rings the attention benchmarks time, pass by pass, on the same zigzag shards ``[B, S/P, H, D]`` of a
process group: lctrain's ``ring_attention`` and PyTorch's context-parallel ring (``_templated_ring_attention`` and
``_templated_ring_attention_backward``, with its module defaults: head-tail load balancing, which our zigzag shards
are, and its K/V rotation), whose CPU flash ops can be given a cast (``bench_attention``) or run as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention import ring_attention

CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass
class Passes:
    """``forward()`` returns the output ``[B, S/P, H, D]`` and keeps what ``backward()`` needs; ``backward()``
    returns dq, dk, dv ``[B, S/P, H, D]`` of the last forward."""

    forward: Callable[[], Tensor]
    backward: Callable[[], tuple[Tensor, ...]]


def lctrain_ring(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, group: dist.ProcessGroup) -> Passes:
    """lctrain's ring on leaves ``q, k, v`` (they require grad)."""
    saved: dict[str, Tensor] = {}

    def forward() -> Tensor:
        saved["out"] = ring_attention(q, k, v, group, layout="zigzag")
        return saved["out"].detach()

    def backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(saved.pop("out"), (q, k, v), dout)

    return Passes(forward, backward)


def torch_ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    group: dist.ProcessGroup,
    *,
    forward_op: Callable[..., Any] = CPU_FORWARD,
    backward_op: Callable[..., Any] = CPU_BACKWARD,
) -> Passes:
    """PyTorch's ring, causal, on the same shards (moved to its ``[B, H, S/P, D]`` layout once, here)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    q, k, v, dout = (t.detach().transpose(1, 2).contiguous() for t in (q, k, v, dout))
    saved: dict[str, Tensor] = {}

    def forward() -> Tensor:
        out, lse = cp._templated_ring_attention(group, 2, forward_op, q, k, v, is_causal=True, dropout_p=0.0)
        saved["out"], saved["lse"] = out.to(q.dtype), lse  # the merged output comes back in the op's dtype
        return saved["out"].transpose(1, 2)

    def backward() -> tuple[Tensor, ...]:
        out, lse = saved.pop("out"), saved.pop("lse")
        grads = cp._templated_ring_attention_backward(
            group, 2, backward_op, dout, "grad_out", q, k, v, out, lse, True, dropout_p=0.0
        )
        return tuple(g.transpose(1, 2) for g in grads[:3])

    return Passes(forward, backward)
