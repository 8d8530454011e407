"""Blockwise attention kernels that return the log-sum-exp.

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

``resolve_kernel`` picks one kernel per (device, dtype): flash-attn on CUDA when installed, PyTorch's fused
flash kernels (CUDA for half dtypes, CPU for all float dtypes), else the plain reference. flash-attn applies the
band itself (``window_size``); PyTorch's flash ops have no window, so banded blocks run in row tiles of
``BAND_TILE_ROWS`` queries, each against only the keys its rows see (``band_tiles``), with a mask where the band
cuts the tile: an additive mask on CPU, the reference math on CUDA (whose flash op takes no mask).
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


def check_window(window: int | None, causal: bool) -> None:
    """A sliding window is a positive number of keys (the query's own included) and needs a causal mask."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"window={window!r} must be a positive int, the number of keys each query sees (itself included), as "
            f"Hugging Face's sliding_window; use window=None for attention without a window"
        )
    if not causal:
        raise ValueError(
            f"window={window} needs causal=True: a sliding window is defined for causal attention only (query i "
            f"sees keys j with i - window < j <= i); drop the window or make the attention causal"
        )


def visible_keys(
    q_len: int,
    k_len: int,
    *,
    causal: bool,
    window_left: int | None,
    device: torch.device,
    row_start: int = 0,
    col_start: int = 0,
) -> Tensor | None:
    """Which keys each query of a block sees, bool ``[q_len, k_len]``, or None when every query sees every key.

    Rows ``row_start + a`` and columns ``col_start + b`` of a block masked by ``causal`` and ``window_left``
    (top-left aligned, as in the module doc): a tile of a block passes its offsets into the block.
    """
    last_row, last_col = row_start + q_len - 1, col_start + k_len - 1
    causal_cuts = causal and last_col > row_start
    window_cuts = window_left is not None and last_row - window_left > col_start
    if not (causal_cuts or window_cuts):
        return None
    rows = torch.arange(row_start, last_row + 1, device=device)[:, None]
    cols = torch.arange(col_start, last_col + 1, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal_cuts:
        visible &= cols <= rows
    if window_cuts:
        visible &= cols >= rows - window_left
    return visible


# ---------------------------------------------------------------------------------------------------------------
# Reference: plain math, any device and dtype. Slow and obviously correct.
# ---------------------------------------------------------------------------------------------------------------


def _scores(q: Tensor, k: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    """Scaled scores ``[B, Hq, Sq, Sk]`` in the accumulation dtype, K heads repeated for GQA, ``-inf`` where a
    query does not see a key (``visible``, bool ``[Sq, Sk]``; None: it sees all)."""
    compute = accumulation_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    qf = q.to(compute).transpose(1, 2)  # [B, Sq, Hq, D] -> [B, Hq, Sq, D]
    kf = k.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, Sk, D]
    scores = qf @ kf.transpose(-1, -2) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    """``exp(scores - lse)``; rows with ``lse = -inf`` (no visible key) give zeros, not NaN."""
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse.unsqueeze(-1))


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: float | None = None, window: int | None = None
) -> Tensor:
    """Differentiable math attention in the inputs' dtype: q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``.

    ``window``: query ``i`` sees only keys ``j`` with ``i - window < j <= i`` (needs ``causal``). The ground truth
    for tests (called on float64 inputs) and the obviously-correct twin of the fast kernels.
    """
    check_window(window, causal)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    groups = q.shape[2] // k.shape[2]
    window_left = None if window is None else window - 1
    visible = visible_keys(q.shape[1], k.shape[1], causal=causal, window_left=window_left, device=q.device)
    scores = _scores(q, k, visible, scale)
    probs = torch.softmax(scores, dim=-1)
    vf = v.to(scores.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)  # [B, Hq, Sk, D]
    return (probs @ vf).transpose(1, 2).to(q.dtype)  # [B, Hq, Sq, D] -> [B, Sq, Hq, D]


def _math_forward(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    groups = q.shape[2] // k.shape[2]
    scores = _scores(q, k, visible, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Sq]
    vf = v.to(scores.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)
    out = (_probs(scores, lse) @ vf).transpose(1, 2)
    return out, lse


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    batch, sk, hkv, dim = k.shape
    groups = q.shape[2] // hkv
    scores = _scores(q, k, visible, scale)
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


def _reference_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    visible = visible_keys(q.shape[1], k.shape[1], causal=causal, window_left=window_left, device=q.device)
    return _math_forward(q, k, v, visible, scale)


def _reference_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    window_left: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    visible = visible_keys(q.shape[1], k.shape[1], causal=causal, window_left=window_left, device=q.device)
    return _math_backward(dout, q, k, v, out, lse, visible, scale)


REFERENCE = AttentionKernel("reference", _reference_forward, _reference_backward)


# ---------------------------------------------------------------------------------------------------------------
# Banded blocks for kernels without a window: row tiles, each against the keys its rows see.
# ---------------------------------------------------------------------------------------------------------------

BAND_TILE_ROWS = 256  # queries per tile; 128 and 256 were the fastest of 64-1024 on CPU (bench_window_kernel.py)


def band_tiles(q_len: int, k_len: int, *, causal: bool, window_left: int) -> list[tuple[slice, slice]]:
    """(rows, cols) of each row tile of a banded block: ``BAND_TILE_ROWS`` queries and the keys they see.

    Rows ``[a0, a1)`` see columns from ``a0 - window_left`` up to ``a1 - 1`` (causal) or the last one, so a tile
    costs ``tile × (tile + window)`` pairs however wide the block: the work stays proportional to the band.
    """
    tiles = []
    for a0 in range(0, q_len, BAND_TILE_ROWS):
        a1 = min(a0 + BAND_TILE_ROWS, q_len)
        tiles.append((slice(a0, a1), slice(max(0, a0 - window_left), min(k_len, a1) if causal else k_len)))
    return tiles


TileForward = Callable[[Tensor, Tensor, Tensor, Tensor | None, float], tuple[Tensor, Tensor]]
TileBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


def _tiled_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window_left: int, scale: float, attend: TileForward
) -> tuple[Tensor, Tensor]:
    """``attend(q, k, v, visible, scale) -> (out, lse)`` on each row tile; tiles hold disjoint rows: no merge."""
    outs, lses = [], []
    for rows, cols in band_tiles(q.shape[1], k.shape[1], causal=causal, window_left=window_left):
        visible = visible_keys(
            rows.stop - rows.start,
            cols.stop - cols.start,
            causal=causal,
            window_left=window_left,
            device=q.device,
            row_start=rows.start,
            col_start=cols.start,
        )
        out, lse = attend(q[:, rows], k[:, cols], v[:, cols], visible, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _tiled_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    window_left: int,
    scale: float,
    attend_backward: TileBackward,
) -> tuple[Tensor, Tensor, Tensor]:
    """``attend_backward(dout, q, k, v, out, lse, visible, scale)`` on each row tile; dK/dV summed over tiles in
    the accumulation dtype."""
    acc_dtype = accumulation_dtype(q.dtype)
    dq = torch.empty(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    for rows, cols in band_tiles(q.shape[1], k.shape[1], causal=causal, window_left=window_left):
        visible = visible_keys(
            rows.stop - rows.start,
            cols.stop - cols.start,
            causal=causal,
            window_left=window_left,
            device=q.device,
            row_start=rows.start,
            col_start=cols.start,
        )
        dq_tile, dk_tile, dv_tile = attend_backward(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows], visible, scale
        )
        dq[:, rows] = dq_tile
        dk[:, cols] += dk_tile
        dv[:, cols] += dv_tile
    return dq, dk, dv


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


def _additive_mask(visible: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The CPU op takes a float mask, not a bool one: 0 where a query sees a key, -inf elsewhere."""
    if visible is None:
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _cpu_attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    q, k, v = _cpu_compute(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_bhsd(q, k, v), 0.0, False, attn_mask=_additive_mask(visible, q.dtype), scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dout, q, k, v, out = _cpu_compute(dout, q, k, v, out)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_bhsd(dout, q, k, v, out),
        lse.contiguous(),
        0.0,
        False,
        attn_mask=_additive_mask(visible, q.dtype),
        scale=scale,
    )
    return _bhsd(dq, dk, dv)


def _cpu_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    if window_left is not None:
        return _tiled_forward(q, k, v, causal=causal, window_left=window_left, scale=scale, attend=_cpu_attend)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_bhsd(*_cpu_compute(q, k, v)), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    window_left: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    if window_left is not None:
        return _tiled_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            causal=causal,
            window_left=window_left,
            scale=scale,
            attend_backward=_cpu_attend_backward,
        )
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


def _cuda_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    """PyTorch's CUDA flash op; it has neither a window nor a mask, so a banded block falls back to the reference
    math in row tiles (``band_tiles``): exact, memory ``B·Hq·tile·(tile + window)`` per tile, not fast (flash-attn
    is the kernel for sliding windows on CUDA)."""
    if window_left is not None:
        return _tiled_forward(q, k, v, causal=causal, window_left=window_left, scale=scale, attend=_math_forward)
    k, v = _repeat_kv(q, k, v)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(*_bhsd(q, k, v), 0.0, causal, False, scale=scale)
    return out.transpose(1, 2), lse


def _cuda_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    window_left: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    if window_left is not None:  # the reference math in row tiles, as in the forward
        return _tiled_backward(
            dout, q, k, v, out, lse, causal=causal, window_left=window_left, scale=scale, attend_backward=_math_backward
        )
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


def _flash_window(q_len: int, k_len: int, *, causal: bool, window_left: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: query ``i`` sees keys ``i + k_len - q_len - left`` to
    ``i + k_len - q_len + right`` (bottom-right aligned; -1: no limit). Our band is top-left aligned, hence the
    shift (``>= 0``: the last query row sees a key); ``causal`` makes flash-attn's right edge 0 itself."""
    if window_left is None:
        return (-1, -1)
    return (window_left + k_len - q_len, 0 if causal else -1)


def _flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_func

    window_size = _flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    out, lse, _ = flash_attn_func(q, k, v, 0.0, scale, causal, window_size=window_size, return_attn_probs=True)
    return out, lse


def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    window_left: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_backward as backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    left, right = _flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    # flash-attn 2.7 split `window_size` into left/right; accept both spellings of the private signature.
    params = inspect.signature(backward).parameters
    window = (
        {"window_size_left": left, "window_size_right": right}
        if "window_size_left" in params
        else {"window_size": (left, right)}
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
