"""A CPU stand-in for flash-linear-attention's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, written from its
documented semantics (not from lctrain's code), so lctrain's fla path (layouts, heads, dtypes, initial states,
``cu_seqlens`` offsets) runs and is checked on CPU.

Documented: q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` (one head count, one dtype, not fp32), g (log decay) and beta
``[B, T, H]``; ``scale`` multiplies the queries (default ``K ** -0.5``); ``use_qk_l2norm_in_kernel`` L2-norms q and k
first; ``cu_seqlens`` (``[N + 1]``, long, from 0 to T, batch 1) cuts the tokens into N sequences, each starting from
its ``initial_state`` ``[N, H, K, V]`` (zero when None; N = B without offsets); returns (o ``[B, T, H, V]`` in the
inputs' dtype, the final states ``[N, H, K, V]`` in fp32 when ``output_final_state``, else None). Each sequence is
computed by transformers' token-by-token recurrence (fp32), which is differentiable.

``installed(monkeypatch)`` puts the module in ``sys.modules`` and makes lctrain choose it on any device; it returns
the list the calls' ``cu_seqlens`` are appended to.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from lctrain.linear_attention import kernel


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, cu_seqlens: Tensor | None):
    assert q.dtype == k.dtype == v.dtype and q.dtype != torch.float32, (q.dtype, k.dtype, v.dtype)
    assert q.dim() == 4 and q.shape == k.shape and v.shape[:3] == q.shape[:3], (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == q.shape[:3], (g.shape, beta.shape)
    sequences = q.shape[0]
    if cu_seqlens is not None:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and cu_seqlens.dim() == 1
        assert cu_seqlens[0] == 0 and cu_seqlens[-1] == q.shape[1] and bool((cu_seqlens.diff() > 0).all())
        sequences = len(cu_seqlens) - 1
    if state is not None:
        assert state.shape == (sequences, q.shape[2], q.shape[3], v.shape[3]), state.shape


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    CALLS.append(cu_seqlens)
    dim = q.shape[-1]
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
    q = q * ((dim**-0.5 if scale is None else scale) * dim**0.5)  # the recurrence scales by dim ** -0.5 itself
    if cu_seqlens is None:  # each row its own sequence
        rows = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        bounds = cu_seqlens.tolist()
        rows = [(0, a, e) for a, e in zip(bounds, bounds[1:])]
    outs, finals = [], []
    for index, (row, a, e) in enumerate(rows):
        state = None if initial_state is None else initial_state[index : index + 1]
        out, final = torch_recurrent_gated_delta_rule(
            *(t[row : row + 1, a:e] for t in (q, k, v)),
            g=g[row : row + 1, a:e],
            beta=beta[row : row + 1, a:e],
            initial_state=state,
            output_final_state=True,
        )
        outs.append(out)
        finals.append(final)
    out = torch.cat(outs, dim=0 if cu_seqlens is None else 1).to(v.dtype)
    return out, torch.cat(finals).float() if output_final_state else None


CALLS: list[Tensor | None] = []


def installed(monkeypatch: pytest.MonkeyPatch) -> list[Tensor | None]:
    """Install the stand-in as ``fla.ops.gated_delta_rule`` and have lctrain choose fla whatever the device."""
    CALLS.clear()
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setattr(kernel, "fla_usable", lambda device, dtype: True)
    return CALLS
