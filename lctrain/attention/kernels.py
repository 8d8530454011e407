"""Blockwise attention kernels that return the log-sum-exp.

Every kernel works on one (query block, key block) pair and has the same signature:

    forward(q, k, v, *, causal, scale) -> (out, lse)
    backward(dout, q, k, v, out, lse, *, causal, scale) -> (dq, dk, dv)

Shapes: q, out, dout, dq ``[B, Sq, Hq, D]``; k, v, dk, dv ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA is
handled inside the kernel; K and V are never repeated by the caller); lse ``[B, Hq, Sq]`` in the accumulation
dtype (``accumulation_dtype``). ``out``, ``dq``, ``dk``, ``dv`` come back in the input dtype or in the
accumulation dtype (callers accumulate in the latter and cast once). ``causal`` is top-left aligned and is only
used on square (diagonal) blocks. ``backward`` takes the *final* ``out`` and ``lse`` of the whole row (after
merging all key blocks), which makes each block's gradient exact on its own.

``resolve_kernel`` picks one kernel per (device, dtype): flash-attn on CUDA when installed, PyTorch's fused
flash kernels (CUDA for half dtypes, CPU for all float dtypes), else the plain reference.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

KernelForward = Callable[..., tuple[Tensor, Tensor]]
KernelBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype


@dataclass(frozen=True)
class AttentionKernel:
    """A blockwise attention kernel: a name, its forward/backward functions (signatures in the module doc), and
    the dtype it computes in for a given input dtype (callers that keep tensors for the backward may keep them in
    that dtype to save the kernel a conversion)."""

    name: str
    forward: KernelForward
    backward: KernelBackward
    compute_dtype: Callable[[torch.dtype], torch.dtype] = _same_dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that ``out`` and ``lse`` are accumulated in across blocks: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------------------------------------------------------
# Reference: plain math, any device and dtype. Slow and obviously correct.
# ---------------------------------------------------------------------------------------------------------------


def _scores(q: Tensor, k: Tensor, *, causal: bool, scale: float) -> Tensor:
    """Scaled scores ``[B, Hq, Sq, Sk]`` in the accumulation dtype, K heads repeated for GQA, causal top-left."""
    compute = accumulation_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    qf = q.to(compute).transpose(1, 2)  # [B, Sq, Hq, D] -> [B, Hq, Sq, D]
    kf = k.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, Sk, D]
    scores = qf @ kf.transpose(-1, -2) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    """``exp(scores - lse)``; rows with ``lse = -inf`` (no visible key) give zeros, not NaN."""
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse.unsqueeze(-1))


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: float | None = None) -> Tensor:
    """Differentiable math attention in the inputs' dtype: q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``.

    The ground truth for tests (called on float64 inputs) and the obviously-correct twin of the fast kernels.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    groups = q.shape[2] // k.shape[2]
    scores = _scores(q, k, causal=causal, scale=scale)
    probs = torch.softmax(scores, dim=-1)
    vf = v.to(scores.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, Sk, D]
    return (probs @ vf).transpose(1, 2).to(q.dtype)  # [B, Hq, Sq, D] -> [B, Sq, Hq, D]


def _reference_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    groups = q.shape[2] // k.shape[2]
    scores = _scores(q, k, causal=causal, scale=scale)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Sq]
    vf = v.to(scores.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)
    out = (_probs(scores, lse) @ vf).transpose(1, 2)
    return out, lse


def _reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    batch, sk, hkv, dim = k.shape
    groups = q.shape[2] // hkv
    scores = _scores(q, k, causal=causal, scale=scale)
    compute = scores.dtype
    probs = _probs(scores, lse.to(compute))  # [B, Hq, Sq, Sk]
    qf, doutf, outf = (t.to(compute).transpose(1, 2) for t in (q, dout, out))  # [B, Hq, Sq, D]
    kf, vf = (t.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))  # [B, Hq, Sk, D]
    dv = probs.transpose(-1, -2) @ doutf
    delta = (doutf * outf).sum(-1, keepdim=True)  # [B, Hq, Sq, 1]
    dscores = probs * (doutf @ vf.transpose(-1, -2) - delta)
    dq = dscores @ kf * scale
    dk = dscores.transpose(-1, -2) @ qf * scale

    def fold_groups(grad: Tensor) -> Tensor:  # [B, Hq, Sk, D] -> [B, Sk, Hkv, D], summed over each GQA group
        return grad.view(batch, hkv, groups, sk, dim).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), fold_groups(dk), fold_groups(dv)


REFERENCE = AttentionKernel("reference", _reference_forward, _reference_backward)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch fused flash kernels (ATen ops). They take [B, H, S, D]; transposed views of [B, S, H, D] are accepted.
# ---------------------------------------------------------------------------------------------------------------


def _bhsd(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.transpose(1, 2) for t in tensors)  # [B, S, H, D] <-> [B, H, S, D]


def _cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision blocks run in fp32 on CPU: PyTorch's CPU flash kernels emulate bf16 on CPUs without native
    bf16 (the backward 6-7x slower than fp32 on an AVX2 EPYC) and fp32 keeps each block's result unrounded."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _cpu_compute(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.to(_cpu_compute_dtype(t.dtype)) for t in tensors)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_bhsd(*_cpu_compute(q, k, v)), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_bhsd(*_cpu_compute(dout, q, k, v, out)), lse.contiguous(), 0.0, causal, scale=scale
    )
    return _bhsd(dq, dk, dv)


TORCH_CPU_FLASH = AttentionKernel("torch_cpu_flash", _cpu_forward, _cpu_backward, _cpu_compute_dtype)


def _repeat_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Repeat KV heads locally for kernels without GQA support (after communication, never before)."""
    groups = q.shape[2] // k.shape[2]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)


def _cuda_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    k, v = _repeat_kv(q, k, v)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(*_bhsd(q, k, v), 0.0, causal, False, scale=scale)
    return out.transpose(1, 2), lse


def _cuda_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    hkv = k.shape[2]
    k_full, v_full = _repeat_kv(q, k, v)
    unused_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout is 0: the RNG state is not read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        *_bhsd(dout, q, k_full, v_full, out),
        lse.contiguous(),
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        unused_rng,
        unused_rng,
        scale=scale,
    )
    dq, dk, dv = _bhsd(dq, dk, dv)
    if dk.shape[2] != hkv:  # fold repeated heads back: [B, Sk, Hq, D] -> [B, Sk, Hkv, D]
        dk = dk.unflatten(2, (hkv, -1)).sum(3)
        dv = dv.unflatten(2, (hkv, -1)).sum(3)
    return dq, dk, dv


TORCH_CUDA_FLASH = AttentionKernel("torch_cuda_flash", _cuda_forward, _cuda_backward)


# ---------------------------------------------------------------------------------------------------------------
# flash-attn (optional extra `cuda`): [B, S, H, D] natively, GQA natively, lse [B, H, S] fp32.
# ---------------------------------------------------------------------------------------------------------------


def _flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, 0.0, scale, causal, return_attn_probs=True)
    return out, lse


def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_backward as backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # flash-attn 2.7 split `window_size` into left/right; accept both spellings of the private signature.
    params = inspect.signature(backward).parameters
    window = (
        {"window_size_left": -1, "window_size_right": -1} if "window_size_left" in params else {"window_size": (-1, -1)}
    )
    backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse.contiguous(),
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **window,
    )
    return dq, dk, dv


FLASH_ATTN = AttentionKernel("flash_attn", _flash_attn_forward, _flash_attn_backward)


@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_kernel(device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The fastest exact kernel for tensors on ``device`` with ``dtype`` (see the module doc for the order)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and half:
        return FLASH_ATTN if _flash_attn_installed() else TORCH_CUDA_FLASH
    if device.type == "cpu" and dtype.is_floating_point:
        return TORCH_CPU_FLASH
    return REFERENCE
