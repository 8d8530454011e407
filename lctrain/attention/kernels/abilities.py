"""What a kernel can do, and why not: each kernel carries an ``Abilities``; the resolver asks it per case."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PLAIN, BANDED, DOCUMENTS = "plain blocks", "banded blocks", "document groups"  # the kinds of block a case needs
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (*HALF_DTYPES, torch.float32, torch.float64)
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_DEVICE_NEEDS = {"cuda": "it needs a CUDA GPU", "cpu": "it runs on CPU only"}


@dataclass(frozen=True)
class Platform:
    """What the resolver needs to know about a device: its type and, on CUDA, what is installed and what the GPU
    and torch can do. ``resolver.detect_platform`` fills it in; tests pass made-up ones."""

    device_type: str
    capability: tuple[int, int] | None = None  # CUDA compute capability, e.g. (9, 0) for Hopper
    cudnn_version: int | None = None  # torch.backends.cudnn.version(), e.g. 91900; None: no cuDNN
    flash_attn_version: tuple[int, ...] | None = None  # the flash_attn (2) package's version; None: not installed
    flash_attn3: bool = False  # flash_attn_interface (flash-attn 3) importable
    torch_flash_window: bool = True  # aten._flash_attention_forward takes window_size_left/right


@dataclass(frozen=True)
class KernelCase:
    """What a kernel must handle: the blocks' dtype and heads (GQA when ``kv_heads < q_heads``)."""

    dtype: torch.dtype
    head_dim: int
    q_heads: int
    kv_heads: int


Reason = Callable[[Platform], str | None]  # why a kernel cannot do something on a platform, or None if it can


def can(platform: Platform) -> None:
    """The ``Reason`` of what a kernel can do everywhere."""
    return None


@dataclass(frozen=True)
class Abilities:
    """What a kernel can compute: the device type it runs on (None: any), the CUDA compute capability it needs,
    the block dtypes (None: any) and head dims it takes, and why it cannot run on a platform at all
    (``available``), do banded blocks (``banded``: a sliding window cuts them) or take document groups
    (``documents``; a kernel without a varlen mode that takes them runs one call per rectangle)."""

    device: str | None = None
    min_capability: tuple[int, int] | None = None
    available: Reason = can
    dtypes: tuple[torch.dtype, ...] | None = None
    head_dim_multiple: int = 1
    max_head_dim: int | None = None
    banded: Reason = can
    documents: Reason = can

    def unavailable(self, platform: Platform) -> str | None:
        """Why the kernel cannot run on ``platform`` at all (a setting that names it is refused), or None."""
        if self.device is not None and platform.device_type != self.device:
            needs = _DEVICE_NEEDS.get(self.device, f"it runs on {self.device} only")
            return f"{needs}, not {platform.device_type}"
        capability = platform.capability
        if self.min_capability is not None and (capability is None or capability < self.min_capability):
            major, minor = self.min_capability
            return f"it needs compute capability {major}.{minor} or newer (this GPU has {capability})"
        return self.available(platform)

    def cannot(self, platform: Platform, case: KernelCase, need: str) -> str | None:
        """Why the kernel cannot compute ``need`` blocks (``PLAIN``, ``BANDED``, ``DOCUMENTS``) of ``case`` on
        ``platform``, or None if it can."""
        reason = self.unavailable(platform)
        if reason is not None:
            return reason
        if self.dtypes is not None and case.dtype not in self.dtypes:
            return f"it computes {'/'.join(_DTYPE_NAMES[d] for d in self.dtypes)} only, not {case.dtype}"
        if case.head_dim % self.head_dim_multiple or case.head_dim > (self.max_head_dim or case.head_dim):
            return f"head_dim {case.head_dim} is not a multiple of {self.head_dim_multiple} up to {self.max_head_dim}"
        if need == BANDED:
            return self.banded(platform)
        if need == DOCUMENTS:
            return self.documents(platform)
        return None


# What the fused CUDA kernels (cuDNN's, flash-attn's) share: Ampere or newer, half precision, head_dim a multiple
# of 8 up to 256.
FUSED_CUDA = Abilities(device="cuda", min_capability=(8, 0), dtypes=HALF_DTYPES, head_dim_multiple=8, max_head_dim=256)
