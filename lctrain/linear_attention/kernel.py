"""The chunked gated delta rule kernel the linear-attention layers run, chosen per call from the tensors.

On CUDA in bf16 or fp16, with flash-linear-attention installed (the ``cuda`` extra), it is fla's Triton kernel
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, which takes per-document offsets (``cu_seqlens``, batch 1), so
a piece's documents are one call; elsewhere (CPU, fp32, fla absent) transformers' pure-torch chunked kernel, one call
per document. Both compute ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``,
``o_t = S_t^T q_t / sqrt(dk)`` with q and k L2-normed, the state in fp32. fla is imported when first used, never at
import time; lctrain gives it bf16 or fp16 only (versions before 0.5 refuse fp32).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Sequence

import torch
from torch import Tensor
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

FLA_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fla's kernel runs tensors of ``dtype`` on ``device``: CUDA, bf16 or fp16, fla installed."""
    return device.type == "cuda" and dtype in FLA_DTYPES and fla_installed()


def check_torch_path(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse the torch path on CUDA with fla installed: transformers' torch kernel then hands its calls to fla
    itself, with lctrain's fp32 tensors and mixed dtypes as they are."""
    if device.type == "cuda" and fla_installed():
        raise ValueError(
            f"the gated delta layers run in {dtype} on CUDA only through transformers' torch kernel, which hands its "
            "calls to flash-linear-attention when installed: set parallel.param_dtype=bfloat16 or uninstall it"
        )


def describe_linear_kernel(device: torch.device | None, dtype: torch.dtype | None) -> str:
    """One line for the job's log: which gated delta kernel runs on ``device`` in ``dtype``, and why."""
    if device is None or dtype is None:
        return "chosen per call (fla's chunk_gated_delta_rule on CUDA in bf16/fp16 when installed, else transformers')"
    if fla_usable(device, dtype):
        return "fla's chunk_gated_delta_rule (flash-linear-attention, documents in one call by cu_seqlens)"
    check_torch_path(device, dtype)
    if device.type != "cuda":
        why = f"fla runs on CUDA only, not {device.type}"
    elif dtype not in FLA_DTYPES:
        why = f"lctrain runs fla in bf16 or fp16, not {dtype}"
    else:
        why = "flash-linear-attention is not installed (pip install 'lctrain[cuda]')"
    return f"transformers' torch chunked kernel ({why})"


def _fla_call(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, cu_seqlens: Tensor | None
):
    """fla's kernel on lctrain's tensors: q and k repeated to v's heads (each key head serves ``Hv / Hk``
    consecutive value heads, as transformers' kernel does), q and v in k's dtype (fla wants one dtype)."""
    rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    groups = v.shape[2] // k.shape[2]
    q, k = (t.to(k.dtype).repeat_interleave(groups, dim=2) for t in (q, k))
    return rule(
        q,
        k,
        v.to(k.dtype),
        g,
        beta,
        scale=k.shape[-1] ** -0.5,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )


def gated_delta(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """One run per row: q, k ``[B, L, Hk, dk]``, v ``[B, L, Hv, dv']``, g, beta ``[B, L, Hv]``, state
    ``[B, Hv, dk, dv']`` or None (zero) -> (out ``[B, L, Hv, dv']`` in q's dtype, state leaving, fp32)."""
    if fla_usable(k.device, k.dtype):
        out, final = _fla_call(q, k, v, g, beta, state, None)
        return out.to(q.dtype), final.float()
    check_torch_path(k.device, k.dtype)
    return torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def gated_delta_documents(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, bounds: Sequence[tuple[int, int]]
) -> tuple[list[Tensor], list[Tensor]]:
    """Documents ``[start, stop)`` of the rows (consecutive, end to end), each run from a zero state; tensors as
    ``gated_delta``'s -> (each document's outputs ``[B, stop - start, Hv, dv']``, the state leaving each one).
    fla: one call, the rows' documents flattened into one sequence with their offsets; else one call each."""
    if not fla_usable(k.device, k.dtype):
        runs = [gated_delta(*(t[:, a:b] for t in (q, k, v, g, beta)), None) for a, b in bounds]
        return [out for out, _ in runs], [state for _, state in runs]
    first, last = bounds[0][0], bounds[-1][1]
    batch, length = q.shape[0], last - first
    flat = [t[:, first:last].flatten(0, 1)[None] for t in (q, k, v, g, beta)]
    cuts = [row * length + b - first for row in range(batch) for _, b in bounds]
    cu_seqlens = torch.tensor([0, *cuts], dtype=torch.long, device=q.device)
    out, final = _fla_call(*flat, None, cu_seqlens)
    out = out.reshape(batch, length, *out.shape[2:]).to(q.dtype)
    final = final.float().reshape(batch, len(bounds), *final.shape[1:])  # [B, documents, Hv, dk, dv']
    return [out[:, a - first : b - first] for a, b in bounds], list(final.unbind(1))
