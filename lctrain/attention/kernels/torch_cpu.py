"""PyTorch's CPU flash op. It takes [B, H, S, D]; blocks are copied into that layout, contiguous, in the compute
dtype: one copy, the cast the op needs anyway, and faster than transposed views (docs/benchmarks.md, "CPU ring").
Banded blocks run in masked row tiles (``bands``)."""

from __future__ import annotations

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import FLOAT_DTYPES, Abilities
from lctrain.attention.kernels.bands import with_row_tiles
from lctrain.attention.kernels.base import AttentionKernel, bhsd

# The CPU op's compute dtype for half-precision blocks, per pass: fp32, measured faster than bf16 (or no slower)
# on a CPU without bf16 instructions (docs/benchmarks.md, "CPU ring", with the command to re-measure).
CPU_FORWARD_DTYPE = torch.float32
CPU_BACKWARD_DTYPE = torch.float32


def _cpu_compute_dtype(dtype: torch.dtype, pass_dtype: torch.dtype = CPU_FORWARD_DTYPE) -> torch.dtype:
    """The dtype the CPU op computes a block of ``dtype`` in: ``pass_dtype`` for half inputs, else ``dtype``."""
    return pass_dtype if dtype in (torch.float16, torch.bfloat16) else dtype


def _cpu_operands(*tensors: Tensor, pass_dtype: torch.dtype) -> tuple[Tensor, ...]:
    """``[B, S, H, D]`` blocks as contiguous ``[B, H, S, D]`` in the pass's compute dtype (one copy each)."""
    return tuple(
        t.transpose(1, 2).to(_cpu_compute_dtype(t.dtype, pass_dtype), memory_format=torch.contiguous_format)
        for t in tensors
    )


def _additive_mask(visible: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The CPU op takes a float mask, not a bool one: 0 where a query sees a key, -inf elsewhere."""
    if visible is None:
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def cpu_attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The CPU op on one block (or row tile), ``visible`` as its mask (None: every query sees every key)."""
    q, k, v = _cpu_operands(q, k, v, pass_dtype=CPU_FORWARD_DTYPE)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_additive_mask(visible, q.dtype), scale=scale
    )
    return out.transpose(1, 2), lse


def cpu_attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``cpu_attend`` from the final ``out`` and ``lse``."""
    dout, q, k, v, out = _cpu_operands(dout, q, k, v, out, pass_dtype=CPU_BACKWARD_DTYPE)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.contiguous(), 0.0, False, attn_mask=_additive_mask(visible, q.dtype), scale=scale
    )
    return bhsd(dq, dk, dv)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_cpu_operands(q, k, v, pass_dtype=CPU_FORWARD_DTYPE), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_cpu_operands(dout, q, k, v, out, pass_dtype=CPU_BACKWARD_DTYPE), lse.contiguous(), 0.0, causal, scale=scale
    )
    return bhsd(dq, dk, dv)


TORCH_CPU_FLASH = with_row_tiles(
    AttentionKernel(
        "torch_cpu_flash",
        _cpu_forward,
        _cpu_backward,
        _cpu_compute_dtype,
        abilities=Abilities("cpu", dtypes=FLOAT_DTYPES),
    ),
    cpu_attend,
    cpu_attend_backward,
)
