"""PyTorch's CPU flash op. It takes [B, H, S, D]; blocks are copied into that layout, contiguous, in the compute
dtype: one copy, the cast the op needs anyway, and faster than transposed views (docs/benchmarks.md, "CPU ring");
bf16 blocks computed in bf16 go to it as transposed views, which are no slower. Banded blocks run in masked row
tiles (``bands``).

The compute dtype of bf16 blocks is chosen per pass for the CPU the process runs on (``cpu_bf16_dtypes``): where
PyTorch emulates bf16 its bf16 backward is several times slower than fp32, where the CPU has bf16 instructions it is
faster (docs/benchmarks.md, "The CPU compute dtype"). fp16 blocks are computed in fp32."""

from __future__ import annotations

import functools
import platform
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from lctrain.attention.kernels.abilities import FLOAT_DTYPES, HALF_DTYPES, Abilities
from lctrain.attention.kernels.bands import with_row_tiles
from lctrain.attention.kernels.base import AttentionKernel, bhsd

X86 = ("x86_64", "amd64", "i386", "i686")


@dataclass(frozen=True)
class PassDtypes:
    """The dtypes the CPU op computes bf16 blocks in, per pass, and why (for the job's kernel line)."""

    forward: torch.dtype
    backward: torch.dtype
    reason: str


@functools.cache
def cpu_bf16_dtypes() -> PassDtypes:
    """The compute dtypes of bf16 blocks on this CPU, chosen once per process. On x86 from its flags: with bf16
    instructions (AVX-512 BF16 or AMX) that PyTorch's kernels use (they run at AVX-512) the backward in bf16 and
    the forward in fp32, the faster dtype of each pass there; without, both in fp32 (docs/benchmarks.md, "The CPU
    compute dtype, per machine"). On other architectures, whose flags torch does not report, measured: each pass in
    the faster of the two on a small block (``_measured_dtypes``)."""
    if platform.machine().lower() not in X86:
        return _measured_dtypes()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":  # PyTorch's kernels run below AVX-512 here (the CPU, or ATEN_CPU_CAPABILITY)
        return PassDtypes(torch.float32, torch.float32, f"PyTorch's CPU kernels run at {capability} here")
    flags = (("AVX-512 BF16", torch.cpu._is_avx512_bf16_supported()), ("AMX", torch.cpu._is_amx_tile_supported()))
    present = [name for name, supported in flags if supported]
    if present:
        return PassDtypes(torch.float32, torch.bfloat16, f"this CPU has {' and '.join(present)}")
    return PassDtypes(torch.float32, torch.float32, "this CPU has neither AVX-512 BF16 nor AMX")


def _pass_seconds(dtype: torch.dtype, reps: int = 3) -> tuple[float, float]:
    """The fastest of ``reps`` forwards and backwards of the CPU op on a causal [1, 4, 1024, 64] block in
    ``dtype`` (thread CPU time)."""
    q, k, v, dout = (
        torch.randn(1, 4, 1024, 64, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(4)
    )
    forward, backward = [], []
    for _ in range(reps):
        start = time.thread_time()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        forward.append(time.thread_time() - start)
        start = time.thread_time()
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True)
        backward.append(time.thread_time() - start)
    return min(forward), min(backward)


def _measured_dtypes() -> PassDtypes:
    fp32, bf16 = _pass_seconds(torch.float32), _pass_seconds(torch.bfloat16)
    forward, backward = (torch.bfloat16 if b < f else torch.float32 for f, b in zip(fp32, bf16))
    return PassDtypes(forward, backward, "measured on this CPU (no x86 flags to go by)")


def cpu_compute_dtype(dtype: torch.dtype, pass_name: str = "forward") -> torch.dtype:
    """The dtype the CPU op computes a block of ``dtype`` in, in the ``forward`` or ``backward`` pass."""
    if dtype == torch.bfloat16:
        dtypes = cpu_bf16_dtypes()
        return dtypes.forward if pass_name == "forward" else dtypes.backward
    return torch.float32 if dtype == torch.float16 else dtype


def describe_cpu_dtypes(dtype: torch.dtype) -> str | None:
    """How blocks of ``dtype`` are computed, for the job's kernel line (None: in their own dtype)."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if dtype == torch.float16:
        return "fp16 blocks computed in fp32"
    if dtype != torch.bfloat16:
        return None
    dtypes = cpu_bf16_dtypes()
    return (
        f"bf16 blocks computed in {names[dtypes.forward]} forward, {names[dtypes.backward]} backward ({dtypes.reason})"
    )


def _cpu_operands(*tensors: Tensor, pass_name: str) -> tuple[Tensor, ...]:
    """``[B, S, H, D]`` blocks as ``[B, H, S, D]`` in the pass's compute dtype: copied once, contiguous, where they
    are converted or are fp32/fp64 (faster than transposed views); half blocks computed in their own dtype (the
    bf16 backward on a CPU with bf16 instructions) as transposed views, no copy (as fast or faster)."""
    operands = []
    for t in tensors:
        dtype, view = cpu_compute_dtype(t.dtype, pass_name), t.transpose(1, 2)
        keep = dtype == t.dtype and dtype in HALF_DTYPES
        operands.append(view if keep else view.to(dtype, memory_format=torch.contiguous_format))
    return tuple(operands)


def _additive_mask(visible: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The CPU op takes a float mask, not a bool one: 0 where a query sees a key, -inf elsewhere."""
    if visible is None:
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def cpu_attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The CPU op on one block (or row tile), ``visible`` as its mask (None: every query sees every key)."""
    q, k, v = _cpu_operands(q, k, v, pass_name="forward")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_additive_mask(visible, q.dtype), scale=scale
    )
    return out.transpose(1, 2), lse


def cpu_attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``cpu_attend`` from the final ``out`` and ``lse``."""
    dout, q, k, v, out = _cpu_operands(dout, q, k, v, out, pass_name="backward")
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.contiguous(), 0.0, False, attn_mask=_additive_mask(visible, q.dtype), scale=scale
    )
    return bhsd(dq, dk, dv)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_cpu_operands(q, k, v, pass_name="forward"), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_cpu_operands(dout, q, k, v, out, pass_name="backward"), lse.contiguous(), 0.0, causal, scale=scale
    )
    return bhsd(dq, dk, dv)


TORCH_CPU_FLASH = with_row_tiles(
    AttentionKernel(
        "torch_cpu_flash",
        _cpu_forward,
        _cpu_backward,
        functools.partial(cpu_compute_dtype, pass_name="backward"),
        abilities=Abilities("cpu", dtypes=FLOAT_DTYPES),
        dtype_note=describe_cpu_dtypes,
    ),
    cpu_attend,
    cpu_attend_backward,
)
