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
(``auto`` or a name) chooses the order; the module's tables say what each kernel cannot do and why. Kernels
without a window (PyTorch's CPU op) run banded blocks in row tiles of ``BAND_TILE_ROWS`` queries, each against
only the keys its rows see (``band_tiles``), with an additive mask where the band cuts the tile.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

KernelForward = Callable[..., tuple[Tensor, Tensor]]
KernelBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]
Segments = tuple[tuple[int, int], ...]  # (query rows, key rows) of each document rectangle of a group


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype


@dataclass(frozen=True)
class AttentionKernel:
    """A blockwise attention kernel: a name, its forward/backward functions (signatures in the module doc), and
    the dtype its forward computes in for a given input dtype (callers that keep tensors for the backward may keep
    them in that dtype to save the kernel a conversion), and its varlen mode (None: none)."""

    name: str
    forward: KernelForward
    backward: KernelBackward
    compute_dtype: Callable[[torch.dtype], torch.dtype] = _same_dtype
    varlen_forward: Callable[..., tuple[Tensor, Tensor]] | None = None
    varlen_backward: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None


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
    if window_left is not None:  # row tiles keep the scores of a wide banded block small
        return _tiled_forward(q, k, v, causal=causal, window_left=window_left, scale=scale, attend=_math_forward)
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
    if window_left is not None:
        return _tiled_backward(
            dout, q, k, v, out, lse, causal=causal, window_left=window_left, scale=scale, attend_backward=_math_backward
        )
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
# Document groups (varlen): block-diagonal runs of document rectangles in one call.
# ---------------------------------------------------------------------------------------------------------------


def segment_offsets(lengths: Sequence[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: where each segment starts (and the last one ends)."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return offsets


def looped_varlen(kernel: AttentionKernel) -> AttentionKernel:
    """``kernel`` with a varlen interface that calls it once per segment: the reference for the varlen kernels
    (and a way to test the grouping on CPU, where no kernel has a varlen mode)."""

    def varlen_forward(
        q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
    ) -> tuple[Tensor, Tensor]:
        rows, cols = segment_offsets(s[0] for s in segments), segment_offsets(s[1] for s in segments)
        outs, lses = [], []
        for i in range(len(segments)):
            out, lse = kernel.forward(
                q[:, rows[i] : rows[i + 1]],
                k[:, cols[i] : cols[i + 1]],
                v[:, cols[i] : cols[i + 1]],
                causal=causal,
                scale=scale,
                window_left=window_left,
            )
            outs.append(out.to(accumulation_dtype(q.dtype)))
            lses.append(lse)
        return torch.cat(outs, dim=1), torch.cat(lses, dim=2)

    def varlen_backward(
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        segments: Segments,
        *,
        causal: bool,
        scale: float,
        window_left=None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        rows, cols = segment_offsets(s[0] for s in segments), segment_offsets(s[1] for s in segments)
        grads: list[list[Tensor]] = [[], [], []]
        for i in range(len(segments)):
            r, c = slice(rows[i], rows[i + 1]), slice(cols[i], cols[i + 1])
            block_grads = kernel.backward(
                dout[:, r],
                q[:, r],
                k[:, c],
                v[:, c],
                out[:, r],
                lse[:, :, r],
                causal=causal,
                scale=scale,
                window_left=window_left,
            )
            for acc, grad in zip(grads, block_grads):
                acc.append(grad.to(accumulation_dtype(q.dtype)))
        return tuple(torch.cat(g, dim=1) for g in grads)

    return replace(kernel, name=f"{kernel.name}_looped", varlen_forward=varlen_forward, varlen_backward=varlen_backward)


@functools.lru_cache(maxsize=256)
def _cu_seqlens(segments: Segments, batch: int, device: torch.device) -> tuple[Tensor, Tensor, int, int]:
    """int32 ``cu_seqlens_q``, ``cu_seqlens_k`` of ``batch`` rows of ``segments`` packed batch-major (row b's
    segments, then row b + 1's), on ``device``, and the longest query and key segment. The plan, and so the
    segments, repeat in every layer: the tensors are built (and copied to the device) once."""
    q_lens, k_lens = [s[0] for s in segments] * batch, [s[1] for s in segments] * batch
    cu_q = torch.tensor(segment_offsets(q_lens), dtype=torch.int32, device=device)
    cu_k = torch.tensor(segment_offsets(k_lens), dtype=torch.int32, device=device)
    return cu_q, cu_k, max(q_lens), max(k_lens)


def _pack(t: Tensor) -> Tensor:
    """``[B, S, H, D]`` -> ``[B·S, H, D]`` (a view when the rows are contiguous, as for B = 1)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _varlen_window(segments: Segments, *, causal: bool, window_left: int | None) -> tuple[int, int]:
    """flash-attn's bottom-right ``window_size`` of a document group; ``group_documents`` only groups segments
    for which it is the same (causal squares, or plain rectangles)."""
    windows = {_flash_window(q_len, k_len, causal=causal, window_left=window_left) for q_len, k_len in segments}
    if len(windows) != 1:
        raise ValueError(f"segments {segments} need different flash windows {windows}: group them separately")
    return windows.pop()


def _unpack_lse(lse: Tensor, batch: int) -> Tensor:
    """A varlen kernel's lse ``[H, B·S]`` -> ``[B, H, S]``."""
    return lse.unflatten(1, (batch, -1)).transpose(0, 1)


def _pack_lse(lse: Tensor) -> Tensor:
    """``[B, H, S]`` -> the varlen layout ``[H, B·S]``, fp32, contiguous."""
    return lse.float().transpose(0, 1).reshape(lse.shape[1], -1).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's CPU flash op. It takes [B, H, S, D]; blocks are copied into that layout, contiguous, in the compute
# dtype (one copy, the cast the op needs anyway): on a zigzag ring's blocks at S = 8K and 16K the op runs up to
# 14 % faster on contiguous inputs than on transposed views of [B, S, H, D] (docs/benchmarks.md, "CPU ring").
# ---------------------------------------------------------------------------------------------------------------


def _bhsd(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.transpose(1, 2) for t in tensors)  # [B, S, H, D] <-> [B, H, S, D]


# The CPU op's compute dtype for half-precision blocks, per pass, chosen by measurement (benchmarks/
# bench_attention.py --only kernel; docs/benchmarks.md, "CPU ring"): on the development machine (Xeon, AVX-512
# without bf16 instructions) the bf16 forward took 0.92-1.49x the fp32 time on a zigzag ring's blocks at S = 8K
# and 16K (no consistent gain, and its output is rounded) and the bf16 backward 3.1-4.2x. Re-measure on a CPU
# with native bf16 (AMX) before changing them.
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


def _cpu_attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    q, k, v = _cpu_operands(q, k, v, pass_dtype=CPU_FORWARD_DTYPE)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_additive_mask(visible, q.dtype), scale=scale
    )
    return out.transpose(1, 2), lse


def _cpu_attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dout, q, k, v, out = _cpu_operands(dout, q, k, v, out, pass_dtype=CPU_BACKWARD_DTYPE)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.contiguous(), 0.0, False, attn_mask=_additive_mask(visible, q.dtype), scale=scale
    )
    return _bhsd(dq, dk, dv)


def _cpu_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    if window_left is not None:
        return _tiled_forward(q, k, v, causal=causal, window_left=window_left, scale=scale, attend=_cpu_attend)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_cpu_operands(q, k, v, pass_dtype=CPU_FORWARD_DTYPE), 0.0, causal, scale=scale
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
        *_cpu_operands(dout, q, k, v, out, pass_dtype=CPU_BACKWARD_DTYPE), lse.contiguous(), 0.0, causal, scale=scale
    )
    return _bhsd(dq, dk, dv)


TORCH_CPU_FLASH = AttentionKernel("torch_cpu_flash", _cpu_forward, _cpu_backward, _cpu_compute_dtype)


# ---------------------------------------------------------------------------------------------------------------
# flash-attn's window convention, shared by PyTorch's own flash kernels, flash-attn 2 and flash-attn 3.
# ---------------------------------------------------------------------------------------------------------------


def _flash_window(q_len: int, k_len: int, *, causal: bool, window_left: int | None) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: query ``i`` sees keys ``i + k_len - q_len - left`` to
    ``i + k_len - q_len + right`` (bottom-right aligned; -1: no limit). Our band is top-left aligned, hence the
    shift (``>= 0``: the last query row sees a key); ``causal`` makes flash-attn's right edge 0 itself."""
    if window_left is None:
        return (-1, -1)
    return (window_left + k_len - q_len, 0 if causal else -1)


def _parameters(fn: Callable) -> set[str]:
    """Parameter names of ``fn``, looking through ``torch.library.custom_op`` wrappers (whose own signature is
    ``(*args, **kwargs)``): flash-attn's private functions changed their argument names between versions."""
    return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _window_arguments(fn: Callable, left: int, right: int) -> dict:
    """``window_size_left=, window_size_right=`` or ``window_size=(left, right)``, as ``fn`` spells it."""
    if "window_size_left" in _parameters(fn):
        return {"window_size_left": left, "window_size_right": right}
    return {"window_size": (left, right)}


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's own flash kernels on CUDA (flash-attn 2 compiled into torch): aten._flash_attention_forward/backward
# take [B, S, H, D] (or packed [T, H, D] with cu_seqlens: varlen), GQA natively, a window (window_size_left/right),
# and return the lse [B, H, S] (varlen: [H, T]) in fp32.
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _torch_flash_has_window() -> bool:
    """Whether this torch's ``aten._flash_attention_forward`` takes a window (it does since torch 2.5 or so)."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return "window_size_left" in {argument.name for argument in schema.arguments}


def _dropout_state(device: torch.device) -> tuple[Tensor, Tensor]:
    """The RNG state arguments of the backward ops; dropout is 0, so they are not read (as in PyTorch's own
    ``torch.nn.attention.varlen``)."""
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _torch_flash_call(
    q: Tensor, k: Tensor, v: Tensor, cu: tuple | None, *, causal: bool, scale: float, window: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    cu_q, cu_k, max_q, max_k = cu if cu is not None else (None, None, q.shape[-3], k.shape[-3])
    extra = {} if window == (-1, -1) else {"window_size_left": window[0], "window_size_right": window[1]}
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **extra
    )
    return out, lse


def _torch_flash_backward_call(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu: tuple | None,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    cu_q, cu_k, max_q, max_k = cu if cu is not None else (None, None, q.shape[-3], k.shape[-3])
    extra = {} if window == (-1, -1) else {"window_size_left": window[0], "window_size_right": window[1]}
    rng_state, unused = _dropout_state(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale, **extra
    )
    return dq, dk, dv


def _torch_cuda_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    window = _flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    return _torch_flash_call(q, k, v, None, causal=causal, scale=scale, window=window)


def _torch_cuda_backward(
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
    window = _flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    return _torch_flash_backward_call(
        dout, q, k, v, out.to(q.dtype), lse.float().contiguous(), None, causal=causal, scale=scale, window=window
    )


def _torch_cuda_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
) -> tuple[Tensor, Tensor]:
    batch = q.shape[0]
    window = _varlen_window(segments, causal=causal, window_left=window_left)
    cu = _cu_seqlens(segments, batch, q.device)
    out, lse = _torch_flash_call(_pack(q), _pack(k), _pack(v), cu, causal=causal, scale=scale, window=window)
    return out.unflatten(0, (batch, -1)), _unpack_lse(lse, batch)


def _torch_cuda_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    segments: Segments,
    *,
    causal: bool,
    scale: float,
    window_left=None,
) -> tuple[Tensor, Tensor, Tensor]:
    batch = q.shape[0]
    window = _varlen_window(segments, causal=causal, window_left=window_left)
    cu = _cu_seqlens(segments, batch, q.device)
    grads = _torch_flash_backward_call(
        *(_pack(t) for t in (dout, q, k, v, out.to(q.dtype))),
        _pack_lse(lse),
        cu,
        causal=causal,
        scale=scale,
        window=window,
    )
    return tuple(g.unflatten(0, (batch, -1)) for g in grads)


TORCH_CUDA_FLASH = AttentionKernel(
    "torch_cuda_flash",
    _torch_cuda_forward,
    _torch_cuda_backward,
    varlen_forward=_torch_cuda_varlen_forward,
    varlen_backward=_torch_cuda_varlen_backward,
)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's cuDNN attention (cuDNN 9, Hopper's fastest in torch: docs/benchmarks.md). [B, H, S, D] views of our
# [B, S, H, D] blocks, GQA natively, lse [B, H, S, 1] fp32; no window, and no varlen here (see the module doc).
# ---------------------------------------------------------------------------------------------------------------

CUDNN_MAX_HEAD_DIM = 128  # cuDNN 9's fused attention forward + backward: head_dim <= 128, a multiple of 8


def _cudnn_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    if window_left is not None:
        raise ValueError("the cudnn kernel has no window: resolve_kernel gives banded blocks to another kernel")
    batch, q_len, heads, _ = q.shape
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *_bhsd(q, k, v), None, True, 0.0, causal, False, scale=scale
    )
    return result[0].transpose(1, 2), result[1].reshape(batch, heads, q_len)


def _cudnn_backward(
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
        raise ValueError("the cudnn kernel has no window: resolve_kernel gives banded blocks to another kernel")
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: not read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *_bhsd(dout, q, k, v, out.to(q.dtype)),
        lse.float().contiguous().unsqueeze(-1),  # [B, H, S, 1] fp32, as the forward returns it
        seed,
        offset,
        None,  # attn_bias: None, not an empty tensor
        None,  # cum_seq_q/k undefined: the dense path
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        scale=scale,
    )
    return _bhsd(dq, dk, dv)


CUDNN = AttentionKernel("cudnn", _cudnn_forward, _cudnn_backward)


# ---------------------------------------------------------------------------------------------------------------
# flash-attn 2 (optional extra `cuda`, package flash_attn): [B, S, H, D] natively, GQA natively, lse fp32.
# ---------------------------------------------------------------------------------------------------------------

FLASH_ATTN_VARLEN_MIN = (2, 6)  # the varlen lse is [H, total_q] (unpadded) from flash-attn 2.6 on


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
    backward(
        dout=dout.contiguous(),
        q=q,
        k=k,
        v=v,
        out=out.to(q.dtype),
        softmax_lse=lse.float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **_window_arguments(backward, left, right),
    )
    return dq, dk, dv


def _flash_attn_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
) -> tuple[Tensor, Tensor]:
    from flash_attn import flash_attn_varlen_func

    batch = q.shape[0]
    cu_q, cu_k, max_q, max_k = _cu_seqlens(segments, batch, q.device)
    out, lse, _ = flash_attn_varlen_func(
        _pack(q),
        _pack(k),
        _pack(v),
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        scale,
        causal,
        window_size=_varlen_window(segments, causal=causal, window_left=window_left),
        return_attn_probs=True,
    )
    return out.unflatten(0, (batch, -1)), _unpack_lse(lse, batch)


def _flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    segments: Segments,
    *,
    causal: bool,
    scale: float,
    window_left=None,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward as backward

    batch = q.shape[0]
    cu_q, cu_k, max_q, max_k = _cu_seqlens(segments, batch, q.device)
    q, k, v = (_pack(t).contiguous() for t in (q, k, v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(
        dout=_pack(dout).contiguous(),
        q=q,
        k=k,
        v=v,
        out=_pack(out.to(q.dtype)).contiguous(),
        softmax_lse=_pack_lse(lse),
        dq=dq,
        dk=dk,
        dv=dv,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **_window_arguments(backward, *_varlen_window(segments, causal=causal, window_left=window_left)),
    )
    return tuple(g.unflatten(0, (batch, -1)) for g in (dq, dk, dv))


FLASH_ATTN = AttentionKernel(
    "flash_attn",
    _flash_attn_forward,
    _flash_attn_backward,
    varlen_forward=_flash_attn_varlen_forward,
    varlen_backward=_flash_attn_varlen_backward,
)


# ---------------------------------------------------------------------------------------------------------------
# flash-attn 3 (Hopper; module flash_attn_interface, built from flash-attention's hopper/ directory). Public
# flash_attn_func / flash_attn_varlen_func with return_attn_probs=True give (out, lse); the backward from the
# final (out, lse) is the private _flash_attn_backward, called by keyword (its names moved between versions).
# ---------------------------------------------------------------------------------------------------------------


def _fa3_outputs(result: object) -> tuple[Tensor, Tensor]:
    if not isinstance(result, tuple) or len(result) < 2:
        raise RuntimeError("flash_attn_interface returned no log-sum-exp: this flash-attn 3 version is unsupported")
    return result[0], result[1]


def _fa3_call(fn: Callable, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
    if "return_attn_probs" in _parameters(fn):  # later versions return (out, lse) only when asked
        kwargs["return_attn_probs"] = True
    return _fa3_outputs(fn(*args, **kwargs))


def _fa3_backward_call(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int],
    varlen: dict,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn_interface import _flash_attn_backward as backward

    names = _parameters(backward)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    arguments = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, softmax_scale=scale)
    arguments["is_causal" if "is_causal" in names else "causal"] = causal
    arguments.update(_window_arguments(backward, *window), **varlen)
    missing = set(arguments) - names
    if missing:
        raise RuntimeError(f"flash_attn_interface._flash_attn_backward takes no {sorted(missing)}: unsupported version")
    backward(**arguments)
    return dq, dk, dv


def _fa3_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, window_left: int | None = None
) -> tuple[Tensor, Tensor]:
    from flash_attn_interface import flash_attn_func

    window = _flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    return _fa3_call(flash_attn_func, q, k, v, softmax_scale=scale, causal=causal, window_size=window)


def _fa3_backward(
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
    window = _flash_window(q.shape[1], k.shape[1], causal=causal, window_left=window_left)
    return _fa3_backward_call(
        dout.contiguous(),
        q,
        k,
        v,
        out.to(q.dtype),
        lse.float().contiguous(),
        causal=causal,
        scale=scale,
        window=window,
        varlen={},
    )


def _fa3_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, segments: Segments, *, causal: bool, scale: float, window_left=None
) -> tuple[Tensor, Tensor]:
    from flash_attn_interface import flash_attn_varlen_func

    batch = q.shape[0]
    cu_q, cu_k, max_q, max_k = _cu_seqlens(segments, batch, q.device)
    window = _varlen_window(segments, causal=causal, window_left=window_left)
    out, lse = _fa3_call(
        flash_attn_varlen_func,
        _pack(q),
        _pack(k),
        _pack(v),
        cu_q,
        cu_k,
        max_q,
        max_k,
        softmax_scale=scale,
        causal=causal,
        window_size=window,
    )
    return out.unflatten(0, (batch, -1)), _unpack_lse(lse, batch)


def _fa3_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    segments: Segments,
    *,
    causal: bool,
    scale: float,
    window_left=None,
) -> tuple[Tensor, Tensor, Tensor]:
    batch = q.shape[0]
    cu_q, cu_k, max_q, max_k = _cu_seqlens(segments, batch, q.device)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    grads = _fa3_backward_call(
        *(_pack(t).contiguous() for t in (dout, q, k, v, out.to(q.dtype))),
        _pack_lse(lse),
        causal=causal,
        scale=scale,
        window=_varlen_window(segments, causal=causal, window_left=window_left),
        varlen=varlen,
    )
    return tuple(g.unflatten(0, (batch, -1)) for g in grads)


FLASH_ATTN3 = AttentionKernel(
    "flash_attn3",
    _fa3_forward,
    _fa3_backward,
    varlen_forward=_fa3_varlen_forward,
    varlen_backward=_fa3_varlen_backward,
)


# ---------------------------------------------------------------------------------------------------------------
# The resolver: per device and case, the first kernel of an order that can do the case.
# ---------------------------------------------------------------------------------------------------------------

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
        torch_flash_window=_torch_flash_has_window(),
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


def _cannot(name: str, platform: Platform, case: KernelCase, need: str) -> str | None:
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
            reason = _cannot(name, platform, case, need)
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
