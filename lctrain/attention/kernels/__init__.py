"""Blockwise attention kernels that return the log-sum-exp, and the resolver that picks one per device and case.

Every kernel works on one (query block, key block) pair and has the same signature:

    forward(q, k, v, *, causal, scale, window_left=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, *, causal, scale, window_left=None) -> (dq, dk, dv)

Shapes: q, out, dout, dq ``[B, Sq, Hq, D]``; k, v, dk, dv ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA is
handled inside the kernel; K and V are never repeated by the caller); lse ``[B, Hq, Sq]`` in the accumulation
dtype (``accumulation_dtype``). ``out``, ``dq``, ``dk``, ``dv`` come back in the input dtype or in the
accumulation dtype (callers accumulate in the latter and cast once). ``causal`` is top-left aligned and is only
used on square (diagonal) blocks. ``window_left`` is the band of a sliding window, top-left aligned as well: query
row ``a`` sees key columns ``b >= a - window_left`` (None: no such limit); every query row of a banded block sees
at least one key (the ring plan clips blocks to the rows and columns the window reaches). ``backward`` takes the
*final* ``out`` and ``lse`` of the whole row (after merging all key blocks), which makes each block's gradient
exact on its own.

A kernel with a varlen mode also has ``varlen_forward(q, k, v, segments, *, causal, scale, window_left=None)``
and ``varlen_backward(dout, q, k, v, out, lse, segments, ...)``: ``segments`` are the (query rows, key rows) of
document rectangles laid end to end (block-diagonal), each computed as its own block with the same ``causal`` and
``window_left``; one call does them all (``ring_blocks.group_documents`` builds such groups).

Kernels (``KERNELS``): ``cudnn`` (PyTorch's cuDNN attention; CUDA), ``flash_attn3`` (flash-attn 3,
``flash_attn_interface``; Hopper), ``flash_attn`` (flash-attn 2), ``torch_cuda_flash`` (PyTorch's own flash
kernels, ``aten._flash_attention_forward``: windows and varlen included), ``torch_cpu_flash`` (PyTorch's CPU
flash op) and ``reference`` (plain math, any device). ``resolve`` picks, per device and case (dtype, head_dim,
plain / banded blocks / document groups), the first kernel of an order that can do it: ``parallel.attention_kernel``
(``auto`` or a name) chooses the order; the resolver's tables say what each kernel cannot do and why. Kernels
without a window (PyTorch's CPU op) run banded blocks in row tiles of ``bands.BAND_TILE_ROWS`` queries, each against
only the keys its rows see (``band_tiles``), with an additive mask where the band cuts the tile.

Modules, one per job:

- ``base``: ``AttentionKernel``, the accumulation dtype, the default scale, the window check, ``visible_keys``.
- ``reference``: plain math, any device and dtype (``REFERENCE``, ``reference_attention``).
- ``bands``: banded blocks for kernels without a window, in row tiles (``band_tiles``, ``BAND_TILE_ROWS``).
- ``varlen``: document groups: their packing, their flash window, ``looped_varlen`` (the varlen reference).
- ``torch_cpu``: PyTorch's CPU flash op (``TORCH_CPU_FLASH``; ``CPU_FORWARD_DTYPE``, ``CPU_BACKWARD_DTYPE``).
- ``flash_window``: flash-attn's bottom-right window convention, shared by the three flash kernels.
- ``torch_cuda``: PyTorch's own flash kernels on CUDA (``TORCH_CUDA_FLASH``).
- ``cudnn``: PyTorch's cuDNN attention (``CUDNN``).
- ``flash_attn2``: flash-attn 2 (``FLASH_ATTN``; flash_attn imported only when it runs).
- ``flash_attn3``: flash-attn 3 (``FLASH_ATTN3``; flash_attn_interface imported only when it runs).
- ``resolver``: ``KERNELS``, ``Platform``, ``KernelCase``, ``resolve``, ``resolve_kernel``.
"""

from lctrain.attention.kernels.bands import band_tiles
from lctrain.attention.kernels.base import (
    AttentionKernel,
    accumulation_dtype,
    check_window,
    default_scale,
    visible_keys,
)
from lctrain.attention.kernels.cudnn import CUDNN
from lctrain.attention.kernels.reference import REFERENCE, reference_attention
from lctrain.attention.kernels.resolver import (
    BANDED,
    DOCUMENTS,
    KERNEL_CHOICES,
    KERNELS,
    PLAIN,
    KernelCase,
    Platform,
    Resolution,
    cannot,
    detect_platform,
    resolve,
    resolve_kernel,
)
from lctrain.attention.kernels.torch_cpu import (
    CPU_BACKWARD_DTYPE,
    CPU_FORWARD_DTYPE,
    TORCH_CPU_FLASH,
    cpu_attend,
    cpu_attend_backward,
)
from lctrain.attention.kernels.torch_cuda import TORCH_CUDA_FLASH
from lctrain.attention.kernels.varlen import looped_varlen, segment_offsets, varlen_window

__all__ = [
    "AttentionKernel",
    "BANDED",
    "CPU_BACKWARD_DTYPE",
    "CPU_FORWARD_DTYPE",
    "CUDNN",
    "DOCUMENTS",
    "KERNELS",
    "KERNEL_CHOICES",
    "KernelCase",
    "PLAIN",
    "Platform",
    "REFERENCE",
    "Resolution",
    "TORCH_CPU_FLASH",
    "TORCH_CUDA_FLASH",
    "accumulation_dtype",
    "band_tiles",
    "cannot",
    "check_window",
    "cpu_attend",
    "cpu_attend_backward",
    "default_scale",
    "detect_platform",
    "looped_varlen",
    "reference_attention",
    "resolve",
    "resolve_kernel",
    "segment_offsets",
    "varlen_window",
    "visible_keys",
]
