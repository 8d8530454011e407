"""The resolver: per device and case, the first kernel of an order that can do the case."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import itertools
from dataclasses import dataclass, replace

import torch

from lctrain.attention.kernels.base import AttentionKernel
from lctrain.attention.kernels.cudnn import CUDNN, CUDNN_MAX_HEAD_DIM
from lctrain.attention.kernels.flash_attn2 import FLASH_ATTN, FLASH_ATTN_VARLEN_MIN
from lctrain.attention.kernels.flash_attn3 import FLASH_ATTN3
from lctrain.attention.kernels.reference import REFERENCE
from lctrain.attention.kernels.torch_cpu import TORCH_CPU_FLASH
from lctrain.attention.kernels.torch_cuda import TORCH_CUDA_FLASH, torch_flash_has_window

KERNELS = {k.name: k for k in (CUDNN, FLASH_ATTN3, FLASH_ATTN, TORCH_CUDA_FLASH, TORCH_CPU_FLASH, REFERENCE)}
KERNEL_CHOICES = ("auto", *KERNELS)
# auto's order on CUDA. cuDNN first: measured 1.64x (head_dim 64) and 1.92x (128) faster than PyTorch's flash
# kernels on an H200 (causal fwd+bwd, S=16K, bf16; docs/benchmarks.md). flash-attn 3 and 2 were not measured
# here (no machine had them); they come next where cuDNN cannot do a case (windows, document groups, head_dim >
# 128), flash-attn 3 ahead of 2 as its authors report for Hopper, then PyTorch's own flash kernels, the reference.
CUDA_ORDER = ("cudnn", "flash_attn3", "flash_attn", "torch_cuda_flash", "reference")
CPU_ORDER = ("torch_cpu_flash", "reference")


@dataclass(frozen=True)
class Platform:
    """What the resolver needs to know about a device: its type and, on CUDA, what is installed and what the GPU
    and torch can do. ``detect_platform`` fills it in; tests pass made-up ones."""

    device_type: str
    capability: tuple[int, int] | None = None  # CUDA compute capability, e.g. (9, 0) for Hopper
    cudnn_version: int | None = None  # torch.backends.cudnn.version(), e.g. 91900; None: no cuDNN
    flash_attn_version: tuple[int, ...] | None = None  # the flash_attn (2) package's version; None: not installed
    flash_attn3: bool = False  # flash_attn_interface (flash-attn 3) importable
    torch_flash_window: bool = True  # aten._flash_attention_forward takes window_size_left/right


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@functools.cache
def detect_platform(device: torch.device) -> Platform:
    """``device``'s ``Platform``: on CUDA its compute capability, cuDNN's version, flash-attn 2's version, whether
    flash-attn 3 is importable and whether torch's flash op takes a window (nothing is imported to find out, except
    flash_attn when its version is not in the installed metadata)."""
    if device.type != "cuda":
        return Platform(device.type)
    flash_attn_version = None
    if importlib.util.find_spec("flash_attn") is not None:
        try:
            version = importlib.metadata.version("flash-attn")
        except importlib.metadata.PackageNotFoundError:  # e.g. built into a source tree
            version = getattr(importlib.import_module("flash_attn"), "__version__", "0")
        flash_attn_version = _version_tuple(version)
    return Platform(
        "cuda",
        capability=torch.cuda.get_device_capability(device),
        cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        flash_attn_version=flash_attn_version,
        flash_attn3=importlib.util.find_spec("flash_attn_interface") is not None,
        torch_flash_window=torch_flash_has_window(),
    )


@dataclass(frozen=True)
class KernelCase:
    """What a kernel must handle: the blocks' dtype and heads (GQA when ``kv_heads < q_heads``)."""

    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int


PLAIN, BANDED, DOCUMENTS = "plain blocks", "banded blocks", "document groups"


def _unavailable(name: str, platform: Platform) -> str | None:
    """Why kernel ``name`` cannot run on ``platform`` at all (a setting that names it is refused), or None."""
    if name == "reference":
        return None
    if name == "torch_cpu_flash":
        return None if platform.device_type == "cpu" else f"it runs on CPU only, not {platform.device_type}"
    if platform.device_type != "cuda":
        return f"it needs a CUDA GPU, not {platform.device_type}"
    if platform.capability is None or platform.capability < (8, 0):
        return f"it needs compute capability 8.0 or newer (this GPU has {platform.capability})"
    if name == "cudnn" and (platform.cudnn_version or 0) < 90000:
        return f"it needs cuDNN 9 (torch has {platform.cudnn_version})"
    if name == "flash_attn" and platform.flash_attn_version is None:
        return "flash_attn is not installed (pip install 'lctrain[cuda]')"
    if name == "flash_attn3":
        if not platform.flash_attn3:
            return "flash_attn_interface (flash-attn 3, built from flash-attention's hopper/) is not installed"
        if platform.capability[0] != 9:
            return f"flash-attn 3 is built for Hopper (compute capability 9.x), not {platform.capability}"
    return None


def cannot(name: str, platform: Platform, case: KernelCase, need: str) -> str | None:
    """Why kernel ``name`` cannot compute ``need`` blocks of ``case`` on ``platform``, or None if it can."""
    reason = _unavailable(name, platform)
    if reason is not None or name == "reference":
        return reason
    if name == "torch_cpu_flash":
        return None if case.dtype.is_floating_point else f"{case.dtype} is not a float dtype"
    if case.dtype not in (torch.float16, torch.bfloat16):
        return f"it computes fp16/bf16 only, not {case.dtype}"
    max_dim = CUDNN_MAX_HEAD_DIM if name == "cudnn" else 256
    if case.head_dim % 8 or case.head_dim > max_dim:
        return f"head_dim {case.head_dim} is not a multiple of 8 up to {max_dim}"
    if name == "cudnn" and need == BANDED:
        return "PyTorch's cuDNN op takes no sliding window"
    if name == "cudnn" and need == DOCUMENTS:
        return "its ragged (varlen) mode is not used: torch's own varlen_attn keeps it off"
    if name == "torch_cuda_flash" and need in (BANDED, DOCUMENTS) and not platform.torch_flash_window:
        return "this torch's aten._flash_attention_forward takes no window"
    if name == "flash_attn" and need == DOCUMENTS and platform.flash_attn_version < FLASH_ATTN_VARLEN_MIN:
        return "flash-attn < 2.6 returns a padded varlen lse"
    return None


@dataclass(frozen=True)
class Resolution:
    """The kernel of each kind of block, and why: ``plain`` (causal squares and full rectangles), ``banded``
    (blocks a sliding window cuts), ``documents`` (block-diagonal groups of document rectangles in one varlen
    call; None: one call per rectangle)."""

    choice: str
    plain: AttentionKernel
    banded: AttentionKernel
    documents: AttentionKernel | None
    notes: tuple[tuple[str, str], ...]  # (kind of block, why the first kernel of the order was passed over)
    order: tuple[str, ...] = ()

    def kernel(self) -> AttentionKernel:
        """One kernel that sends each block to its kernel (the plain kernel itself when it does everything)."""
        plain, banded, documents = self.plain, self.banded, self.documents
        if banded is plain and documents is plain:
            return plain
        if banded is plain and documents is None:
            return plain if plain.varlen_forward is None else replace(plain, varlen_forward=None, varlen_backward=None)

        def forward(q, k, v, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
            chosen = plain if window_left is None else banded
            return chosen.forward(q, k, v, causal=causal, scale=scale, window_left=window_left)

        def backward(dout, q, k, v, out, lse, *, causal, scale, window_left=None):  # noqa: ANN001, ANN202
            chosen = plain if window_left is None else banded
            return chosen.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window_left=window_left)

        return AttentionKernel(
            self.describe_short(),
            forward,
            backward,
            plain.compute_dtype,
            documents.varlen_forward if documents is not None else None,
            documents.varlen_backward if documents is not None else None,
        )

    def describe_short(self) -> str:
        parts = [self.plain.name]
        if self.banded is not self.plain:
            parts.append(f"banded blocks: {self.banded.name}")
        if self.documents is not None and self.documents is not self.plain:
            parts.append(f"document groups: {self.documents.name}")
        return parts[0] if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})"

    def describe(self) -> str:
        """One line for the job's log: each kind of block's kernel, why another was passed over, and the order."""
        why = dict(self.notes)

        def slot(need: str, kernel: AttentionKernel | None) -> str:
            name = "one call per rectangle" if kernel is None else kernel.name
            return f"{need} {name}" + (f" ({why[need]})" if need in why else "")

        order = " > ".join(self.order)
        return (
            f"{slot(PLAIN, self.plain)}, {slot(BANDED, self.banded)}, {slot(DOCUMENTS, self.documents)} "
            f"[parallel.attention_kernel={self.choice}: the first of {order} that can do each]"
        )


def resolve(
    device: torch.device,
    case: KernelCase,
    *,
    choice: str = "auto",
    platform: Platform | None = None,
) -> Resolution:
    """Pick the kernel of each kind of block for ``case`` on ``device``.

    ``choice="auto"``: the first kernel of the device's order (``CUDA_ORDER``, ``CPU_ORDER``) that can do the
    kind of block. A kernel name puts that kernel first; where it cannot do a kind of block (a window, document
    groups, a head_dim, a dtype) the auto order takes over for that kind, and the reason is noted. A name that
    cannot run on this device at all (another device type, not installed) raises ``ValueError``.
    """
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"attention kernel {choice!r} is not one of {KERNEL_CHOICES}")
    platform = platform or detect_platform(device)
    if choice != "auto":
        reason = _unavailable(choice, platform)
        if reason is not None:
            raise ValueError(
                f"parallel.attention_kernel={choice} cannot run on this {platform.device_type} device: {reason}; "
                f"use auto (picks per device and case) or one of {KERNEL_CHOICES[1:]}"
            )
    order = CPU_ORDER if platform.device_type == "cpu" else CUDA_ORDER if platform.device_type == "cuda" else ()
    order = (*order, "reference") if "reference" not in order else order
    if choice != "auto":
        order = (choice, *(name for name in order if name != choice))
    notes = []

    def pick(need: str) -> AttentionKernel | None:
        for name in order:
            reason = cannot(name, platform, case, need)
            if reason is None:
                if need == DOCUMENTS and KERNELS[name].varlen_forward is None:
                    return None  # the first kernel that can has no varlen mode: one call per rectangle
                return KERNELS[name]
            if name == order[0]:
                notes.append((need, f"not {name}: {reason}"))
        return None

    plain = pick(PLAIN)
    banded = pick(BANDED)
    documents = pick(DOCUMENTS)
    assert plain is not None and banded is not None  # the reference does everything
    return Resolution(choice, plain, banded, documents, tuple(notes), order)


@functools.cache
def resolve_kernel(
    device: torch.device,
    dtype: torch.dtype,
    *,
    head_dim: int = 64,
    q_heads: int = 1,
    kv_heads: int = 1,
    choice: str = "auto",
) -> AttentionKernel:
    """The kernel ring attention runs blocks of ``dtype`` on ``device`` with (see ``resolve``)."""
    return resolve(device, KernelCase(dtype, head_dim, q_heads, kv_heads), choice=choice).kernel()
