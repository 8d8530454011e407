"""The resolver: per device and case, the first kernel of an order whose ``abilities`` say it can do the case."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import itertools
from dataclasses import dataclass, replace

import torch

from lctrain.attention.kernels.abilities import BANDED, DOCUMENTS, PLAIN, KernelCase, Platform
from lctrain.attention.kernels.base import AttentionKernel
from lctrain.attention.kernels.cudnn import CUDNN
from lctrain.attention.kernels.flash_attn2 import FLASH_ATTN
from lctrain.attention.kernels.flash_attn3 import FLASH_ATTN3
from lctrain.attention.kernels.reference import REFERENCE
from lctrain.attention.kernels.torch_cpu import TORCH_CPU_FLASH
from lctrain.attention.kernels.torch_cuda import TORCH_CUDA_FLASH, torch_flash_has_window
from lctrain.rules import KERNEL_CHOICES, check_kernel_choice

KERNELS = {k.name: k for k in (CUDNN, FLASH_ATTN3, FLASH_ATTN, TORCH_CUDA_FLASH, TORCH_CPU_FLASH, REFERENCE)}
# auto's order per device type (others: the reference). On CUDA cuDNN first, the fastest measured; flash-attn 3
# and 2 take what it cannot do (windows, document groups, head_dim > 128), then PyTorch's own flash kernels
# (docs/parallelism.md, "Attention kernels", says why, with the measurements in docs/benchmarks.md).
ORDERS = {
    "cuda": ("cudnn", "flash_attn3", "flash_attn", "torch_cuda_flash", "reference"),
    "cpu": ("torch_cpu_flash", "reference"),
}


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
    dtype_note: str | None = None  # how the plain kernel computes blocks of the case's dtype, if not in it

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
            plain.backward_dtype,
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
        dtypes = "" if self.dtype_note is None else f"; {self.dtype_note}"
        return (
            f"{slot(PLAIN, self.plain)}, {slot(BANDED, self.banded)}, {slot(DOCUMENTS, self.documents)}{dtypes} "
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

    ``choice="auto"``: the first kernel of the device's order (``ORDERS``) that can do the kind of block (its
    ``abilities``). A kernel name puts that kernel first; where it cannot do a kind of block (a window, document
    groups, a head_dim, a dtype) the auto order takes over for that kind, and the reason is noted. A name that
    cannot run on this device at all (another device type, not installed) raises ``ValueError``.
    """
    check_kernel_choice(choice, setting="parallel.attention_kernel")
    platform = platform or detect_platform(device)
    order = ORDERS.get(platform.device_type, ("reference",))
    if choice != "auto":
        reason = KERNELS[choice].abilities.unavailable(platform)
        if reason is not None:
            raise ValueError(
                f"parallel.attention_kernel={choice} cannot run on this {platform.device_type} device: {reason}; "
                f"use auto (picks per device and case) or one of {KERNEL_CHOICES[1:]}"
            )
        order = (choice, *(name for name in order if name != choice))
    notes = []

    def pick(need: str) -> AttentionKernel | None:
        for name in order:
            reason = KERNELS[name].abilities.cannot(platform, case, need)
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
    return Resolution(choice, plain, banded, documents, tuple(notes), order, plain.dtype_note(case.dtype))


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
