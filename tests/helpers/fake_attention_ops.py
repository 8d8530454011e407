"""CPU stand-ins for the CUDA attention ops that lctrain's CUDA kernels call, written from the ops' documented
semantics (not from lctrain's code), so the kernels' layouts, windows, lse shapes and varlen packing are checked
on CPU. They compute in float64 and check the arguments the real ops check.

- ``aten._flash_attention_forward/backward`` (PyTorch's flash-attn 2): q ``[B, Sq, H, D]`` or packed ``[T, H, D]``
  with int32 ``cu_seq_q/k``; lse ``[B, H, Sq]`` or ``[H, T]``; flash-attn's bottom-right window: query ``i`` of a
  sequence sees keys ``j`` with ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1: no limit), ``is_causal``
  sets ``right = 0``.
- ``aten._scaled_dot_product_cudnn_attention(_backward)``: ``[B, H, S, D]``, top-left causal mask, lse
  ``[B, H, Sq, 1]``, ``attn_bias`` None.

``patched()`` installs them on ``torch.ops.aten`` and counts the calls; ``h200_auto_kernel()`` is what
``parallel.attention_kernel=auto`` resolves to on the H200 (cuDNN; banded blocks and document groups on PyTorch's
flash kernels), usable on CPU tensors of any float dtype under ``patched()``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch import Tensor

from lctrain.attention import kernels


def _flash_mask(q_len: int, k_len: int, causal: bool, left: int | None, right: int | None) -> Tensor:
    left = -1 if left is None or left >= k_len else left
    right = -1 if right is None or right >= k_len else right
    if causal:
        right = 0
    i = torch.arange(q_len)[:, None] + k_len - q_len
    j = torch.arange(k_len)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def _attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q ``[S, H, D]``, k/v ``[Sk, Hkv, D]`` -> out ``[S, H, D]`` (float64), lse ``[H, S]``."""
    groups = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = torch.einsum("shd,thd->hst", qd, kd) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.einsum("hst,thd->shd", (scores - lse[..., None]).exp(), vd), lse


def _grads(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, visible: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one sequence from the given ``out`` and ``lse`` ``[H, S]`` (as the flash backward does)."""
    hkv = k.shape[1]
    groups = q.shape[1] // hkv
    qd, dod, od = q.double(), dout.double(), out.double()
    kd, vd = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = (torch.einsum("shd,thd->hst", qd, kd) * scale).masked_fill(~visible, float("-inf"))
    probs = (scores - lse.double()[..., None]).exp()
    dv = torch.einsum("hst,shd->thd", probs, dod)
    delta = (dod * od).sum(-1).transpose(0, 1)  # [H, S]
    dscores = probs * (torch.einsum("shd,thd->hst", dod, vd) - delta[..., None])
    dq = torch.einsum("hst,thd->shd", dscores, kd) * scale
    dk = torch.einsum("hst,shd->thd", dscores, qd) * scale
    fold = lambda g: g.unflatten(1, (hkv, groups)).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _sequences(q: Tensor, k: Tensor, cu_q: Tensor | None, cu_k: Tensor | None) -> list[tuple[slice, slice, int]]:
    """(query rows, key rows, batch row) of each sequence; dense inputs have one per batch row."""
    if cu_q is None:
        return [(slice(0, q.shape[1]), slice(0, k.shape[1]), b) for b in range(q.shape[0])]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.shape == cu_k.shape, (cu_q, cu_k)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    assert bq[-1] == q.shape[0] and bk[-1] == k.shape[0], "cu_seqlens must end at the packed lengths"
    return [(slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1]), -1) for i in range(len(bq) - 1)]


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    assert q.dtype == k.dtype == v.dtype, "query, key and value must have the same dtype"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "Input tensor must have contiguous last dimension"
    assert q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"


def flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None, **window):  # noqa: ANN001, ANN201
    _check(q, k, v)
    assert dropout_p == 0.0
    out = torch.empty_like(q)
    varlen = cu_q is not None
    lse = torch.empty((q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]))
    for rows, cols, b in _sequences(q, k, cu_q, cu_k):
        qs, ks, vs = (q[rows], k[cols], v[cols]) if varlen else (q[b, rows], k[b, cols], v[b, cols])
        visible = _flash_mask(
            qs.shape[0], ks.shape[0], is_causal, window.get("window_size_left"), window.get("window_size_right")
        )
        o, m = _attend(qs, ks, vs, visible, scale)
        if varlen:
            out[rows], lse[:, rows] = o.to(q.dtype), m.float()
        else:
            out[b, rows], lse[b] = o.to(q.dtype), m.float()
    return out, lse.float(), torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def flash_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    **window,
):  # noqa: ANN001, ANN201
    _check(q, k, v)
    assert out.dtype == dout.dtype == q.dtype, "query and out / dout must have the same dtype"
    assert lse.dtype == torch.float32
    varlen = cu_q is not None
    expected = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    assert tuple(lse.shape) == expected, (tuple(lse.shape), expected)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rows, cols, b in _sequences(q, k, cu_q, cu_k):
        pick = (lambda t, r: t[r]) if varlen else (lambda t, r, b=b: t[b, r])  # noqa: E731
        seq_lse = lse[:, rows] if varlen else lse[b]
        visible = _flash_mask(
            rows.stop - rows.start,
            cols.stop - cols.start,
            is_causal,
            window.get("window_size_left"),
            window.get("window_size_right"),
        )
        g = _grads(
            pick(dout, rows), pick(q, rows), pick(k, cols), pick(v, cols), pick(out, rows), seq_lse, visible, scale
        )
        for target, grad, r in zip((dq, dk, dv), g, (rows, cols, cols)):
            if varlen:
                target[r] = grad.to(q.dtype)
            else:
                target[b, r] = grad.to(q.dtype)
    return dq, dk, dv


def _cudnn_mask(q_len: int, k_len: int, causal: bool) -> Tensor:
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    return visible.tril() if causal else visible  # top-left aligned


def cudnn_forward(
    q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):  # noqa: ANN001, ANN201
    assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
    _check(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    batch, heads, q_len, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, q_len, 1)
    visible = _cudnn_mask(q_len, k.shape[2], is_causal)
    for b in range(batch):
        o, m = _attend(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), visible, scale)
        out[b] = o.transpose(0, 1).to(q.dtype)
        lse[b, :, :, 0] = m.float()
    empty = torch.empty(0)
    return out, lse, empty, empty, q_len, k.shape[2], empty, empty, empty


def cudnn_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    seed,
    offset,
    attn_bias,
    cum_q,
    cum_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):  # noqa: ANN001, ANN201
    assert attn_bias is None and cum_q is None and cum_k is None and dropout_p == 0.0
    assert tuple(lse.shape) == (q.shape[0], q.shape[1], q.shape[2], 1) and lse.dtype == torch.float32
    assert (max_q, max_k) == (q.shape[2], k.shape[2])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    visible = _cudnn_mask(q.shape[2], k.shape[2], is_causal)
    for b in range(q.shape[0]):
        g = _grads(*(t[b].transpose(0, 1) for t in (grad_out, q, k, v, out)), lse[b, :, :, 0], visible, scale)
        for target, grad in zip((dq, dk, dv), g):
            target[b] = grad.transpose(0, 1).to(q.dtype)
    return dq, dk, dv


FAKES = {
    "_flash_attention_forward": flash_forward,
    "_flash_attention_backward": flash_backward,
    "_scaled_dot_product_cudnn_attention": cudnn_forward,
    "_scaled_dot_product_cudnn_attention_backward": cudnn_backward,
}


@contextlib.contextmanager
def patched() -> Iterator[Counter]:
    """The fakes installed on ``torch.ops.aten`` (restored after); yields a Counter of calls per op name."""
    calls: Counter = Counter()
    originals = {name: getattr(torch.ops.aten, name) for name in FAKES}

    def counting(name: str, fake):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return fake(*args, **kwargs)

        return call

    try:
        for name, fake in FAKES.items():
            setattr(torch.ops.aten, name, counting(name, fake))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.ops.aten, name, original)


def h200_auto_kernel() -> kernels.AttentionKernel:
    h200 = kernels.Platform("cuda", (9, 0), 91900)  # torch 2.11, cuDNN 9.19, no flash-attn (docs/benchmarks.md)
    case = kernels.KernelCase(torch.bfloat16, 64, 8, 2)
    return kernels.resolve(torch.device("cuda"), case, platform=h200).kernel()
