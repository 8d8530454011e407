"""Blockwise attention kernels that return the log-sum-exp, and the resolver that picks one per device and case.

The interface every kernel implements is ``base.AttentionKernel``'s; each kernel carries its ``abilities`` (what
it can do, and why not). One module per kernel: ``cudnn`` (PyTorch's cuDNN attention), ``flash_attn3``
(flash-attn 3), ``flash_attn2`` (flash-attn 2), ``torch_cuda`` (PyTorch's own flash kernels), ``torch_cpu``
(PyTorch's CPU flash op), ``reference`` (plain math, any device); shared parts: ``abilities``, ``base``,
``bands`` (banded blocks in masked row tiles, for kernels without a window), ``varlen`` (document groups),
``flash`` (what the three flash-style back ends share). ``resolver.resolve`` picks, per kind of block, the first
kernel of an order that can do it (``parallel.attention_kernel``: ``auto`` or a name tried first;
docs/parallelism.md, "Attention kernels").
"""

from lctrain.attention.kernels.abilities import KernelCase, Platform
from lctrain.attention.kernels.base import AttentionKernel, accumulation_dtype, check_window, default_scale
from lctrain.attention.kernels.reference import reference_attention
from lctrain.attention.kernels.resolver import (
    KERNEL_CHOICES,
    KERNELS,
    Resolution,
    check_kernel_choice,
    resolve,
    resolve_kernel,
)
from lctrain.attention.kernels.torch_cpu import PassDtypes, cpu_bf16_dtypes, cpu_compute_dtype

__all__ = [
    "AttentionKernel",
    "KERNELS",
    "KERNEL_CHOICES",
    "KernelCase",
    "PassDtypes",
    "Platform",
    "Resolution",
    "accumulation_dtype",
    "check_kernel_choice",
    "check_window",
    "cpu_bf16_dtypes",
    "cpu_compute_dtype",
    "default_scale",
    "reference_attention",
    "resolve",
    "resolve_kernel",
]
